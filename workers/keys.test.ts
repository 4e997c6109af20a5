/**
 * `magus keys`' command line (parseKeysArgs: what it accepts — limits within KeyLimits' bounds
 * included — and the usage error naming what is wrong otherwise) and its tokens (newToken: `mgs_<16 hex>_<secret>`, the one pattern the
 * gateway and the controller read, its id the one embedded).
 */
import { TOKEN_PATTERN } from '../dataplane/keys';
import { MAX_BUDGET_TOKENS, MAX_PER_MINUTE } from '../shared/limits';
import { KEYS_USAGE, newToken, parseKeysArgs } from './keys';

/** The message of the UsageError `args` raise. */
function usageError(args: string[]): string {
  try {
    parseKeysArgs(args);
  } catch (err) {
    expect((err as Error).name).toBe('UsageError');
    return (err as Error).message;
  }
  throw new Error(`no UsageError for ${JSON.stringify(args)}`);
}

describe('parseKeysArgs', () => {
  it('reads good command lines', () => {
    expect(parseKeysArgs(['create', 'team-a'])).toEqual({ command: 'create', name: 'team-a' });
    expect(parseKeysArgs(['create', 'a'])).toEqual({ command: 'create', name: 'a' });
    expect(parseKeysArgs(['create', 'team-a', '--models', 'llama,default/qwen3, ns/*'])).toEqual({
      command: 'create',
      name: 'team-a',
      models: ['llama', 'default/qwen3', 'ns/*'],
    });
    expect(parseKeysArgs(['create', 'team-a', '--models', 'Qwen3-0.6B_q4.gguf'])).toEqual({
      command: 'create',
      name: 'team-a',
      models: ['Qwen3-0.6B_q4.gguf'],
    });
    expect(parseKeysArgs(['create', 'team-a', '--models', '*'])).toEqual({ command: 'create', name: 'team-a', models: ['*'] });
    expect(parseKeysArgs(['create', '--models', 'llama', 'team-a'])).toEqual({ command: 'create', name: 'team-a', models: ['llama'] });
    expect(parseKeysArgs(['create', 'x'.repeat(63)])).toEqual({ command: 'create', name: 'x'.repeat(63) });
    expect(parseKeysArgs(['list'])).toEqual({ command: 'list', json: false });
    expect(parseKeysArgs(['list', '--json'])).toEqual({ command: 'list', json: true });
    expect(parseKeysArgs(['revoke', 'team-a'])).toEqual({ command: 'revoke', name: 'team-a' });
  });

  it('reads limits, in any order, stored in one order', () => {
    expect(parseKeysArgs(['create', 'team-a', '--budget-tokens', '300', '--period', 'day', '--rpm', '5'])).toEqual({
      command: 'create',
      name: 'team-a',
      limits: { requestsPerMinute: 5, budget: { tokens: 300, period: 'day' } },
    });
    const all = parseKeysArgs(['create', '--period', 'month', '--concurrency', '4', 'team-a', '--tpm', '10000', '--budget-tokens', '1000000', '--rpm', '60']);
    expect(all).toEqual({
      command: 'create',
      name: 'team-a',
      limits: { requestsPerMinute: 60, tokensPerMinute: 10000, concurrency: 4, budget: { tokens: 1000000, period: 'month' } },
    });
    expect(Object.keys((all as { limits: object }).limits)).toEqual(['requestsPerMinute', 'tokensPerMinute', 'concurrency', 'budget']);
    // The bounds are KeyLimits' own.
    expect(parseKeysArgs(['create', 'a', '--rpm', String(MAX_PER_MINUTE), '--budget-tokens', String(MAX_BUDGET_TOKENS), '--period', 'day'])).toMatchObject({
      limits: { requestsPerMinute: MAX_PER_MINUTE, budget: { tokens: MAX_BUDGET_TOKENS } },
    });
    expect(parseKeysArgs(['create', 'a', '--models', 'llama', '--concurrency', '1'])).toEqual({
      command: 'create',
      name: 'a',
      models: ['llama'],
      limits: { concurrency: 1 },
    });
    expect(parseKeysArgs(['limits', 'team-a', '--tpm', '500'])).toEqual({ command: 'limits', name: 'team-a', limits: { tokensPerMinute: 500 } });
    expect(parseKeysArgs(['limits', 'team-a', '--none'])).toEqual({ command: 'limits', name: 'team-a', limits: undefined });
    // A storage quota, and limits of models of their own (a bare name is magus dev's, namespace default).
    expect(
      parseKeysArgs([
        'create',
        'team-b',
        '--model-limits',
        'team/phi:budget=500/day,concurrency=1',
        '--storage-bytes',
        '1000000',
        '--model-limits',
        'llama:rpm=5, tpm=900',
      ]),
    ).toEqual({
      command: 'create',
      name: 'team-b',
      limits: {
        models: { 'default/llama': { requestsPerMinute: 5, tokensPerMinute: 900 }, 'team/phi': { concurrency: 1, budget: { tokens: 500, period: 'day' } } },
        storageBytes: 1000000,
      },
    });
  });

  it('refuses model limits it cannot read, naming what is wrong', () => {
    expect(usageError(['create', 'a', '--model-limits', 'rpm=5'])).toBe('--model-limits "rpm=5": give MODEL:LIMITS, MODEL a model\'s name or NAMESPACE/NAME');
    expect(usageError(['create', 'a', '--model-limits', 'llama:rps=5'])).toBe(
      '--model-limits "llama:rps=5": "rps=5" is not rpm=N, tpm=N, concurrency=N or budget=N/day|month',
    );
    expect(usageError(['create', 'a', '--model-limits', 'llama:budget=5'])).toMatch(/"budget=5" is not/);
    expect(usageError(['create', 'a', '--model-limits', 'llama:concurrency=0'])).toBe(
      '--model-limits default/llama.concurrency must be a whole number from 1 to 1000000, got 0',
    );
    expect(usageError(['create', 'a', '--storage-bytes', '0'])).toBe(
      '--storage-bytes must be a whole number from 1 to 1000000000000000 (bytes of stored responses), got "0"',
    );
    expect(usageError(['create', 'a', '--model-limits'])).toBe('--model-limits needs a value: MODEL:rpm=N,…');
  });

  it('refuses limits that are not whole numbers within the bounds, a budget without its period and a period alone', () => {
    for (const bad of ['0', 'x', '-1', '1.5', '1e3', '', ' 5', String(MAX_PER_MINUTE + 1)]) {
      expect(usageError(['create', 'team-a', '--rpm', bad])).toBe(
        `--rpm must be a whole number from 1 to ${MAX_PER_MINUTE} (requests per minute), got ${JSON.stringify(bad)}`,
      );
    }
    expect(usageError(['create', 'team-a', '--tpm', '0'])).toBe(`--tpm must be a whole number from 1 to ${MAX_PER_MINUTE} (tokens per minute), got "0"`);
    expect(usageError(['create', 'team-a', '--concurrency', '1000001'])).toBe(
      '--concurrency must be a whole number from 1 to 1000000 (requests in flight at once), got "1000001"',
    );
    expect(usageError(['create', 'team-a', '--budget-tokens', String(MAX_BUDGET_TOKENS + 1), '--period', 'day'])).toBe(
      `--budget-tokens must be a whole number from 1 to ${MAX_BUDGET_TOKENS} (tokens per period), got "${MAX_BUDGET_TOKENS + 1}"`,
    );
    expect(usageError(['create', 'team-a', '--budget-tokens', '5'])).toBe(
      '--budget-tokens needs --period day or --period month: the budget renews each UTC day or each calendar month',
    );
    expect(usageError(['create', 'team-a', '--period', 'day'])).toBe('--period is the period of a budget: give --budget-tokens N with it');
    expect(usageError(['create', 'team-a', '--period', 'week', '--budget-tokens', '5'])).toBe('--period must be day or month, got "week"');
    expect(usageError(['create', 'team-a', '--rpm'])).toBe('--rpm needs a value');
    expect(usageError(['create', 'team-a', '--rpm', '5', '--rpm', '6'])).toBe('--rpm is given twice');
    expect(usageError(['create', '--rpm', '5'])).toBe('magus keys create needs a NAME'); // 5 is --rpm's, not a name
    expect(usageError(['create', 'team-a', '--none'])).toBe('unknown option --none');
    expect(usageError(['limits', 'team-a'])).toBe(
      'magus keys limits needs the limits to set (--rpm, --tpm, --concurrency, --budget-tokens with --period, --storage-bytes, --model-limits) or --none',
    );
    expect(usageError(['limits', 'team-a', '--none', '--rpm', '5'])).toBe('--none makes the key unlimited: give it alone, or the limits without it');
    expect(usageError(['limits', 'team-a', '--models', 'llama'])).toBe('unknown option --models');
    expect(usageError(['limits', '--rpm', '5'])).toBe('magus keys limits needs a NAME');
  });

  it('refuses a missing or bad name', () => {
    expect(usageError(['create'])).toBe('magus keys create needs a NAME');
    expect(usageError(['revoke'])).toBe('magus keys revoke needs a NAME');
    expect(usageError(['create', '--models', 'llama'])).toBe('magus keys create needs a NAME');
    for (const bad of ['Team-A', 'team_a', 'team-', 'a.b', 'local/a', 'x'.repeat(64)]) {
      expect(usageError(['create', bad])).toBe(
        `key name ${JSON.stringify(bad)} must be 1-63 characters of a-z, 0-9 and '-', starting and ending with a letter or digit`,
      );
      expect(usageError(['revoke', bad])).toContain(`key name ${JSON.stringify(bad)} must be`);
    }
  });

  it('refuses bad --models', () => {
    expect(usageError(['create', 'team-a', '--models'])).toBe('--models needs a value: MODEL,…');
    expect(usageError(['create', 'team-a', '--models', ''])).toBe('--models lists no model (leave it out for every model)');
    expect(usageError(['create', 'team-a', '--models', ' , ,'])).toBe('--models lists no model (leave it out for every model)');
    for (const bad of ['Ns/llama', 'a/b/c', '-llama', 'ns/', '/llama', 'lla ma', 'ns/*x']) {
      expect(usageError(['create', 'team-a', '--models', `llama,${bad}`])).toBe(
        `--models: ${JSON.stringify(bad.trim())} is not a model name, NAMESPACE/NAME or NAMESPACE/*`,
      );
    }
  });

  it('refuses unknown options and commands', () => {
    expect(usageError(['create', 'team-a', '--model', 'llama'])).toBe('unknown option --model');
    expect(usageError(['create', 'team-a', 'team-b'])).toBe('unknown option team-b');
    expect(usageError(['list', '--all'])).toBe('unknown option --all');
    expect(usageError(['list', 'team-a'])).toBe('unknown option team-a');
    expect(usageError(['revoke', 'team-a', '--force'])).toBe('unknown option --force');
    expect(usageError(['delete', 'team-a'])).toBe('unknown command keys delete');
    expect(usageError([])).toBe('magus keys needs a command: create, limits, list or revoke');
  });
});

test('the usage names every limit flag with its bounds', () => {
  for (const flag of ['--rpm', '--tpm', '--concurrency', '--budget-tokens', '--period', '--storage-bytes', '--model-limits'])
    expect(KEYS_USAGE).toContain(`${flag} `);
  expect(KEYS_USAGE).toContain(`(1-${MAX_PER_MINUTE})`);
  expect(KEYS_USAGE).toContain(`(1-${MAX_BUDGET_TOKENS})`);
});

describe('newToken', () => {
  it('is mgs_<16 hex>_<secret>, read back by TOKEN_PATTERN with its id, never the same twice', () => {
    const seen = new Set<string>();
    for (let i = 0; i < 2000; i++) {
      const { id, token } = newToken();
      expect(id).toMatch(/^[0-9a-f]{16}$/);
      const m = TOKEN_PATTERN.exec(token);
      expect(m?.[1]).toBe(id); // a secret holding '_' or '-' never moves the id's end
      expect(m?.[2]).toHaveLength(43); // 32 random bytes, base64url
      seen.add(id);
    }
    expect(seen.size).toBe(2000);
  });
});
