/**
 * `magus keys`' command line (parseKeysArgs: what it accepts, and the usage error naming what is
 * wrong otherwise) and its tokens (newToken: `mgs_<16 hex>_<secret>`, the one pattern the
 * gateway and the controller read, its id the one embedded).
 */
import { TOKEN_PATTERN } from '../dataplane/keys';
import { newToken, parseKeysArgs } from './keys';

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
    expect(usageError([])).toBe('magus keys needs a command: create, list or revoke');
  });
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
