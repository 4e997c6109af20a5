/**
 * A test file's set-up as small pieces on one stack: each piece opens one thing on the test
 * servers (a folder, the file's bucket, a NATS connection and data plane, a Temporal client, the
 * workers, a stub engine with its bridge, a gateway) and returns what it opened with its
 * `close()`; {@link TestStack.close} closes everything opened, last first, so a piece never
 * outlives what it uses. A file opens its pieces in `beforeAll` and closes them in one `afterAll`:
 *
 * ```ts
 * const stack = new TestStack();
 * beforeAll(async () => {
 *   ({ nc, client } = await stack.open(magusStack(iso, { dirPrefix: 'magus-serving-' })));
 *   ({ gateway } = await stack.open(gatewayStack(names, { secret, tokens, sessions: { client, … } })));
 *   stack.defer(poolTerminated(client, MODEL));
 * });
 * afterAll(() => stack.close());
 * ```
 * Names a file gives its models carry its isolation id (`tiny-${iso.id}`): the workflow ids
 * derived from them (`pool/default/<model>`, `model/default/<model>`) are then its own on the
 * Temporal server all files share.
 */
import { CreateBucketCommand, type S3Client } from '@aws-sdk/client-s3';
import type { Client, Connection } from '@temporalio/client';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { poolWorkflowId } from '../../workflows/pool/definitions';
import { dataPlaneNames, ensureDataPlane, ensureInstanceConsumer, type DataPlaneNames, type DataPlaneOptions } from '../../dataplane';
import { openModelRegistry, type ModelRegistry } from '../../dataplane/registry';
import { startBridge, type Bridge, type BridgeOptions } from '../../dataplane/bridge';
import { startGateway, type GatewayDeps, type RunningGateway } from '../../gateway/server';
import { temporalSessions, type TemporalSessionOptions } from '../../gateway/temporal';
import type { MagusConfig } from '../../workers/config';
import { startTestHub, type TestHub, type TestHubOptions } from '../fixtures/hub';
import { startWorkers, type RunningWorkers, type WorkerDeps } from '../../workers/worker';
import { startStubEngine, type StubEngine, type StubEngineOptions } from '../fixtures/stub-engine';
import { gatewayConfigFor, pinnedConversation, refusedColdStart } from './gateway';
import { natsConnect, natsConnectAs, natsConnectAsBridge, s3Client, temporalClient, workerConfig, type Isolation } from './index';

/** Something a piece opened, and how to close it. */
export interface Opened {
  close(): unknown;
}

/** The pieces a test file opened, closed together in reverse order. */
export class TestStack {
  private readonly closes: (() => unknown)[] = [];

  /** Keeps `piece`'s close for {@link close}; returns the piece (awaited, when it is a promise). */
  open<T extends Opened>(piece: T): T;
  open<T extends Opened>(piece: Promise<T>): Promise<T>;
  open<T extends Opened>(piece: T | Promise<T>): T | Promise<T> {
    if (piece instanceof Promise) return piece.then((p) => this.open(p));
    this.closes.push(() => piece.close());
    return piece;
  }

  /** Runs `close` with the pieces, before everything opened earlier (a workflow to terminate, say). */
  defer(close: () => unknown): void {
    this.closes.push(close);
  }

  /** Closes every piece, last opened first; each close runs even when an earlier one failed, whose error is then thrown. */
  async close(): Promise<void> {
    const errors: unknown[] = [];
    for (const close of this.closes.splice(0).reverse()) {
      try {
        await close();
      } catch (err) {
        errors.push(err);
      }
    }
    if (errors.length === 1) throw errors[0];
    if (errors.length > 1) throw new AggregateError(errors, 'closing the test stack');
  }
}

/**
 * A piece made of pieces: `open` opens them on a stack of their own, which is the piece's close.
 * When one fails to open, those already open are closed before the error is thrown.
 */
async function pieceOf<T extends object>(open: (pieces: TestStack) => Promise<T>): Promise<T & Opened> {
  const pieces = new TestStack();
  try {
    return { ...(await open(pieces)), close: () => pieces.close() };
  } catch (err) {
    await pieces.close().catch(() => undefined);
    throw err;
  }
}

/** A new temporary folder named `<prefix>XXXXXX`, removed with its content. */
export function tempDir(prefix: string): { dir: string } & Opened {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  return { dir, close: () => rmSync(dir, { recursive: true, force: true }) };
}

/** An S3 client on the test server and the file's bucket, created. */
export async function s3Stack(iso: Isolation): Promise<{ s3: S3Client } & Opened> {
  const s3 = s3Client();
  const opened = { s3, close: () => s3.destroy() };
  try {
    await s3.send(new CreateBucketCommand({ Bucket: iso.bucket }));
  } catch (err) {
    opened.close();
    throw err;
  }
  return opened;
}

/**
 * A connection to the test NATS server and the file's data plane (its isolation prefix, and
 * `suffix` after it for a second one). With `declare`, the piece declares the data plane (with
 * those options) and deletes its streams and buckets at close; without, whoever runs it (the
 * workers) declares it. Drained at close.
 */
export async function natsStack(
  iso: Isolation,
  opts: { declare?: true | Omit<DataPlaneOptions, 'prefix'>; suffix?: string } = {},
): Promise<{ nc: NatsConnection; names: DataPlaneNames } & Opened> {
  const nc = await natsConnect();
  const names = dataPlaneNames(`${iso.natsPrefix}${opts.suffix ?? ''}`);
  const close = async () => {
    if (opts.declare) await deleteDataPlane(nc, names);
    await nc.drain();
  };
  try {
    if (opts.declare) await ensureDataPlane(nc, { ...(opts.declare === true ? {} : opts.declare), prefix: names.prefix });
  } catch (err) {
    await close().catch(() => undefined);
    throw err;
  }
  return { nc, names, close };
}

/** Deletes a data plane's streams and buckets (those missing are skipped). */
async function deleteDataPlane(nc: NatsConnection, names: DataPlaneNames): Promise<void> {
  const jsm = await nc.jetstreamManager();
  const buckets = [
    names.sessionsBucket,
    names.tokensBucket,
    names.claimsBucket,
    names.modelsBucket,
    names.poolsBucket,
    names.responsesBucket,
    names.limitsBucket,
    names.usageBucket,
    names.usageSumsBucket,
  ];
  for (const stream of [names.requestStream, names.responseStream, ...buckets.map((b) => `KV_${b}`)]) {
    await jsm.streams.delete(stream).catch(() => false);
  }
}

/** A close that terminates `model`'s pool workflow (in `default`), if it still runs: a file's pool never outlives it. */
export function poolTerminated(client: Client, model: string): () => Promise<unknown> {
  return () =>
    client.workflow
      .getHandle(poolWorkflowId('default', model))
      .terminate()
      .catch(() => undefined);
}

/** A Temporal client on the test server (its connection closed at close). */
export async function temporalStack(): Promise<{ client: Client; connection: Connection } & Opened> {
  const { client, connection } = await temporalClient();
  return { client, connection, close: () => connection.close() };
}

/**
 * The magus workers for the file (`startWorkers`): its task queue, bucket and data plane (which
 * they declare), state under `dir`; `overrides` change the configuration, `deps` as in production.
 */
export async function workersStack(
  iso: Isolation,
  dir: string,
  overrides: Partial<MagusConfig> = {},
  deps?: WorkerDeps,
): Promise<{ cfg: MagusConfig; workers: RunningWorkers } & Opened> {
  const cfg = workerConfig(iso, dir, overrides);
  const workers = await startWorkers(cfg, deps);
  return { cfg, workers, close: () => workers.shutdown() };
}

/** What {@link runtimeStack} opened. */
export interface RuntimeStack {
  nc: NatsConnection;
  names: DataPlaneNames;
  registry: ModelRegistry;
  s3: S3Client;
  dir: string;
}

/**
 * What a runtime under test (no workers, no Temporal) runs on: the file's data plane, declared
 * and deleted at close, its model registry, its bucket, and a folder named by `dirPrefix`.
 */
export function runtimeStack(iso: Isolation, opts: { dirPrefix: string }): Promise<RuntimeStack & Opened> {
  return pieceOf(async (pieces) => {
    const { nc, names } = await pieces.open(natsStack(iso, { declare: true }));
    const registry = await openModelRegistry(nc, names.modelsBucket);
    const { s3 } = await pieces.open(s3Stack(iso));
    const { dir } = pieces.open(tempDir(opts.dirPrefix));
    return { nc, names, registry, s3, dir };
  });
}

/** The tests' Hugging Face-compatible hub (test/fixtures/hub.ts: the demo hub with access control, records and faults), stopped at close. */
export async function hubStack(opts?: TestHubOptions): Promise<{ hub: TestHub } & Opened> {
  const hub = await startTestHub(opts);
  return { hub, close: () => hub.stop() };
}

/** What {@link magusStack} opened. */
export interface MagusStack {
  /** The workers' folder (models cache under it); a test may keep files of its own there. */
  dir: string;
  s3: S3Client;
  cfg: MagusConfig;
  workers: RunningWorkers;
  nc: NatsConnection;
  names: DataPlaneNames;
  client: Client;
  connection: Connection;
}

/**
 * The file's own magus on the test servers, as most end-to-end tests want it: a folder, the
 * file's bucket, the workers (which declare the data plane), then a NATS connection and a
 * Temporal client for the test. `dirPrefix` names the folder; `overrides` and `deps` go to the workers.
 */
export function magusStack(iso: Isolation, opts: { dirPrefix: string; overrides?: Partial<MagusConfig>; deps?: WorkerDeps }): Promise<MagusStack & Opened> {
  return pieceOf(async (pieces) => {
    const { dir } = pieces.open(tempDir(opts.dirPrefix));
    const { s3 } = await pieces.open(s3Stack(iso));
    const { cfg, workers } = await pieces.open(workersStack(iso, dir, opts.overrides, opts.deps));
    const { nc, names } = await pieces.open(natsStack(iso));
    const { client, connection } = await pieces.open(temporalStack());
    return { dir, s3, cfg, workers, nc, names, client, connection };
  });
}

/** A stub engine (test/fixtures/stub-engine.ts), stopped at close. */
export async function stubEngineStack(opts: StubEngineOptions): Promise<{ engine: StubEngine } & Opened> {
  const engine = await startStubEngine(opts);
  return { engine, close: () => engine.stop() };
}

/**
 * A stub engine serving `pool`'s instance `instance` through a bridge, as a runtime would start
 * them: the instance's consumer declared on `nc` with `slots`, the bridge on a connection of its
 * own as the instance's bridge user (on the test NATS server), stopped before the engine.
 */
export function stubInstanceStack(
  nc: NatsConnection,
  names: DataPlaneNames,
  opts: {
    pool: string;
    instance: string;
    slots: number;
    engine?: StubEngineOptions;
    bridge?: Pick<BridgeOptions, 'log' | 'engineKind'>;
    /** The bridge on `nc` itself, as in a data plane without NATS users (default: its instance's own user). */
    bridgeOnNc?: true;
  },
): Promise<{ engine: StubEngine; bridge: Bridge } & Opened> {
  return pieceOf(async (pieces) => {
    const { engine } = await pieces.open(stubEngineStack({ modelId: opts.pool, ...opts.engine }));
    await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool: opts.pool, instance: opts.instance, slots: opts.slots });
    // The bridge connects as its instance's own user, as a runtime starts it.
    const bridgeNc = opts.bridgeOnNc ? nc : await natsConnectAsBridge(names, opts.pool, opts.instance);
    if (!opts.bridgeOnNc) pieces.defer(() => bridgeNc.drain());
    const bridge = await startBridge({
      nc: bridgeNc,
      names,
      pool: opts.pool,
      instance: opts.instance,
      engineUrl: engine.url,
      slots: opts.slots,
      ...opts.bridge,
    });
    pieces.defer(() => bridge.stop());
    return { engine, bridge };
  });
}

export interface GatewayStackOptions {
  /**
   * The connection the gateway uses (not closed by it): for a test's own NATS server. Without it,
   * the gateway connects to the test server as the gateway's user (its role's permissions, as in
   * production), drained at close.
   */
  nc?: NatsConnection;
  secret: string;
  /** Token id → whole token. */
  tokens: Record<string, string>;
  /** Gateway settings (`MAGUS_GATEWAY_…`, `MAGUS_LOG_LEVEL`) over the test defaults. */
  env?: Record<string, string>;
  /** Sessions through Temporal as in production (cold starts start pools and sessions); closed with the gateway. */
  sessions?: TemporalSessionOptions;
  /** What the test wires itself instead (a cold start that pins, a log stream). */
  deps?: Omit<GatewayDeps, 'nc'>;
}

/** A gateway on loopback for data plane `names`, with Temporal sessions or the test's own deps. */
export async function gatewayStack(names: DataPlaneNames, opts: GatewayStackOptions): Promise<{ gateway: RunningGateway } & Opened> {
  const own = opts.nc ? undefined : await natsConnectAs('gateway', names, `magus-test-gateway-${names.prefix}`);
  const nc = opts.nc ?? own!;
  const sessions = opts.sessions && temporalSessions(opts.sessions);
  const config = gatewayConfigFor(names.prefix, { secret: opts.secret, tokens: opts.tokens, ...(opts.env ? { env: opts.env } : {}) });
  const gateway = await startGateway(config, { nc, ...sessions, ...opts.deps }).catch(async (err: unknown) => {
    await sessions?.close().catch(() => undefined);
    await own?.close();
    throw err;
  });
  return {
    gateway,
    close: async () => {
      await gateway.close();
      await sessions?.close();
      await own?.drain();
    },
  };
}

/**
 * A gateway serving one conversation pinned to `pool`/`instance` (no Temporal: a cold start is
 * refused and recorded in `coldStarts`), with one key and the official client on it: what the
 * tests of one instance's bridge and engine put in front of them.
 */
export async function pinnedGatewayStack(
  nc: NatsConnection,
  names: DataPlaneNames,
  opts: { pool: string; instance: string; sessionId: string; coldStarts: string[]; why: string; env?: Record<string, string>; tokenId?: string },
): Promise<{ gateway: RunningGateway; openai: OpenAI; secret: string } & Opened> {
  const tokenId = opts.tokenId ?? 'pinned';
  const token = `mgs_${tokenId}_${randomBytes(16).toString('hex')}`;
  const secret = randomBytes(32).toString('hex');
  await pinnedConversation(nc, names, { pool: opts.pool, instance: opts.instance, secret, scope: tokenId, sessionId: opts.sessionId });
  // The entry was written before the gateway's watch started, so its `ready` means it is loaded.
  const piece = await gatewayStack(names, {
    secret,
    tokens: { [tokenId]: token },
    env: { MAGUS_LOG_LEVEL: 'silent', ...opts.env },
    deps: { coldStart: refusedColdStart(opts.coldStarts, opts.why) },
  });
  return {
    gateway: piece.gateway,
    openai: new OpenAI({ baseURL: `${piece.gateway.url}/v1`, apiKey: token, maxRetries: 0 }),
    secret,
    close: () => piece.close(),
  };
}
