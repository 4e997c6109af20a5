/**
 * The real servers magus runs against — Temporal dev server, nats-server (JetStream), s3proxy (S3)
 * and etcd + kube-apiserver — started on free loopback ports, with a throwaway data folder or
 * (`dataDir`) one folder they keep their state in across starts. Used by `magus dev` and by the
 * jest global setup, so tests run against exactly what users run.
 *
 * {@link Services} composes its collaborators: the data folder and what it remembers
 * ({@link DataFolder}), the ports of this start ({@link PortAllocator}), the processes — started,
 * started again on new ports when one is lost, restarted, stopped in order ({@link Supervisor}) —
 * and the servers' specs (servers.ts). Each service is one method here: which specs it runs, and
 * the endpoint it gives.
 */
import { randomBytes } from 'node:crypto';
import { rmSync } from 'node:fs';
import { binariesBuilt, binaryPath, BINARIES_OF, resolveBinaries, type BinaryName, type Binaries } from './binaries';
import { DataFolder } from './data-folder';
import { PortAllocator } from './ports';
import { etcdServer, holdsMinioData, kubeApiServer, minioServer, natsServer, natsStore, s3proxyServer, s3Data, temporalServer } from './servers';
import { Supervisor, type Started } from './supervisor';
import type { RunningServices, ServerName, ServiceEndpoints, ServiceName, StartOptions } from './types';

export const ALL_SERVICES: readonly ServiceName[] = ['temporal', 'nats', 's3', 'kubernetes'];

/** Running servers; {@link Services.start} starts them. */
export class Services implements RunningServices {
  readonly endpoints: ServiceEndpoints = {};
  readonly dataDir: string;
  private readonly ports: PortAllocator;
  private readonly supervisor: Supervisor;
  /** The servers that can be restarted, once started. */
  private temporal: Started<'frontend' | 'ui'> | undefined;
  private readonly natsConfigFile: string | undefined;
  private nats: Started<'client' | 'monitor'> | undefined;
  private kubeApi: Started<'api'> | undefined;

  private constructor(
    private readonly folder: DataFolder,
    private readonly binaries: Binaries,
    opts: StartOptions,
    say: (line: string) => void,
  ) {
    this.dataDir = folder.path;
    this.natsConfigFile = opts.natsConfigFile;
    this.ports = new PortAllocator(folder.saved.ports, opts.portPicker);
    this.supervisor = new Supervisor({
      logDir: folder.logDir,
      readyTimeoutSec: opts.readyTimeoutSec ?? 120,
      attempts: Math.max(1, opts.portAttempts ?? 5),
      ports: this.ports,
      say,
    });
  }

  /** Starts the requested servers concurrently and resolves once every one of them is ready. */
  static async start(opts: StartOptions = {}): Promise<Services> {
    const wanted = [...new Set(opts.services ?? ALL_SERVICES)];
    const say = opts.log ?? ((line: string) => void process.stderr.write(`magus services: ${line}\n`));
    const folder = DataFolder.open(opts);
    const binaries = await s3ServerOf(folder, wanted, say)
      .then((s3) =>
        resolveBinaries(
          wanted.flatMap((s) => (s === 's3' ? [s3] : BINARIES_OF[s])),
          say,
        ),
      )
      .catch((err: unknown) => {
        folder.release();
        throw err;
      });
    const services = new Services(folder, binaries, opts, say);
    await services.startAll(wanted);
    return services;
  }

  get pids(): number[] {
    return this.supervisor.pids;
  }

  get retries(): Readonly<Partial<Record<ServerName, number>>> {
    return this.supervisor.retries;
  }

  restartNats({ wipe = false }: { wipe?: boolean } = {}): Promise<void> {
    if (!this.nats) return Promise.reject(new Error('nats-server was not started'));
    return this.supervisor.restart(this.nats, wipe ? () => rmSync(natsStore(this.dataDir), { recursive: true, force: true }) : undefined);
  }

  restartKubernetes(): Promise<void> {
    if (!this.kubeApi) return Promise.reject(new Error('kube-apiserver was not started'));
    return this.supervisor.restart(this.kubeApi);
  }

  killTemporal(): Promise<void> {
    if (!this.temporal) return Promise.reject(new Error('Temporal was not started'));
    return this.supervisor.kill(this.temporal);
  }

  restartTemporal(): Promise<void> {
    if (!this.temporal) return Promise.reject(new Error('Temporal was not started'));
    return this.supervisor.restart(this.temporal);
  }

  async stop(): Promise<void> {
    await this.supervisor.stopAll();
    this.folder.release();
  }

  /** Every one of `wanted` at once; if any fails, all are stopped and the error names each failure. */
  private async startAll(wanted: readonly ServiceName[]): Promise<void> {
    const starters: Record<ServiceName, () => Promise<void>> = {
      temporal: () => this.startTemporal(),
      nats: () => this.startNats(),
      s3: () => this.startS3(),
      kubernetes: () => this.startKubernetes(),
    };
    const results = await Promise.allSettled(wanted.map((s) => starters[s]()));
    const failures = results.filter((r): r is PromiseRejectedResult => r.status === 'rejected');
    if (failures.length > 0) {
      await this.stop();
      throw new Error(failures.map((f) => (f.reason instanceof Error ? f.reason.message : String(f.reason))).join('\n\n'));
    }
    this.remember();
  }

  private async startTemporal(): Promise<void> {
    this.temporal = await this.supervisor.start(temporalServer(binaryPath(this.binaries, 'temporal'), this.dataDir));
    const { frontend, ui } = this.temporal.ports;
    this.endpoints.temporal = { address: `127.0.0.1:${frontend}`, namespace: 'default', uiUrl: `http://127.0.0.1:${ui}` };
  }

  private async startNats(): Promise<void> {
    this.nats = await this.supervisor.start(natsServer(binaryPath(this.binaries, 'nats-server'), this.dataDir, this.natsConfigFile));
    const { client, monitor } = this.nats.ports;
    this.endpoints.nats = { servers: `nats://127.0.0.1:${client}`, monitorUrl: `http://127.0.0.1:${monitor}` };
  }

  private async startS3(): Promise<void> {
    // A kept folder keeps its credentials (clients configured with them, and MinIO's data is bound to them).
    const credentials = this.folder.saved.s3 ?? {
      accessKeyId: `magus${randomBytes(6).toString('hex')}`,
      secretAccessKey: randomBytes(24).toString('base64url'),
    };
    const spec = this.binaries.minio
      ? minioServer(this.binaries.minio, this.dataDir, credentials)
      : s3proxyServer(binaryPath(this.binaries, 's3proxy'), this.dataDir, credentials);
    const { ports } = await this.supervisor.start(spec);
    this.endpoints.s3 = { endpoint: `http://127.0.0.1:${ports.api}`, region: 'us-east-1', ...credentials };
  }

  /** etcd, then the API server on it. */
  private async startKubernetes(): Promise<void> {
    const etcd = await this.supervisor.start(etcdServer(binaryPath(this.binaries, 'etcd'), this.dataDir));
    const etcdUrl = `http://127.0.0.1:${etcd.ports.client}`;
    const token = this.folder.saved.kubernetes?.token ?? randomBytes(24).toString('hex');
    this.kubeApi = await this.supervisor.start(kubeApiServer(binaryPath(this.binaries, 'kube-apiserver'), this.dataDir, etcdUrl, token));
    this.endpoints.kubernetes = { server: `https://127.0.0.1:${this.kubeApi.ports.api}`, token, etcdUrl };
  }

  /** What the next start on a kept folder needs: every port, and the credentials its data is bound to. */
  private remember(): void {
    const { saved } = this.folder;
    const { s3, kubernetes } = this.endpoints;
    this.folder.save({
      ports: { ...saved.ports, ...this.ports.now },
      ...(s3 ? { s3: { accessKeyId: s3.accessKeyId, secretAccessKey: s3.secretAccessKey } } : saved.s3 ? { s3: saved.s3 } : {}),
      ...(kubernetes ? { kubernetes: { token: kubernetes.token } } : saved.kubernetes ? { kubernetes: saved.kubernetes } : {}),
    });
  }
}

/**
 * What serves S3 from `folder`: s3proxy, unless its `s3/` holds MinIO's data (from a `magus dev`
 * of before s3proxy), which s3proxy cannot read: then MinIO, when its binary is at hand (it is
 * never built here: 4-5 minutes), or else an error saying what to do. Never a silent loss.
 */
async function s3ServerOf(folder: DataFolder, wanted: readonly ServiceName[], say: (line: string) => void): Promise<BinaryName> {
  if (!wanted.includes('s3') || !holdsMinioData(folder.path)) return 's3proxy';
  const s3 = s3Data(folder.path);
  if (await binariesBuilt(['minio'])) {
    say(`${s3} holds MinIO's data from an earlier start: MinIO serves it, as before (magus dev --fresh starts over with s3proxy)`);
    return 'minio';
  }
  throw new Error(
    `${s3} holds MinIO's data from an earlier start, which s3proxy, the S3 server now, cannot read. Either start over ` +
      `(magus dev --fresh: this folder's models, workflows and keys go; the demo model is pulled again), or keep it ` +
      `with MinIO: build it once (scripts/dev-services minio, 4-5 min) and start again.`,
  );
}

/** Starts the requested servers concurrently and resolves once every one of them is ready. */
export function startServices(opts: StartOptions = {}): Promise<RunningServices> {
  return Services.start(opts);
}
