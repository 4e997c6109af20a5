/**
 * `magus nats-auth --out DIR [--prefix P]`: NATS users per role (dataplane/roles.ts) for a server
 * that magus processes reach. Writes one credentials file per role (`gateway.creds`, …, mode
 * 0600: each holds its user's nkey seed, a secret) and `nats-auth.conf`, the `authorization`
 * block to include in nats-server's configuration (public keys and permissions only). Each
 * process then gets its role's file as `MAGUS_NATS_CREDENTIALS`. Never overwrites: a folder that
 * already holds any of these files is refused (rotate by writing a new folder).
 */
import { existsSync, mkdirSync, renameSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { dataPlaneNames, type DataPlaneNames } from '../dataplane';
import { credentialsFileText, natsAuthorizationConfig, NATS_ROLES, newRoleCredentials } from '../dataplane/roles';

export const NATS_AUTH_USAGE = [
  'usage: magus nats-auth --out DIR [--prefix P]',
  '',
  'NATS users per role, each allowed only its own subjects and buckets: gateway, bridge, controller, worker.',
  'Writes DIR/<role>.creds (0600, a secret: the user nkey seed; give each process its own as',
  "MAGUS_NATS_CREDENTIALS) and DIR/nats-auth.conf (include it in nats-server's configuration:",
  '"include nats-auth.conf"). --prefix: the data plane\'s MAGUS_NATS_PREFIX, if any. Never overwrites.',
].join('\n');

export function natsAuthCommand(args: string[]): number {
  let out: string | undefined;
  let prefix = '';
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === '--out' || a === '--prefix') {
      const v = args[++i];
      if (v === undefined) return usageError(`${a} needs a value`);
      if (a === '--out') out = v;
      else prefix = v;
    } else return usageError(`unknown option ${a}`);
  }
  if (!out) return usageError('--out DIR is required');
  let names;
  try {
    names = dataPlaneNames(prefix);
  } catch (err) {
    return usageError((err as Error).message);
  }
  const files = natsAuthFiles();
  const taken = files.filter((f) => existsSync(join(out, f)));
  if (taken.length > 0) {
    process.stderr.write(`magus nats-auth: ${out} already holds ${taken.join(', ')}: nothing written (a new folder for new users)\n`);
    return 1;
  }
  writeNatsAuth(out, names);
  process.stdout.write(
    [
      `wrote ${files.map((f) => join(out, f)).join(', ')}`,
      `nats-server: add "include ${join(out, 'nats-auth.conf')}" to its configuration and reload it;`,
      'each process: MAGUS_NATS_CREDENTIALS=<its role>.creds (gateway: magus gateway; bridge: instance pods; controller:',
      'magus controller, magus keys, magus usage; worker: magus worker).',
      '',
    ].join('\n'),
  );
  return 0;
}

/** The files `magus nats-auth` writes in `dir` (each role's credentials, then the server's configuration). */
export const natsAuthFiles = (): string[] => [...NATS_ROLES.map((r) => `${r}.creds`), 'nats-auth.conf'];

/** Writes new users per role into `dir` (made 0700 if missing): each file under a temporary name, then renamed, so one that exists is whole. */
export function writeNatsAuth(dir: string, names: DataPlaneNames): void {
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const users = NATS_ROLES.map(newRoleCredentials);
  const write = (name: string, text: string, mode: number) => {
    const tmp = join(dir, `.${name}.tmp`);
    writeFileSync(tmp, text, { mode });
    renameSync(tmp, join(dir, name));
  };
  for (const u of users) write(`${u.role}.creds`, credentialsFileText(u), 0o600);
  // Last: its presence says the credentials before it are all there.
  write('nats-auth.conf', natsAuthorizationConfig(users, names), 0o644);
}

function usageError(message: string): number {
  process.stderr.write(`magus nats-auth: ${message}\n${NATS_AUTH_USAGE}\n`);
  return 2;
}
