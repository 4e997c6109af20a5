/**
 * The servers, one spec each: how to run it on ports of given roles, where it keeps its data, and
 * how to tell it is ready. A spec is data; the supervisor (supervisor.ts) runs it, on new ports
 * when one is lost, and `Services` (services.ts) says which to run and what their endpoints are.
 */
import { generateKeyPairSync } from 'node:crypto';
import { existsSync, mkdirSync, writeFileSync } from 'node:fs';
import { cpus } from 'node:os';
import { join } from 'node:path';
import { httpOk, httpsOkInsecure, s3Answers, tcpAccepts } from './probes';
import type { ServerName } from './types';

/** How to run one server on ports of given roles. */
export interface ServerSpec<R extends string> {
  name: ServerName;
  bin: string;
  roles: readonly R[];
  args: (ports: Record<R, number>) => string[];
  env?: NodeJS.ProcessEnv;
  /** What a run writes before it is ready (data dirs, generated certs): removed after a failed start. */
  scratch: readonly string[];
  ready: (ports: Record<R, number>) => () => Promise<boolean>;
}

/** The Temporal dev server (with its UI), its database `temporal.db` in `dataDir`. */
export function temporalServer(bin: string, dataDir: string): ServerSpec<'frontend' | 'ui'> {
  const db = join(dataDir, 'temporal.db');
  return {
    name: 'temporal',
    bin,
    roles: ['frontend', 'ui'],
    // A flag and its value on one line.
    // prettier-ignore
    args: ({ frontend, ui }) => [
      'server', 'start-dev',
      '--ip', '127.0.0.1', '--port', String(frontend), '--ui-port', String(ui),
      '--db-filename', db,
      '--log-level', 'warn', '--log-format', 'json',
      '--dynamic-config-value', 'frontend.enableUpdateWorkflowExecution=true',
      '--dynamic-config-value', 'frontend.enableExecuteMultiOperation=true',
      '--search-attribute', 'MagusModel=Keyword',
      '--search-attribute', 'MagusKind=Keyword',
    ],
    scratch: ['', '-wal', '-shm', '-journal'].map((suffix) => db + suffix),
    ready:
      ({ frontend, ui }) =>
      async () =>
        (await tcpAccepts(frontend)) && (await httpOk(`http://127.0.0.1:${ui}/`)),
  };
}

/** Where nats-server keeps its JetStream store in `dataDir`. */
export const natsStore = (dataDir: string): string => join(dataDir, 'jetstream');

/**
 * Go threads for nats-server: half the CPUs. It shares this machine with Temporal, the S3 server and the
 * node processes, and a message hops between several goroutines (client read loop, consumer,
 * writer); on a small machine those hand-offs cost less on fewer threads. Measured on 2 CPUs,
 * warm request path at concurrency 1 (npm run bench:gateway): nats-server CPU per request 0.59 → 0.42 ms,
 * added latency −0.15 ms, and higher throughput at concurrency 8.
 */
function natsProcs(): number {
  return Math.max(1, Math.floor(cpus().length / 2));
}

/** nats-server with JetStream, its store in {@link natsStore}; with `configFile`, what it holds too (users). */
export function natsServer(bin: string, dataDir: string, configFile?: string): ServerSpec<'client' | 'monitor'> {
  const store = natsStore(dataDir);
  return {
    name: 'nats',
    bin,
    roles: ['client', 'monitor'],
    args: ({ client, monitor }) => [
      ...(configFile ? ['-c', configFile] : []),
      ...['-a', '127.0.0.1', '-p', String(client), '-m', String(monitor), '-js', '-sd', store, '--server_name', 'magus-dev'],
    ],
    env: { GOMAXPROCS: process.env.GOMAXPROCS ?? String(natsProcs()) },
    scratch: [store],
    ready:
      ({ monitor }) =>
      () =>
        httpOk(`http://127.0.0.1:${monitor}/healthz?js-enabled-only=true`),
  };
}

/** The S3 server's credentials (a kept folder keeps them: MinIO's data is bound to them). */
export interface S3Credentials {
  accessKeyId: string;
  secretAccessKey: string;
}

/** Where the S3 server keeps its data in `dataDir`. */
export const s3Data = (dataDir: string): string => join(dataDir, 's3');

/** Whether `s3/` in `dataDir` holds MinIO's data (its format, which s3proxy cannot read). */
export const holdsMinioData = (dataDir: string): boolean => existsSync(join(s3Data(dataDir), '.minio.sys'));

/**
 * s3proxy (a Java program: `jar`, run with `java` from PATH) serving S3 from `s3/`: a bucket is a
 * folder, an object a file whose metadata are extended attributes (`user.*`), an upload's parts
 * files beside it until it completes. Its settings, credentials included, are in
 * `s3proxy.properties` (0600); the port is the one system property given on its command line.
 */
export function s3proxyServer(jar: string, dataDir: string, { accessKeyId, secretAccessKey }: S3Credentials): ServerSpec<'api'> {
  const data = s3Data(dataDir);
  mkdirSync(data, { recursive: true });
  const properties = join(dataDir, 's3proxy.properties');
  const settings = {
    's3proxy.authorization': 'aws-v2-or-v4',
    's3proxy.identity': accessKeyId,
    's3proxy.credential': secretAccessKey,
    'jclouds.provider': 'filesystem-nio2',
    'jclouds.filesystem.basedir': data,
  };
  const lines = Object.entries(settings).map(([k, v]) => `${k}=${propertiesValue(v)}`);
  writeFileSync(properties, `${lines.join('\n')}\n`, { mode: 0o600 });
  return {
    name: 's3proxy',
    bin: 'java',
    roles: ['api'],
    args: ({ api }) => [...S3PROXY_JVM_OPTIONS, `-Ds3proxy.endpoint=http://127.0.0.1:${api}`, '-jar', jar, '--properties', properties],
    // Its log: warnings and errors only (at INFO it writes a line per bucket created and Jetty's own).
    env: { LOG_LEVEL: 'warn', JETTY_LOG_LEVEL: 'warn' },
    // Made above, before it runs: a failed start leaves nothing in it.
    scratch: [],
    ready:
      ({ api }) =>
      () =>
        s3Answers(`http://127.0.0.1:${api}`, { accessKeyId, secretAccessKey }),
  };
}

/**
 * `value` as java.util.Properties reads it back: a backslash escapes, and the file is read as
 * ISO 8859-1, so backslashes are doubled and anything but printable ASCII is a `\uXXXX` escape.
 */
export function propertiesValue(value: string): string {
  return value.replace(/[^\x20-\x5b\x5d-\x7e]/g, (c) => (c === '\\' ? '\\\\' : `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`));
}

/**
 * The JVM's options for s3proxy: the serial collector (one GC thread, a small heap: on a 2-core
 * machine shared with everything else the parallel one's threads only contend).
 */
const S3PROXY_JVM_OPTIONS = ['-XX:+UseSerialGC'];

/** MinIO, its data in `s3/`: only for a kept folder whose `s3/` MinIO wrote (see {@link holdsMinioData}). */
export function minioServer(bin: string, dataDir: string, { accessKeyId, secretAccessKey }: S3Credentials): ServerSpec<'api'> {
  const data = s3Data(dataDir);
  // With MINIO_BROWSER=off MinIO binds no console port (it starts even when the one given with
  // --console-address is taken), so it gets none: one port less to lose.
  return {
    name: 'minio',
    bin,
    roles: ['api'],
    args: ({ api }) => ['server', data, '--address', `127.0.0.1:${api}`, '--quiet'],
    env: { MINIO_ROOT_USER: accessKeyId, MINIO_ROOT_PASSWORD: secretAccessKey, MINIO_BROWSER: 'off', MINIO_UPDATE: 'off' },
    scratch: [data],
    ready:
      ({ api }) =>
      () =>
        httpOk(`http://127.0.0.1:${api}/minio/health/ready`),
  };
}

/** etcd for the API server, its data in `etcd/`. */
export function etcdServer(bin: string, dataDir: string): ServerSpec<'client' | 'peer'> {
  const data = join(dataDir, 'etcd');
  return {
    name: 'etcd',
    bin,
    roles: ['client', 'peer'],
    // A flag and its value on one line.
    // prettier-ignore
    args: ({ client, peer }) => [
      '--name', 'magus', '--data-dir', data,
      '--listen-client-urls', `http://127.0.0.1:${client}`, '--advertise-client-urls', `http://127.0.0.1:${client}`,
      '--listen-peer-urls', `http://127.0.0.1:${peer}`, '--initial-advertise-peer-urls', `http://127.0.0.1:${peer}`,
      '--initial-cluster', `magus=http://127.0.0.1:${peer}`, '--log-level', 'warn',
      '--unsafe-no-fsync',
    ],
    // Its member dir records the peer URL: a retry on other ports must not find the old one.
    scratch: [data],
    ready:
      ({ client }) =>
      () =>
        httpOk(`http://127.0.0.1:${client}/health`),
  };
}

/**
 * kube-apiserver on `etcdUrl`, its files in `kube/`: the admin `token` (written to `tokens.csv`
 * here), the ServiceAccount signing key (made on the first start and kept, so the tokens it
 * signed stay valid) and its self-signed serving certificate (made by its first start).
 */
export function kubeApiServer(bin: string, dataDir: string, etcdUrl: string, token: string): ServerSpec<'api'> {
  const kubeDir = join(dataDir, 'kube');
  mkdirSync(kubeDir, { recursive: true });
  writeFileSync(join(kubeDir, 'tokens.csv'), `${token},magus-admin,magus-admin,"system:masters"\n`, { mode: 0o600 });
  if (!existsSync(join(kubeDir, 'sa.key'))) {
    const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
    writeFileSync(join(kubeDir, 'sa.key'), privateKey.export({ type: 'pkcs8', format: 'pem' }), { mode: 0o600 });
  }
  const certs = join(kubeDir, 'certs');
  return {
    name: 'kube-apiserver',
    bin,
    roles: ['api'],
    // Flags that belong together on one line.
    // prettier-ignore
    args: ({ api }) => [
      `--etcd-servers=${etcdUrl}`,
      '--bind-address=127.0.0.1', '--advertise-address=127.0.0.1', `--secure-port=${api}`,
      `--cert-dir=${certs}`,
      `--token-auth-file=${join(kubeDir, 'tokens.csv')}`,
      '--authorization-mode=RBAC',
      '--service-account-issuer=https://kubernetes.default.svc.cluster.local',
      `--service-account-key-file=${join(kubeDir, 'sa.key')}`,
      `--service-account-signing-key-file=${join(kubeDir, 'sa.key')}`,
      '--service-cluster-ip-range=10.96.0.0/24',
      '--enable-priority-and-fairness=false',
      '--watch-cache=false',
      '-v=0',
    ],
    // Its self-signed serving cert, generated on first start and kept by restarts.
    scratch: [certs],
    ready:
      ({ api }) =>
      () =>
        httpsOkInsecure(`https://127.0.0.1:${api}/readyz`, token),
  };
}

/**
 * Writes a kubeconfig (mode 0600) for a kube-apiserver the services run: its admin token, its
 * self-signed certificate not verified. For `magus dev`, the tests and the benches.
 */
export function writeKubeconfig(file: string, api: { server: string; token: string }, namespace = 'default'): void {
  const yaml = [
    'apiVersion: v1',
    'kind: Config',
    `clusters: [{name: magus, cluster: {server: "${api.server}", insecure-skip-tls-verify: true}}]`,
    `users: [{name: magus-admin, user: {token: "${api.token}"}}]`,
    `contexts: [{name: magus, context: {cluster: magus, user: magus-admin, namespace: ${namespace}}}]`,
    'current-context: magus',
  ];
  writeFileSync(file, `${yaml.join('\n')}\n`, { mode: 0o600 });
}
