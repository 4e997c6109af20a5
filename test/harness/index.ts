/**
 * What integration tests use to reach the real servers started by the global setup, and to
 * stay out of each other's way: every test file gets its own task queue, bucket, NATS names
 * and Kubernetes namespace from {@link isolation}.
 */
import { existsSync, mkdirSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { basename, join } from 'node:path';
import { createHash, randomBytes } from 'node:crypto';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { S3Client } from '@aws-sdk/client-s3';
import { Connection, Client } from '@temporalio/client';
import { bundleWorkflowCode, DefaultLogger, NativeConnection, Worker } from '@temporalio/worker';
import { connect, type NatsConnection } from 'nats';
import type { DataPlaneNames } from '../../dataplane';
import { bridgeCredentialsText, natsAuthOptions, readNatsCredentials, readNatsSigner, roleCredentialsText, type NatsRole } from '../../dataplane/roles';
import type { MagusConfig } from '../../workers/config';
import type { ServiceEndpoints } from '../../workers/dev/services';
import { sleep } from './wait';

export type { ServiceEndpoints };

/**
 * What the global setup hands tests: the servers' endpoints, and the folder of the NATS server's
 * users (`magus nats-auth --out`: nats-auth.conf, worker.creds, bridge-signer.nk …) unless it runs
 * without (`MAGUS_TEST_NATS_AUTH=0`).
 */
export type TestEndpoints = Omit<ServiceEndpoints, 'nats'> & { nats?: NonNullable<ServiceEndpoints['nats']> & { credentialsDir?: string } };

/**
 * Connection info of one running server; throws when run outside the integration project or
 * when MAGUS_TEST_SERVICES left that server out.
 */
export function endpoint<K extends keyof TestEndpoints>(name: K): NonNullable<TestEndpoints[K]> {
  const file = process.env.MAGUS_TEST_ENDPOINTS;
  if (!file) throw new Error('MAGUS_TEST_ENDPOINTS is unset: run integration tests (*.int.test.ts) through jest, which starts the servers');
  const e = (JSON.parse(readFileSync(file, 'utf8')) as TestEndpoints)[name];
  if (!e) throw new Error(`the test services do not include ${name} (see MAGUS_TEST_SERVICES)`);
  return e;
}

export interface Isolation {
  /** Short unique id: `<file-stem>-<random>`, lowercase, DNS-label safe. */
  id: string;
  taskQueue: string;
  bucket: string;
  /** Prefix for stream, consumer and KV bucket names (NATS names allow [A-Za-z0-9_-]). */
  natsPrefix: string;
  namespace: string;
}

/** Unique resource names for the calling test file (call once per file, in a describe/beforeAll). */
export function isolation(): Isolation {
  const testPath = expect.getState().testPath ?? 'test';
  const stem = basename(testPath)
    .replace(/\.int\.test\.ts$|\.test\.ts$/, '')
    .toLowerCase()
    .replace(/[^a-z0-9]+/g, '-')
    .slice(0, 30);
  const id = `${stem}-${randomBytes(3).toString('hex')}`;
  return { id, taskQueue: `test-${id}`, bucket: `test-${id}`, natsPrefix: `T_${id.replace(/-/g, '_').toUpperCase()}`, namespace: `test-${id}` };
}

export function s3Client(): S3Client {
  const s3 = endpoint('s3');
  return new S3Client({
    endpoint: s3.endpoint,
    region: s3.region,
    forcePathStyle: true,
    credentials: { accessKeyId: s3.accessKeyId, secretAccessKey: s3.secretAccessKey },
  });
}

/**
 * A dial to the test NATS server as `name` with the credentials in `file`. One that fails says the
 * server, how long it took and the longest the event loop was held meanwhile: suites' setups
 * failed on CI with a bare `TIMEOUT` when a worker's event loop was held past nats-server's
 * authentication timeout mid-handshake (now 10 s on the test server: NATS_AUTH_TIMEOUT_SEC).
 */
async function dialTestNats(name: string, file: string | undefined): Promise<NatsConnection> {
  const servers = endpoint('nats').servers;
  const lag = monitorEventLoopDelay({ resolution: 20 });
  lag.enable();
  const t0 = Date.now();
  try {
    return await connect({ servers, name, ...natsAuthOptions(credentialsOf(file)) });
  } catch (err) {
    throw new Error(
      `dialling ${servers} as ${name}: ${(err as Error).message} after ${Date.now() - t0} ms (event loop held up to ${Math.round(lag.max / 1e6)} ms meanwhile)`,
      {
        cause: err,
      },
    );
  } finally {
    lag.disable();
  }
}

/** A connection to the test NATS server as the worker (it may do everything: declare the data plane, write the registry, publish requests). */
export function natsConnect(): Promise<NatsConnection> {
  return dialTestNats(`magus-test-${process.pid}`, natsCredentialsFile('worker'));
}

/**
 * A connection to the test NATS server as `role` in data plane `names` (that role's user, made for
 * it: {@link natsRoleCredentials}); `name` names the connection.
 */
export async function natsConnectAs(role: Exclude<NatsRole, 'bridge'>, names: DataPlaneNames, name = `magus-test-${role}`): Promise<NatsConnection> {
  return dialTestNats(name, await natsRoleCredentials(role, names));
}

/** A connection to the test NATS server as the bridge of `pool`/`instance` in data plane `names` ({@link natsBridgeCredentials}). */
export async function natsConnectAsBridge(names: DataPlaneNames, pool: string, instance: string): Promise<NatsConnection> {
  return dialTestNats(`magus-test-bridge-${pool}-${instance}`, await natsBridgeCredentials(names, pool, instance));
}

const credentialsOf = (file: string | undefined) => (file ? readNatsCredentials(file) : undefined);

/** The folder of the test NATS server's users; undefined when it runs without (`MAGUS_TEST_NATS_AUTH=0`). */
const natsAuthDir = (): string | undefined => endpoint('nats').credentialsDir;

/**
 * The worker's credentials file on the test NATS server (for `MAGUS_NATS_CREDENTIALS`); undefined
 * when it runs without users. The worker's user may do everything, in every data plane.
 */
export function natsCredentialsFile(role: 'worker'): string | undefined {
  const dir = natsAuthDir();
  return dir && join(dir, `${role}.creds`);
}

/** The signer of the test NATS server's users (the Kubernetes runtime's `bridgeSigner`); undefined when it runs without users. */
export function natsSignerFile(): string | undefined {
  const dir = natsAuthDir();
  return dir && join(dir, 'bridge-signer.nk');
}

/** Writes `text` to `file` (0600) unless it exists: under a temporary name, then renamed, so a file that exists is whole. */
function writeOnce(file: string, text: () => Promise<string>): Promise<string> {
  if (existsSync(file)) return Promise.resolve(file);
  return text().then((t) => {
    const tmp = `${file}.${process.pid}.${randomBytes(3).toString('hex')}.tmp`;
    writeFileSync(tmp, t, { mode: 0o600 });
    renameSync(tmp, file);
    return file;
  });
}

/**
 * The folder of the users made for data plane `names` (roles' permissions name its streams and
 * buckets): by its prefix, and a digest of every name (a test may rename single buckets).
 */
function usersDirOf(dir: string, names: DataPlaneNames): string {
  const digest = createHash('sha256').update(JSON.stringify(names)).digest('hex').slice(0, 12);
  const sub = join(dir, 'planes', `${names.prefix || '_'}-${digest}`);
  mkdirSync(sub, { recursive: true, mode: 0o700 });
  return sub;
}

/**
 * The credentials file of a `role` user of data plane `names` on the test NATS server, made once
 * (signed with the folder's signer, as `magus nats-auth` makes them for its data plane): what a
 * gateway or controller of this test connects with (`MAGUS_NATS_CREDENTIALS`). Undefined when the
 * server runs without users.
 */
export async function natsRoleCredentials(role: Exclude<NatsRole, 'bridge'>, names: DataPlaneNames): Promise<string | undefined> {
  const dir = natsAuthDir();
  if (!dir) return undefined;
  if (role === 'worker') return natsCredentialsFile('worker');
  return writeOnce(join(usersDirOf(dir, names), `${role}.creds`), () => roleCredentialsText(readNatsSigner(join(dir, 'bridge-signer.nk')), role, names));
}

/**
 * The credentials file of the bridge of `pool`/`instance` in data plane `names` on the test NATS
 * server, as the Kubernetes runtime makes one per instance; undefined when it runs without users.
 */
export async function natsBridgeCredentials(names: DataPlaneNames, pool: string, instance: string): Promise<string | undefined> {
  const dir = natsAuthDir();
  if (!dir) return undefined;
  return writeOnce(join(usersDirOf(dir, names), `bridge-${pool}-${instance}.creds`), () =>
    bridgeCredentialsText(readNatsSigner(join(dir, 'bridge-signer.nk')), names, pool, instance),
  );
}

/** `{ MAGUS_NATS_CREDENTIALS: file }` when `file` is given, else nothing: the environment of a process connecting as its user. */
export const natsCredentialsEnv = (file: string | undefined): { MAGUS_NATS_CREDENTIALS?: string } => (file ? { MAGUS_NATS_CREDENTIALS: file } : {});

export async function temporalClient(): Promise<{ client: Client; connection: Connection }> {
  const temporal = endpoint('temporal');
  const connection = await Connection.connect({ address: temporal.address });
  return { client: new Client({ connection, namespace: temporal.namespace }), connection };
}

export async function temporalWorkerConnection(): Promise<NativeConnection> {
  return NativeConnection.connect({ address: endpoint('temporal').address });
}

/**
 * What the tests' workers may fetch a Model's source from although it is loopback: the fixture
 * hub (127.0.0.1) and its CDN (127.0.0.2), test/fixtures/hub.ts. Nothing else inside is allowed,
 * as in production nothing inside is by default.
 */
export const TEST_HUB_NETWORKS = ['127.0.0.1', '127.0.0.2'];

/**
 * A worker configuration for the calling test file: the test servers, its own task queue,
 * bucket and NATS prefix, the fixture hub's addresses allowed ({@link TEST_HUB_NETWORKS}). Also puts the S3 credentials where the worker's S3 client looks for
 * them (the standard AWS environment), as in production.
 */
export function workerConfig(iso: Isolation, dir: string, overrides: Partial<MagusConfig> = {}): MagusConfig {
  const s3 = endpoint('s3');
  process.env.AWS_ACCESS_KEY_ID = s3.accessKeyId;
  process.env.AWS_SECRET_ACCESS_KEY = s3.secretAccessKey;
  return {
    temporal: { address: endpoint('temporal').address, namespace: 'default' },
    taskQueue: `${iso.id}-control`,
    nats: { servers: endpoint('nats').servers, ...(natsCredentialsFile('worker') ? { credentials: natsCredentialsFile('worker') } : {}) },
    s3: { endpoint: s3.endpoint, region: s3.region, bucket: iso.bucket, forcePathStyle: true },
    natsPrefix: iso.natsPrefix,
    modelCacheDir: join(dir, 'models'),
    convertThreads: 1,
    transferPartSize: undefined,
    s3TraceFile: undefined,
    hubAllowNetworks: TEST_HUB_NETWORKS,
    ...overrides,
  };
}

/**
 * The environment of a `magus worker` process for the calling test file, configured as
 * {@link workerConfig} configures one in process: the test servers, its task queue, bucket and
 * NATS prefix, the worker's NATS user, the S3 credentials, metrics and health on ports the OS picks, the fixture hub's
 * addresses allowed ({@link TEST_HUB_NETWORKS}).
 */
export function workerEnv(iso: Isolation): NodeJS.ProcessEnv {
  const s3 = endpoint('s3');
  return {
    MAGUS_TEMPORAL_ADDRESS: endpoint('temporal').address,
    MAGUS_NATS_URL: endpoint('nats').servers,
    ...natsCredentialsEnv(natsCredentialsFile('worker')),
    MAGUS_S3_ENDPOINT: s3.endpoint,
    MAGUS_S3_REGION: s3.region,
    MAGUS_S3_BUCKET: iso.bucket,
    AWS_ACCESS_KEY_ID: s3.accessKeyId,
    AWS_SECRET_ACCESS_KEY: s3.secretAccessKey,
    MAGUS_TASK_QUEUE: `${iso.id}-control`,
    MAGUS_NATS_PREFIX: iso.natsPrefix,
    MAGUS_METRICS_ADDRESS: '127.0.0.1:0',
    MAGUS_HEALTH_ADDRESS: '127.0.0.1:0',
    MAGUS_HUB_ALLOW_NETWORKS: TEST_HUB_NETWORKS.join(','),
  };
}

let workflowBundle: Promise<{ code: string }> | undefined;

/**
 * Replays a workflow's history against today's workflow code, in the test that made it: a
 * nondeterminism that shows only in some runs' timing (which jobs one activation carries) fails
 * the test that hit it, not a worker restart in production.
 *
 * With `MAGUS_RECORD_HISTORIES=<dir>` set, also writes it to `<dir>/<name>.json` for
 * `test/replay.test.ts` (`scripts/record-histories`). An existing file is kept: it proves that
 * executions started by the code of its day still replay, which a history recorded today cannot;
 * `MAGUS_RECORD_HISTORIES_OVERWRITE=1` replaces it anyway.
 */
export async function recordHistory(name: string, handle: { fetchHistory(): Promise<unknown> }): Promise<void> {
  const history = await handle.fetchHistory();
  workflowBundle ??= bundleWorkflowCode({ workflowsPath: require.resolve('../../workflows'), logger: new DefaultLogger('WARN') });
  await Worker.runReplayHistory({ workflowBundle: await workflowBundle }, history, `${name}/replay`);
  const dir = process.env.MAGUS_RECORD_HISTORIES;
  if (!dir) return;
  const file = join(dir, `${name}.json`);
  if (existsSync(file) && process.env.MAGUS_RECORD_HISTORIES_OVERWRITE !== '1') return;
  writeFileSync(file, `${JSON.stringify(history, null, 1)}\n`);
}

/** Ids of the workflows a visibility query lists (the dev server's visibility lags: polled until something is listed, 10 s at most). */
export async function listWorkflowIds(client: Client, query: string): Promise<string[]> {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const ids: string[] = [];
    for await (const w of client.workflow.list({ query })) ids.push(w.workflowId);
    if (ids.length > 0 || Date.now() > deadline) return ids;
    await sleep(250);
  }
}

/** What the Temporal UI shows as a workflow's "Current Details" (the SDK's built-in metadata query). */
export async function currentDetails(handle: { query(name: string): Promise<unknown> }): Promise<string> {
  const meta = (await handle.query('__temporal_workflow_metadata')) as { currentDetails?: string };
  return meta.currentDetails ?? '';
}
