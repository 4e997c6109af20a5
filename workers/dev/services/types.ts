/** The services' public types: what a caller asks for and what it gets back. */

/** What a caller may ask for; `kubernetes` is etcd and kube-apiserver together. */
export type ServiceName = 'temporal' | 'nats' | 's3' | 'kubernetes';

/** The server processes (and the names of their logs in `<dataDir>/logs/<name>.log`). */
export type ServerName = 'temporal' | 'nats' | 's3proxy' | 'minio' | 'etcd' | 'kube-apiserver';

/** Connection details of running servers. Written to a file for test workers; never logged. */
export interface ServiceEndpoints {
  temporal?: { address: string; namespace: string; uiUrl: string };
  nats?: { servers: string; monitorUrl: string };
  s3?: { endpoint: string; region: string; accessKeyId: string; secretAccessKey: string };
  kubernetes?: { server: string; token: string; etcdUrl: string };
}

export interface RunningServices {
  endpoints: ServiceEndpoints;
  /** Pids of every server process now (for tests that prove nothing is left behind). */
  readonly pids: number[];
  dataDir: string;
  /** How many times each server was started again on new ports because one was taken. */
  readonly retries: Readonly<Partial<Record<ServerName, number>>>;
  /**
   * Stops nats-server and starts it again on the same ports, as an upgrade or a rescheduled pod
   * would; `wipe` also deletes its JetStream store first (a server on ephemeral storage). Only
   * when `nats` was started. Fails, naming the port, if another process took one meanwhile.
   */
  restartNats(opts?: { wipe?: boolean }): Promise<void>;
  /**
   * Stops kube-apiserver (SIGTERM, waits for it to exit) and starts it again on the same port with
   * the same token, certificates and etcd (which keeps running), once `/readyz` answers. Only when
   * `kubernetes` was started. Fails, naming the port, if another process took it meanwhile.
   */
  restartKubernetes(): Promise<void>;
  /**
   * SIGKILLs the Temporal dev server, as a crash would (its database file stays); resolves once it
   * has exited. Only when `temporal` was started. {@link RunningServices.restartTemporal} brings it back.
   */
  killTemporal(): Promise<void>;
  /** Stops Temporal (if it runs) and starts it again on the same ports and database, once it answers. */
  restartTemporal(): Promise<void>;
  stop(): Promise<void>;
}

/** One port a server is about to be started on: what it is for, and the how-manyth start this is. */
export interface PortRequest {
  server: ServerName;
  /** temporal: frontend, ui; nats: client, monitor; s3proxy (or minio): api; etcd: client, peer; kube-apiserver: api. */
  role: string;
  /** 1 for the first start, 2 for the first retry after a port was taken, … */
  attempt: number;
}

export interface StartOptions {
  services?: readonly ServiceName[];
  /** Parent of the throwaway data folder; defaults to the OS temp dir. Unused with `dataDir`. */
  dataRoot?: string;
  /**
   * A folder the servers keep their state in across starts (created when missing; `stop` leaves
   * it): Temporal's database, the JetStream store, the S3 data, etcd and the API server's keys,
   * and in `services.json` (0600) the S3 credentials, the API server's token and every port. A
   * start on it comes back with all of that, on the same ports where they are free (new ones
   * where another process holds one). Never two starts on one folder at once: the caller
   * guarantees it (`magus dev` holds a lock). Without it: a throwaway folder under `dataRoot`.
   */
  dataDir?: string;
  /**
   * Notes about the start (a server started again on new ports); defaults to stderr. Server
   * output always goes to `<dataDir>/logs/<server>.log`.
   */
  log?: (line: string) => void;
  /** Seconds to wait for each server to become ready. */
  readyTimeoutSec?: number;
  /** Starts of one server on fresh ports before "address already in use" is final (default 5). */
  portAttempts?: number;
  /**
   * Chooses each port a server is started on; defaults to the port it had last time (with
   * `dataDir`, on the first start attempt, when it is free) or else `freePort`. A seam for tests.
   */
  portPicker?: (request: PortRequest) => Promise<number>;
  /** A nats-server configuration file to start it with (`magus dev`'s users per role); its flags set the rest. */
  natsConfigFile?: string;
}
