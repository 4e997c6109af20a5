/**
 * The `magus gateway` process: validated configuration → NATS connection → watch-backed caches
 * (tokens, sessions) and the model catalog → fastify with timeouts → listen, and the operations
 * listener when configured (operations.ts); SIGTERM/SIGINT close gracefully (stop accepting, let
 * in-flight requests finish within the grace period, then the operations listener, drain NATS).
 */
import { natsConnectAuth } from '../dataplane/roles';
import { Client, Connection } from '@temporalio/client';
import { temporalSessions } from './temporal';
import Fastify, { type FastifyBaseLogger, type FastifyInstance } from 'fastify';
import { setTimeout as sleep } from 'node:timers/promises';
import { connect, Events, type KV, type NatsConnection } from 'nats';
import { FullBacklogs } from './serving/backlogs';
import { QueueWaits } from './serving/queue-waits';
import { bridgeBeats } from './serving/beats';
import { within } from '../dataplane/errors';
import { leaderGet } from '../dataplane/kv-leader';
import { deleteEntry } from '../dataplane/session-keys';
import { kvMoveLog } from './serving/resume';
import { listenAsReplica, replicaGone } from './serving/replicas';
import { Nats } from '../shared/constants';
import { openModelRegistry } from '../dataplane/registry';
import { endClaim, ensureResponsesBucket, instanceConsuming, readStoredFrames, responseStreamState, scopeSubject } from '../dataplane';
import gatewayApp, { options, readinessChecks } from './app';
import { operationsApp } from './operations';
import {
  DEFAULT_NATS_GRACE_MS,
  DEFAULT_SESSION_CACHE_ENTRIES,
  GATEWAY_USAGE,
  GatewayConfigError,
  loadGatewayConfig,
  type GatewayArgs,
  type GatewayConfig,
} from './config';
import { combineTokenSources, kvTokenSource, staticTokenSource } from './plugins/auth';
import { SessionErrorType, sessionErrorType } from './plugins/errors';
import { GatewayMetrics } from './plugins/metrics';
import { createModelCatalog } from './serving/model-catalog';
import { kvResponseStore } from './serving/response-store';
import { KeyLimiter } from './serving/limits';
import { meterKeyOf } from '../dataplane/meter';
import { UsageLedger } from '../dataplane/usage';
import type { UsageRecord } from '../shared/usage';
import { LimitStore } from '../dataplane/limits';
import { perRequestResponseRouter, streamPublisher, sharedResponseRouter, type PublishRequest, type ResponseRouter } from './serving/exchange';
import { cancelSubject } from '../shared/serving';
import { DEFAULT_INSTANCE_MEMORY_BYTES, leasesPerInstance } from '../shared/engine-slots';
import type { ReadyModel } from '../shared/model';
import type { BacklogCheck, ReadinessCheck } from './plugins/services';
import { SessionCache, type ColdStart, type FirstTurns, type SessionBroker } from './serving/sessions';
import { TEMPORAL_CHANNEL_ARGS, watchTemporal, type TemporalHealth } from '../platform/temporal-health';
import { natsServerList } from '../platform/config';
import { graced } from './routes/health';

/** What the process can be given instead of its defaults (the CLI wires Temporal here; tests wire fakes). */
export interface GatewayDeps {
  /** An open connection (not closed by the gateway); default: connect to `natsServers`. */
  nc?: NatsConnection;
  /** How the KV-backed session broker places a conversation without `firstTurns` (tests pin conversations). Default: 503 `NoCapacity`. */
  coldStart?: ColdStart;
  /** First turns from pools' published instances: the session TTL, how the workflow adopts an entry, how pools hear of demand. Default: none (every turn without a fresh entry takes `coldStart`). */
  firstTurns?: Pick<FirstTurns, 'ttlMs' | 'adopt' | 'demand'>;
  /**
   * Temporal's reachability (temporal-health.ts), when the session functions above use Temporal:
   * while it is away, a first turn that needs it is refused at once (503 `unavailable`), and
   * `/readyz` and `/metrics` say so. Not closed by the gateway.
   */
  temporal?: TemporalHealth;
  /** Replaces the KV-backed session broker altogether. */
  broker?: SessionBroker;
  /** Default: JetStream publish with `Nats-Msg-Id` (serving/exchange.ts). */
  publish?: PublishRequest;
  backlogFull?: BacklogCheck;
  /** Opens a KV bucket the gateway reads (tokens, sessions). Default: `js.views.kv(name)`, created if missing. */
  openBucket?: (nc: NatsConnection, name: string) => Promise<KV>;
  /** Where log lines go (default stdout). */
  logStream?: NodeJS.WritableStream;
  /** More gauges of this process for `/metrics`, in Prometheus' text format (`magus dev`: its Temporal workers' cache). */
  processMetrics?: () => string;
}

export interface RunningGateway {
  app: FastifyInstance;
  /** `http://host:port` it listens on. */
  url: string;
  /** `http://host:port` of the operations listener (`/healthz`, `/readyz`, `/metrics`), when configured. */
  healthUrl?: string;
  /** The KV-backed session broker (absent when `deps.broker` replaced it). */
  sessionCache: SessionCache | undefined;
  close(): Promise<void>;
}

/**
 * How often Node looks for requests past the headers or request timeout: a quarter of the shorter
 * one (at most Node's default 30 s). At 30 s a slow client (headers or a body trickled a byte at
 * a time) held its connection up to 30 s past a 2 s timeout (seen writing the gateway fuzz test).
 */
function connectionsCheckingInterval(http: GatewayConfig['http']): number {
  const shortest = Math.min(http.headersTimeoutMs, http.requestTimeoutMs > 0 ? http.requestTimeoutMs : Infinity);
  return Math.min(30_000, Math.max(100, Math.floor(shortest / 4)));
}

/** A fastify instance with the process-level settings: timeouts, body limit, logging. */
export function createServer(config: GatewayConfig, logStream?: NodeJS.WritableStream): FastifyInstance {
  const app = Fastify({
    ...options,
    http: { connectionsCheckingInterval: connectionsCheckingInterval(config.http) },
    logger: { ...options.logger, level: config.logLevel, ...(logStream ? { stream: logStream } : {}) },
    connectionTimeout: config.http.connectionTimeoutMs,
    requestTimeout: config.http.requestTimeoutMs,
    keepAliveTimeout: config.http.keepAliveTimeoutMs,
    bodyLimit: config.settings.bodyLimit,
    return503OnClosing: true,
    forceCloseConnections: 'idle',
  });
  app.server.headersTimeout = config.http.headersTimeoutMs;
  return app;
}

/** Demand told to a pool: a failure that says Temporal is unreachable has the probe look again at once. */
function guardDemand(demand: NonNullable<FirstTurns['demand']>, temporal: TemporalHealth): NonNullable<FirstTurns['demand']> {
  return async (model, waiting) => {
    try {
      await demand(model, waiting);
    } catch (err) {
      if ((err as { type?: unknown }).type === SessionErrorType.Unavailable) temporal.markUnreachable();
      throw err;
    }
  };
}

/** Unanswered requests whose ledger records are being written, at most. */
const MAX_REFUSALS_WRITING = 10_000;

/** How long a gateway keeps trying to record an unanswered request: past a cluster's election and a reconnect. */
const REFUSAL_RETRY_MS = 120_000;

/**
 * Records `r` (a request this gateway gave up on) as its client saw it, tried again while NATS
 * or the ledger's leader is away: the ledger ends up saying what the client was told whether the
 * gateway's record or the bridge's comes first (dataplane/usage.ts, `recordRefusal`).
 */
async function recordRefusal(ledger: UsageLedger, r: UsageRecord, stop: AbortSignal, log: FastifyBaseLogger): Promise<void> {
  const giveUpAt = Date.now() + REFUSAL_RETRY_MS;
  for (let delay = 250; ; delay = Math.min(delay * 2, 2_000)) {
    try {
      if ((await ledger.recordRefusal(r)) === 'corrected')
        log.info({ inferenceId: r.id }, 'the usage ledger had this unanswered request as completed (served after its publish went unacknowledged): corrected');
      return;
    } catch (err) {
      if (stop.aborted || Date.now() + delay > giveUpAt || !(await sleep(delay, true, { signal: stop }).catch(() => false))) {
        log.warn({ err, inferenceId: r.id }, 'could not record an unanswered request in the usage ledger');
        return;
      }
    }
  }
}

/** Cancels held while NATS is unreachable, at most (the oldest are kept: their engines run longest). */
const MAX_HELD_CANCELS = 10_000;

/** After a reconnect, stored frames are read back at once and again this long after it (ms). */
const RECOVER_AGAIN_MS = [300, 1_000];

/** Starts the gateway and listens; the caller owns the returned handle's `close`. */
export async function startGateway(config: GatewayConfig, deps: GatewayDeps = {}): Promise<RunningGateway> {
  const app = createServer(config, deps.logStream);
  const log = app.log;
  const nc =
    deps.nc ??
    (await connect({
      servers: natsServerList(config.natsServers),
      name: 'magus-gateway',
      maxReconnectAttempts: -1,
      noAsyncTraces: true,
      ...natsConnectAuth(config.natsCredentials, natsServerList(config.natsServers), (line) => process.stderr.write(`magus gateway: ${line}\n`)),
    }));
  const closers: (() => Promise<void>)[] = [];
  try {
    let natsUp = true;
    // After a reconnect: reopen the KV watches, forget a registry read sent to the old server,
    // read back the frames waiting requests missed.
    const metrics = new GatewayMetrics();
    /** Cancels of requests given up on while NATS was unreachable: sent once it is back. */
    const heldCancels: [subject: string, payload: string][] = [];
    const onReconnect: (() => void)[] = [
      () => metrics.natsReconnects.inc(),
      () => {
        for (const [subject, payload] of heldCancels.splice(0)) nc.publish(subject, payload);
      },
    ];
    void (async () => {
      for await (const s of nc.status()) {
        if (s.type === Events.Disconnect) natsUp = false;
        else if (s.type === Events.Reconnect) {
          natsUp = true;
          for (const f of onReconnect) f();
        }
      }
    })().catch(() => undefined);

    // Bridges' beats: an answer whose bridge went silent is continued elsewhere. After a reconnect
    // every bridge is unheard again (this process, not they, was away).
    // Their loads bound how long a turn waits in a queue (serving/queue-waits.ts).
    const waits = new QueueWaits(config.maxQueueWaitMs);
    const beats = bridgeBeats(nc, scopeSubject(config.subjectScope, Nats.beatSubjectPrefix), waits);
    closers.push(() => beats.close());
    onReconnect.push(() => beats.forget());

    const openBucket = deps.openBucket ?? ((c: NatsConnection, name: string) => c.jetstream().views.kv(name));
    const registry = await openModelRegistry(nc, config.buckets.models);
    const models = createModelCatalog(registry, { onError: (err) => log.warn({ err }, 'model registry read failed') });
    onReconnect.push(() => models.forgetInflight());

    const kvTokens = kvTokenSource(await openBucket(nc, config.buckets.tokens), (err) => log.warn({ err }, `${config.buckets.tokens}: skipped an entry`));
    closers.push(() => kvTokens.cache.close());
    onReconnect.push(() => kvTokens.cache.reopen());
    // Declared here: gateways are the only writers and readers of stored responses, and hold their TTL.
    const responsesKv = await ensureResponsesBucket(nc, config.buckets.responses, { maxAgeMs: config.responsesTtlMs, replicas: config.natsReplicas });
    const storedResponses = kvResponseStore(responsesKv, { maxPayload: () => nc.info?.max_payload });
    const limitsKv = await openBucket(nc, config.buckets.limits);
    // The key this gateway signs its requests' meters with (dataplane/meter.ts): made by the first gateway.
    const meterKey = await meterKeyOf(limitsKv, { create: true });
    const limiter = new KeyLimiter(new LimitStore(limitsKv), {
      replica: config.replicaId,
      leaseMs: config.limitLeaseMs,
      storedResponsesTtlMs: config.responsesTtlMs,
      retryAfterSec: config.settings.retryAfterSec,
      log,
      onRefused: (code) => metrics.limitRefusals.inc([code]),
    });
    closers.push(() => limiter.stop());
    const tokens = combineTokenSources([...config.staticTokens.map((t) => staticTokenSource(t.entries, t.origin)), kvTokens]);

    const jsm = await nc.jetstreamManager();
    let sessions: SessionBroker;
    let sessionCache: SessionCache | undefined;
    const temporal = deps.temporal;
    if (deps.processMetrics) metrics.setProcessExtras(deps.processMetrics);
    if (temporal) metrics.setTemporal(() => ({ reachable: temporal.reachable(), probeFailures: temporal.stats().failures }));
    const ready: Promise<void>[] = [within(`the ${config.buckets.tokens} watch`, 15_000, kvTokens.cache.ready)];
    const liveness = [{ name: 'tokens', check: () => kvTokens.cache.live }];
    if (deps.broker) {
      sessions = deps.broker;
    } else {
      const sessionsKv = await openBucket(nc, config.buckets.sessions);
      const recentSessions = config.settings.sessionCacheEntries ?? DEFAULT_SESSION_CACHE_ENTRIES;
      const cache = new SessionCache({
        kv: sessionsKv,
        firstTurns: deps.firstTurns && {
          ...deps.firstTurns,
          ...(deps.firstTurns.demand && temporal ? { demand: guardDemand(deps.firstTurns.demand, temporal), reachable: () => temporal.reachable() } : {}),
          // Reads after a lost compare-and-swap see the winner's write: the leader's, not a lagging replica's.
          sessions: {
            create: (k, v) => sessionsKv.create(k, v),
            update: (k, v, version) => sessionsKv.update(k, v, version),
            // Its marker expires (dataplane/session-keys.ts): the pools' counts hold no day of deletes.
            delete: (k, o) => deleteEntry(nc.jetstream(), config.buckets.sessions, k, o),
            get: (k) => leaderGet(jsm, config.buckets.sessions, k),
          },
          alive: (_namespace, pool, instance) => instanceConsuming(nc, config.requestStream, pool, instance),
        },
        pools: await openBucket(nc, config.buckets.pools),
        ...(deps.coldStart ? { coldStart: deps.coldStart } : {}),
        // A renewal once a tenth of the entry is used (at least 30 s): ten per TTL per live
        // conversation, not one per 30 s, and a session still ends at least 0.9 TTL after its last turn.
        ...(deps.firstTurns ? { renewWithinMs: deps.firstTurns.ttlMs - Math.max(30_000, deps.firstTurns.ttlMs / 10) } : {}),
        maxPendingSessionStarts: config.settings.maxPendingSessionStarts,
        waits,
        silent: (pool, instance) => beats.silent(`${pool}.${instance}`),
        stopping: (pool, instance) => beats.stopping(`${pool}.${instance}`),
        // The conversations this gateway serves only, read from the bucket's leader on first use:
        // no replay of every live conversation at start or after a reconnect.
        // Cut off from NATS, a read fails at once (503 with Retry-After), not after its timeout.
        ...(recentSessions > 0
          ? {
              recent: {
                maxEntries: recentSessions,
                read: (k: string) => (natsUp ? leaderGet(jsm, config.buckets.sessions, k) : Promise.reject(new Error('NATS is unreachable'))),
              },
            }
          : {}),
        onError: (err) => log.warn({ err }, 'session cache'),
      });
      closers.push(() => cache.close());
      onReconnect.push(
        () => cache.cache.reopen(),
        () => cache.pools?.reopen(),
      );
      ready.push(within(`the ${config.buckets.sessions} watch`, 15_000, cache.ready));
      // A mirror of every entry is what warm turns read: not ready while it is rebuilt. One of
      // recent conversations reads the bucket whenever its watch is down: ready all along.
      if (recentSessions === 0) liveness.push({ name: 'sessions', check: () => cache.cache.live });
      if (cache.pools) liveness.push({ name: 'pools', check: () => cache.pools!.live });
      sessions = sessionCache = cache;
    }
    const routerOptions = {
      subjectScope: config.subjectScope,
      replica: config.replicaId,
      onBadFrame: (subject: string) => log.warn({ subject }, 'dropped a response message that is not a frame'),
    };
    const responses: ResponseRouter =
      config.responseRouting === 'shared' ? await sharedResponseRouter(nc, routerOptions) : perRequestResponseRouter(nc, routerOptions);
    closers.push(() => responses.close());
    // Held while this replica runs: another replica a client resumes on asks whether it is gone.
    const unlisten = await listenAsReplica(nc, config.subjectScope, config.replicaId);
    closers.push(() => Promise.resolve(unlisten()));
    // Frames published while this process was cut off are in the response stream: read them back.
    const js = nc.jetstream();
    const readStored = async (subject: string) => {
      const stored = await readStoredFrames(js, jsm, config.responseStream, subject, { direct: nc });
      if (!stored.complete) metrics.framesGone.inc();
      // Frames beyond a gap count too: the missing ones may be those this process already has.
      return [...stored.frames, ...stored.beyondGap];
    };
    const recover = () =>
      void responses
        .recover(readStored, (err, inferenceId) => log.warn({ err, inferenceId }, 'could not read back the frames stored while NATS was unreachable'))
        .then((frames) => {
          metrics.framesRecovered.inc([], frames);
          if (frames > 0) log.info({ frames }, 'frames stored while NATS was unreachable handed to their requests');
        });
    onReconnect.push(() => {
      recover();
      // Again, for frames the stream stored after the first read: those in flight to this process's
      // server when it went away (under bench:chaos, a gap the sequencer would wait out for
      // gapTimeoutMs, 2.1–2.5 s of silence, after a NATS server was killed). The sequencer drops
      // what it already has.
      for (const ms of RECOVER_AGAIN_MS) setTimeout(() => natsUp && recover(), ms).unref();
    });
    // Whether MAGUS_RESPONSES keeps frames as long as take-overs need them: read at each scrape.
    metrics.setResponseStream(() => responseStreamState(jsm, config.responseStream));
    void responseStreamState(jsm, config.responseStream).then(
      (state) => {
        if (state.requiredRetentionMs !== undefined && config.settings.requestTimeoutMs > state.requiredRetentionMs) {
          log.warn(
            { stream: config.responseStream, requiredRetentionMs: state.requiredRetentionMs, requestTimeoutMs: config.settings.requestTimeoutMs },
            'requests may run longer than the response stream is sized to keep their frames: a late take-over may fail (raise MAGUS_RESPONSES_RETENTION_MS where the data plane is declared)',
          );
        }
      },
      () => undefined, // not declared yet: the scrape reports it once it is
    );
    // The usage ledger, bound (declared with the data plane): requests this gateway gave up on are recorded as such.
    let refusalsWriting = 0;
    // On close, a record still being tried is given up (logged) after the try under way.
    const refusalsStop = new AbortController();
    closers.push(() => Promise.resolve(refusalsStop.abort()));
    const ledger = new UsageLedger(await nc.jetstream().views.kv(config.buckets.usage, { bindOnly: true }));
    // Requests' claims (declared with the data plane), to end those whose answers this replica moves away from a silent bridge.
    const claimsKv = await nc
      .jetstream()
      .views.kv(config.buckets.claims, { bindOnly: true, allow_direct: true })
      .catch((err: unknown) => {
        log.warn({ err }, `${config.buckets.claims} cannot be bound: a request moved away from a silent bridge is cancelled only by its cancel`);
        return undefined;
      });
    let publish = deps.publish;
    if (!publish) {
      const publisher = streamPublisher(nc);
      closers.push(() => publisher.close());
      publish = publisher.publish;
    }
    // The backlog pre-check (serving/backlogs.ts): instances whose backlog refused a publish just now.
    const backlogs = new FullBacklogs((model) => sessionCache?.instancesOf(model));
    const publishing = publish;
    publish = async (subject, req, session) => {
      try {
        await publishing(subject, req, session);
      } catch (err) {
        if (sessionErrorType(err) === SessionErrorType.BacklogFull) backlogs.refused(session);
        throw err;
      }
    };
    await Promise.all(ready);
    await models.refresh().catch((err: unknown) => log.warn({ err }, 'model registry not readable yet'));

    // NATS and the mirrors it feeds: within the grace a replica cut off (or rebuilding a mirror
    // from the map it kept) is degraded, not out of its Service — a NATS restart reconnects every
    // replica at once. Past it, this replica alone is cut off: it is not ready.
    const graceMs = config.settings.natsGraceMs ?? DEFAULT_NATS_GRACE_MS;
    const readiness: ReadinessCheck[] = [{ name: 'nats', check: () => natsUp && !nc.isClosed() }, ...liveness].map((c) => {
      const g = graced(c, graceMs);
      closers.push(() => Promise.resolve(g.stop()));
      return g.check;
    });
    if (temporal) readiness.push({ name: 'temporal', check: () => temporal.reachable(), degrades: true });
    await app.register(gatewayApp, {
      metrics,
      serveMetrics: config.healthAddress === undefined,
      settings: config.settings,
      models,
      tokens,
      sessions,
      publish,
      responses,
      storedResponses,
      readStored,
      backlogFull:
        deps.backlogFull ??
        ((model) =>
          backlogs.full(model)
            ? { retryAfterSec: waits.retryAfterSec(model.name, sessionCache?.instancesOf(model) ?? [], config.settings.retryAfterSec) }
            : undefined),
      retryAfterAt: (session) => waits.retryAfterSec(session.pool, [session.instance], config.settings.retryAfterSec),
      maxMessageBytes: () => nc.info?.max_payload,
      limiter,
      meterKey,
      recordUsage: (record) => {
        if (refusalsWriting >= MAX_REFUSALS_WRITING) {
          log.warn({ inferenceId: record.id }, `not recording an unanswered request in the usage ledger: ${refusalsWriting} are being written`);
          return;
        }
        refusalsWriting += 1;
        void recordRefusal(ledger, record, refusalsStop.signal, log).finally(() => (refusalsWriting -= 1));
      },
      cancel: (session, requestId, movedAt) => {
        const subject = scopeSubject(config.subjectScope, cancelSubject(session.pool, session.instance));
        const payload = JSON.stringify(movedAt !== undefined ? { id: requestId, moved: true } : { id: requestId });
        // Ended in its claim too: a bridge that does not hear the cancel (restarted, cut off) does not serve it later.
        if (movedAt !== undefined && claimsKv)
          void endClaim(claimsKv, session, requestId, movedAt).catch((err: unknown) =>
            log.warn({ err, inferenceId: requestId }, 'could not end the claim of a request moved away from its silent bridge'),
          );
        // nats.js drops what it holds when it dials again: keep cancels until the connection is back.
        if (!natsUp) {
          if (heldCancels.length < MAX_HELD_CANCELS) heldCancels.push([subject, payload]);
          return;
        }
        try {
          nc.publish(subject, payload);
        } catch (err) {
          log.warn({ err, inferenceId: requestId }, 'could not send a cancel to the bridge');
        }
      },
      moves: kvMoveLog(responsesKv),
      replicaGone: (replica) => (natsUp ? replicaGone(nc, config.subjectScope, replica) : Promise.resolve(false)),
      bridgeSilent: (session, since) => natsUp && beats.silent(`${session.pool}.${session.instance}`, since),
      bridgeRequeues: (session) => waits.requeues(session.pool, session.instance),
      readiness,
    });
    let healthUrl: string | undefined;
    if (config.healthAddress) {
      const operations = Fastify({
        ...options,
        logger: { ...options.logger, level: config.logLevel, ...(deps.logStream ? { stream: deps.logStream } : {}) },
        forceCloseConnections: true,
      });
      // Closed after the API app (closers run once it has): a scrape during the drain sees the requests in flight finish.
      closers.push(() => operations.close());
      await operations.register(operationsApp, {
        metrics,
        readiness: readinessChecks(models, readiness, graceMs),
        retryAfterSec: config.settings.retryAfterSec,
      });
      healthUrl = await operations.listen(config.healthAddress);
    }
    const address = await app.listen({ host: config.host, port: config.port });
    let closing: Promise<void> | undefined;
    return {
      app,
      url: address,
      ...(healthUrl ? { healthUrl } : {}),
      sessionCache,
      close: () =>
        (closing ??= (async () => {
          // Streams may outlive the grace period: then their connections are cut.
          const cut = setTimeout(() => app.server.closeAllConnections(), config.shutdownGraceMs);
          try {
            await app.close();
          } finally {
            clearTimeout(cut);
          }
          for (const c of closers.reverse()) await c().catch((err: unknown) => log.warn({ err }, 'close'));
          if (!deps.nc) await nc.drain();
        })()),
    };
  } catch (err) {
    for (const c of closers.reverse()) await c().catch(() => undefined);
    await app.close().catch(() => undefined);
    if (!deps.nc) await nc.close().catch(() => undefined);
    throw err;
  }
}

const FLAGS: Readonly<Record<string, keyof GatewayArgs>> = { '--host': 'host', '--port': 'port', '--health-address': 'healthAddress', '--openapi': 'openApi' };

/** The overrides, `'help'`, or a usage problem as `{ problem }`. */
function parseArgs(args: string[]): GatewayArgs | 'help' | { problem: string } {
  const out: GatewayArgs = {};
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === '--help' || a === '-h') return 'help';
    const [flag, inline] = a.includes('=') ? [a.slice(0, a.indexOf('=')), a.slice(a.indexOf('=') + 1)] : [a, undefined];
    const key = Object.hasOwn(FLAGS, flag) ? FLAGS[flag] : undefined;
    if (key === undefined) return { problem: `unknown argument '${a}'` };
    const value = inline ?? args[++i];
    if (value === undefined) return { problem: `${flag} needs a value` };
    out[key] = value;
  }
  return out;
}

/**
 * Pool sizes for models without a `Dllama` resource (min 0: scale to zero when idle); an
 * instance takes as many requests at once as its engine has slots within the instance memory
 * budget, and the pool scales on requests in flight or queued (workflows/pool/state.ts, "Scaling").
 */
const poolDefaults = (instanceMemory: number) => ({
  minInstances: 0,
  maxInstances: 2,
  leasesPerInstance: (model: ReadyModel) => leasesPerInstance(model, instanceMemory),
  idleTimeoutMs: 10 * 60_000,
  scaleOn: 'load' as const,
});

/** Loopback hosts: an API port there is reachable from this machine only. */
const LOOPBACK = /^(127\.\d+\.\d+\.\d+|::1|localhost)$/;

/** `magus gateway [--host H] [--port P] [--health-address A] [--openapi MODE]`: runs until SIGTERM/SIGINT. Exit code 0 after a clean stop, 1 on bad configuration or a failed start. */
export async function gatewayCommand(args: string[]): Promise<number> {
  const parsed = parseArgs(args);
  if (parsed === 'help') {
    process.stdout.write(`${GATEWAY_USAGE}\n`);
    return 0;
  }
  if ('problem' in parsed) {
    process.stderr.write(`magus gateway: ${parsed.problem}\n${GATEWAY_USAGE}\n`);
    return 1;
  }
  let config: GatewayConfig;
  try {
    config = loadGatewayConfig(process.env, parsed);
  } catch (err) {
    if (!(err instanceof GatewayConfigError)) throw err;
    process.stderr.write(`magus gateway: ${err.message}\n`);
    return 1;
  }
  let gateway: RunningGateway;
  let temporalConnection: Connection | undefined;
  let temporal: TemporalHealth | undefined;
  let closeSessions: () => Promise<void> = () => Promise.resolve();
  try {
    // First turns start the conversation's session workflow (after their answer) and tell pools of
    // demand; warm turns never use Temporal. The connection is lazy: the gateway starts, and serves
    // warm turns, with Temporal away.
    const { address, namespace, taskQueue } = config.temporal;
    temporalConnection = Connection.lazy({ address, channelArgs: TEMPORAL_CHANNEL_ARGS });
    temporal = watchTemporal(temporalConnection, {
      onChange: (up) =>
        process.stderr.write(
          `magus gateway: Temporal at ${address} ${up ? 'answers' : 'is unreachable: first turns that need it get 503 unavailable until it is back'}\n`,
        ),
    });
    const client = new Client({ connection: temporalConnection, namespace });
    const { close, ...sessions } = temporalSessions({
      client,
      taskQueue,
      pool: poolDefaults(config.instanceMemory ?? DEFAULT_INSTANCE_MEMORY_BYTES),
      sessionTtlMs: config.sessionTtlMs,
      replica: config.replicaId,
    });
    closeSessions = close;
    gateway = await startGateway(config, { ...sessions, temporal });
  } catch (err) {
    await temporal?.close();
    await temporalConnection?.close();
    process.stderr.write(`magus gateway: cannot start: ${(err as Error).message}\n`);
    return 1;
  }
  process.stderr.write(`magus gateway: listening on ${gateway.url} (replica ${config.replicaId})\n`);
  if (gateway.healthUrl) process.stderr.write(`magus gateway: /healthz, /readyz and /metrics on ${gateway.healthUrl}\n`);
  else if (!LOOPBACK.test(config.host))
    process.stderr.write(
      'magus gateway: /metrics is served unauthenticated on the API port: set MAGUS_GATEWAY_HEALTH_ADDRESS (--health-address) to serve it on a port of its own\n',
    );
  await new Promise<void>((resolve) => {
    process.once('SIGTERM', () => resolve());
    process.once('SIGINT', () => resolve());
  });
  process.stderr.write('magus gateway: stopping …\n');
  await gateway.close();
  // The Temporal calls still in flight end before their connection closes (a retry on a closed channel throws out of a timer).
  await closeSessions();
  await temporal.close();
  await temporalConnection.close();
  return 0;
}
