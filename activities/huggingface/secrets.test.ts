import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import type { SecretRef } from '../../shared/model';
import { createSecretResolver, isSecretUnavailable } from './secrets';

const VALUE = 'hf_unitTestSecretValue';

let dir: string;
beforeAll(async () => {
  dir = await mkdtemp(path.join(tmpdir(), 'magus-secrets-'));
});
afterAll(async () => {
  await rm(dir, { recursive: true, force: true });
});

async function unavailable(p: Promise<unknown>): Promise<Error & { code: string }> {
  const err = await p.then(
    () => {
      throw new Error('expected SecretUnavailable');
    },
    (e: unknown) => e,
  );
  expect(isSecretUnavailable(err)).toBe(true);
  const e = err as Error & { code: string };
  expect(e.code).toBe('SecretUnavailable');
  expect(e.message).not.toContain(VALUE);
  return e;
}

describe('createSecretResolver', () => {
  test('env references read the given environment, trimmed', async () => {
    const resolve = createSecretResolver({ env: { HF_TOKEN: ` ${VALUE}\n`, EMPTY: '  ' } });
    await expect(resolve({ env: 'HF_TOKEN' })).resolves.toBe(VALUE);
    expect((await unavailable(resolve({ env: 'MISSING_TOKEN' }))).message).toBe('environment variable MISSING_TOKEN is not set');
    expect((await unavailable(resolve({ env: 'EMPTY' }))).message).toBe('environment variable EMPTY is empty');
  });

  test('env references default to process.env', async () => {
    process.env.MAGUS_SECRETS_TEST_TOKEN = VALUE;
    try {
      await expect(createSecretResolver()({ env: 'MAGUS_SECRETS_TEST_TOKEN' })).resolves.toBe(VALUE);
    } finally {
      delete process.env.MAGUS_SECRETS_TEST_TOKEN;
    }
  });

  test('file references read the file, trimmed; missing or unreadable files name the path', async () => {
    const resolve = createSecretResolver({ env: {} });
    const file = path.join(dir, 'token');
    await writeFile(file, `${VALUE}\n`);
    await expect(resolve({ file })).resolves.toBe(VALUE);

    const missing = path.join(dir, 'nope');
    expect((await unavailable(resolve({ file: missing }))).message).toBe(`file ${missing} cannot be read (ENOENT)`);
    expect((await unavailable(resolve({ file: dir }))).message).toBe(`file ${dir} cannot be read (EISDIR)`);
    const empty = path.join(dir, 'empty');
    await writeFile(empty, '\n');
    expect((await unavailable(resolve({ file: empty }))).message).toBe(`file ${empty} is empty`);
    if (process.getuid?.() !== 0) {
      const locked = path.join(dir, 'locked');
      await writeFile(locked, VALUE);
      await chmod(locked, 0o000);
      expect((await unavailable(resolve({ file: locked }))).message).toBe(`file ${locked} cannot be read (EACCES)`);
    }
  });

  test('Secret references without a Kubernetes client, and unknown reference shapes', async () => {
    const resolve = createSecretResolver({ env: {} });
    expect((await unavailable(resolve({ secret: { name: 'hf', key: 'token', namespace: 'ml' } }))).message).toBe(
      'key token of Secret ml/hf cannot be read: no Kubernetes client is configured',
    );
    await unavailable(resolve({ vault: 'x' } as unknown as SecretRef));
  });
});
