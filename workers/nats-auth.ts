/**
 * `magus nats-auth`: NATS users per role (dataplane/roles.ts) for a server that magus processes
 * reach. `--out DIR` makes a new operator and account (nats-server in operator mode) and writes
 * `nats-auth.conf`, the server's side to include in its configuration (JWTs only, no secret); one
 * credentials file per role (`gateway.creds`, `controller.creds`, `worker.creds`, mode 0600:
 * each holds its user's seed, a secret), given to each process as `MAGUS_NATS_CREDENTIALS`; and
 * `nats-values.yaml`, the same for the official nats Helm chart (`-f`); and
 * `bridge-signer.nk` (0600), the account's signing key, with which the Kubernetes runtime makes
 * each instance's bridge a user of its own (`MAGUS_K8S_BRIDGE_NATS_SIGNER`). Never overwrites: a
 * folder that already holds any of these files is refused (rotate by writing a new folder).
 *
 * `--bridge POOL/INSTANCE --signer FILE` prints the credentials of one instance's bridge (for a
 * bridge run by hand).
 */
import { existsSync, mkdirSync, renameSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { dataPlaneNames, type DataPlaneNames } from '../dataplane';
import {
  bridgeCredentialsText,
  natsChartValues,
  natsServerAuthConfig,
  newNatsAuthority,
  readNatsSigner,
  roleCredentialsText,
  signerFileText,
} from '../dataplane/roles';

export const NATS_AUTH_USAGE = [
  'usage: magus nats-auth --out DIR [--prefix P]',
  '       magus nats-auth --bridge POOL/INSTANCE --signer DIR/bridge-signer.nk [--prefix P]',
  '',
  'NATS users per role, each allowed only its own subjects and buckets: gateway, controller, worker, and',
  "one bridge per instance. --out writes DIR/nats-auth.conf (include it in nats-server's configuration:",
  '"include nats-auth.conf"; operator mode, no secret), DIR/<role>.creds (0600, a secret; give each process',
  'its own as MAGUS_NATS_CREDENTIALS) and DIR/bridge-signer.nk (0600, a secret: the Kubernetes runtime makes',
  "each instance's bridge user with it, MAGUS_K8S_BRIDGE_NATS_SIGNER). Never overwrites.",
  'DIR/nats-values.yaml: nats-auth.conf as values of the official nats Helm chart (helm install nats … -f it).',
  "--bridge prints the credentials of one instance's bridge, signed by --signer.",
  "--prefix: the data plane's MAGUS_NATS_PREFIX, if any.",
].join('\n');

export async function natsAuthCommand(args: string[]): Promise<number> {
  let out: string | undefined;
  let prefix = '';
  let bridge: string | undefined;
  let signer: string | undefined;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === '--out' || a === '--prefix' || a === '--bridge' || a === '--signer') {
      const v = args[++i];
      if (v === undefined) return usageError(`${a} needs a value`);
      if (a === '--out') out = v;
      else if (a === '--prefix') prefix = v;
      else if (a === '--bridge') bridge = v;
      else signer = v;
    } else return usageError(`unknown option ${a}`);
  }
  let names;
  try {
    names = dataPlaneNames(prefix);
  } catch (err) {
    return usageError((err as Error).message);
  }
  if (bridge !== undefined || signer !== undefined) {
    if (out) return usageError('--out and --bridge are two different uses: one at a time');
    if (!bridge || !signer) return usageError('--bridge POOL/INSTANCE needs --signer FILE, and --signer needs --bridge');
    const [pool, instance, ...rest] = bridge.split('/');
    if (!pool || !instance || rest.length > 0) return usageError(`--bridge ${bridge}: POOL/INSTANCE expected`);
    try {
      process.stdout.write(await bridgeCredentialsText(readNatsSigner(signer, `--signer ${signer}`), names, pool, instance));
    } catch (err) {
      process.stderr.write(`magus nats-auth: ${(err as Error).message}\n`);
      return 1;
    }
    return 0;
  }
  if (!out) return usageError('--out DIR is required');
  const files = natsAuthFiles();
  const taken = files.filter((f) => existsSync(join(out, f)));
  if (taken.length > 0) {
    process.stderr.write(`magus nats-auth: ${out} already holds ${taken.join(', ')}: nothing written (a new folder for new users)\n`);
    return 1;
  }
  await writeNatsAuth(out, names);
  process.stdout.write(
    [
      `wrote ${files.map((f) => join(out, f)).join(', ')}`,
      `nats-server: add "include ${join(out, 'nats-auth.conf')}" to its configuration and restart it (operator mode),`,
      `or with the official nats Helm chart: helm install nats nats/nats … -f ${join(out, 'nats-values.yaml')};`,
      'each process: MAGUS_NATS_CREDENTIALS=<its role>.creds (gateway: magus gateway; controller: magus controller, magus keys,',
      'magus usage; worker: magus worker); the worker running the Kubernetes runtime also MAGUS_K8S_BRIDGE_NATS_SIGNER=bridge-signer.nk.',
      '',
    ].join('\n'),
  );
  return 0;
}

const ROLE_FILES = ['gateway', 'controller', 'worker'] as const;

/** The files `magus nats-auth` writes in `dir` (each role's credentials, the signer, then the servers' configuration, as values of the nats chart and as a file). */
export const natsAuthFiles = (): string[] => [...natsUserFiles().slice(0, -1), 'nats-values.yaml', 'nats-auth.conf'];

/** What a process of the data plane needs of them: each role's credentials, the signer, and the server's configuration. */
export const natsUserFiles = (): string[] => [...ROLE_FILES.map((r) => `${r}.creds`), 'bridge-signer.nk', 'nats-auth.conf'];

/** Writes a new operator, account and users per role into `dir` (made 0700 if missing): each file under a temporary name, then renamed, so one that exists is whole. */
export async function writeNatsAuth(dir: string, names: DataPlaneNames): Promise<void> {
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const authority = await newNatsAuthority();
  const signer = { account: authority.account.publicKey, signerSeed: authority.signerSeed };
  const write = (name: string, text: string, mode: number) => {
    const tmp = join(dir, `.${name}.tmp`);
    writeFileSync(tmp, text, { mode });
    renameSync(tmp, join(dir, name));
  };
  for (const role of ROLE_FILES) write(`${role}.creds`, await roleCredentialsText(signer, role, names), 0o600);
  write('bridge-signer.nk', signerFileText(authority), 0o600);
  write('nats-values.yaml', natsChartValues(authority), 0o644);
  // Last: its presence says the files before it are all there.
  write('nats-auth.conf', natsServerAuthConfig(authority), 0o644);
}

function usageError(message: string): number {
  process.stderr.write(`magus nats-auth: ${message}\n${NATS_AUTH_USAGE}\n`);
  return 2;
}
