/**
 * Fakes of the gateway's own interfaces (never of NATS or Temporal) for tests: an in-memory
 * data plane that answers published requests with scripted frames, a counting session broker,
 * and an app builder using the server options the gateway expects.
 */
import Fastify, { type FastifyInstance, type FastifyServerOptions } from 'fastify';
import { Writable } from 'node:stream';
import type { ReadyModel } from '../../shared/model';
import type { ChatInference, InferenceRequest, ResponseFrame, SessionEntry } from '../../shared/serving';
import gatewayApp, { options, type GatewayAppOptions } from '../../gateway/app';
import { staticTokenSource, tokenDigest } from '../../gateway/plugins/auth';
import { createModelCatalog } from '../../gateway/serving/model-catalog';
import { memoryResponseStore } from '../../gateway/serving/response-store';
import type { PublishRequest, ResponseRouter } from '../../gateway/serving/exchange';
import type { GatewaySettings } from '../../gateway/plugins/services';
import type { AcquireRequest, SessionBroker } from '../../gateway/serving/sessions';

export const TEST_SECRET = 'test-secret-0123456789abcdef0123456789';

export function readyModel(name: string, namespace = 'default'): ReadyModel {
  return {
    namespace,
    name,
    source: { repo: `org/${name}`, revision: 'main', sha: 'a'.repeat(40) },
    artifacts: [],
    memory: [],
    readyAt: '2025-01-02T03:04:05.000Z',
  };
}

/** A token `mgs_<id>_<secret>` and its config entry. */
export function makeToken(id: string, name = id, models?: string[]): { token: string; entry: { digest: string; name: string; models?: string[] } } {
  const token = `mgs_${id}_${'s3cr3t'.repeat(4)}${id}`;
  return { token, entry: { digest: tokenDigest(token), name, ...(models ? { models } : {}) } };
}

/** Emits frames to the request (in this order, each after a macrotask). */
export type Script = (req: InferenceRequest, subject: string) => ResponseFrame[] | 'silence' | Promise<ResponseFrame[] | 'silence'>;

/** In-memory publish + router: a published request is answered by `script`. */
export class FakeDataPlane {
  readonly published: { subject: string; req: InferenceRequest }[] = [];

  /** The `i`th published request, which the test expects to be a chat completion. */
  chat(i: number): ChatInference {
    const req = this.published[i]?.req;
    if (!req || (req.kind !== undefined && req.kind !== 'chat')) throw new Error(`published request ${i} is not a chat completion`);
    return req;
  }
  private readonly listeners = new Map<string, (frame: ResponseFrame) => void>();
  script: Script = (req) => [{ seq: 0, type: 'done', data: { id: `chatcmpl-${req.id}`, object: 'chat.completion', choices: [] } }];
  publishError: Error | undefined;

  readonly publish: PublishRequest = async (subject, req) => {
    if (this.publishError) throw this.publishError;
    this.published.push({ subject, req });
    const frames = await this.script(req, subject);
    if (frames === 'silence') return;
    void (async () => {
      for (const f of frames) {
        await new Promise((r) => setImmediate(r));
        this.stored.set(req.replyTo, [...(this.stored.get(req.replyTo) ?? []), f]);
        this.listeners.get(req.id)?.(f);
        for (const follower of this.followers.get(req.replyTo) ?? []) follower(f);
      }
    })();
  };

  /** Frames sent, by reply subject: what `MAGUS_RESPONSES` would hold ({@link readStored}). */
  readonly stored = new Map<string, ResponseFrame[]>();
  private readonly followers = new Map<string, Set<(frame: ResponseFrame) => void>>();

  readonly readStored = (subject: string): Promise<ResponseFrame[]> => Promise.resolve([...(this.stored.get(subject) ?? [])]);

  readonly router: ResponseRouter = {
    replica: 'test',
    replySubject: (id) => `magus.res.${id}`,
    replySubjectOf: (_replica, id) => `magus.res.${id}`,
    listen: (id, onFrame) => {
      this.listeners.set(id, onFrame);
      return () => void this.listeners.delete(id);
    },
    follow: (subjects, onFrame) => {
      for (const subject of subjects) this.followers.set(subject, (this.followers.get(subject) ?? new Set()).add(onFrame));
      return () => {
        for (const subject of subjects) this.followers.get(subject)?.delete(onFrame);
      };
    },
    recover: () => Promise.resolve(0),
    close: () => Promise.resolve(),
  };

  /** Requests still listening (should be 0 after every request). */
  get listening(): number {
    return this.listeners.size;
  }
}

/** A broker that hands out one entry and records every call. */
export class FakeBroker implements SessionBroker {
  readonly calls: Omit<AcquireRequest, 'signal'>[] = [];
  entry: SessionEntry = { subject: 'magus.req.pool-a.inst-1', pool: 'pool-a', instance: 'inst-1', expiresAt: Date.now() + 3_600_000 };
  /** Replaces the answer (delay, throw …). */
  impl: ((req: AcquireRequest) => Promise<SessionEntry>) | undefined;
  acquire(req: AcquireRequest): Promise<SessionEntry> {
    this.calls.push({ conversationKey: req.conversationKey, model: req.model, owner: req.owner });
    return this.impl ? this.impl(req) : Promise.resolve(this.entry);
  }
  /** Models asked for by requests of no conversation. */
  readonly routed: string[] = [];
  route(req: { model: ReadyModel; signal: AbortSignal }): Promise<SessionEntry> {
    this.routed.push(`${req.model.namespace}/${req.model.name}`);
    return this.impl ? this.impl({ conversationKey: '', model: req.model, owner: '', signal: req.signal }) : Promise.resolve(this.entry);
  }
  stats() {
    return { warmHits: this.calls.length, coldStarts: 0, firstTurns: 0 };
  }
  /** What `/v1/models` says of a model's pool (absent: nothing said, as a broker without views). */
  serving: SessionBroker['serving'];
}

export const testSettings = (over: Partial<GatewaySettings> = {}): GatewaySettings => ({
  secret: TEST_SECRET,
  allowAnonymous: false,
  bodyLimit: 64 * 1024,
  requestTimeoutMs: 2_000,
  gapTimeoutMs: 200,
  keepAliveMs: 1_000,
  coldStartTimeoutMs: 5_000,
  retryAfterSec: 7,
  ...over,
});

/** Collects log lines (JSON) written by the app. */
export class LogSink extends Writable {
  readonly lines: string[] = [];
  override _write(chunk: Buffer, _enc: BufferEncoding, cb: () => void): void {
    this.lines.push(...chunk.toString('utf8').split('\n').filter(Boolean));
    cb();
  }
}

export interface TestApp {
  app: FastifyInstance;
  plane: FakeDataPlane;
  broker: FakeBroker;
  log: LogSink;
  tokens: Record<'alice' | 'bob' | 'narrow', TestToken>;
}

export type TestToken = ReturnType<typeof makeToken>;

export async function buildTestApp(
  over: Partial<Omit<GatewayAppOptions, 'models'>> & { models?: ReadyModel[] | GatewayAppOptions['models'] } = {},
  /**
   * `storedFrames`: frames can be read back (the fake plane's {@link FakeDataPlane.readStored}), as background responses need;
   * `server`: fastify's options over the app's (`options`).
   */
  harness: { storedFrames?: boolean; server?: FastifyServerOptions } = {},
): Promise<TestApp> {
  const plane = new FakeDataPlane();
  const broker = new FakeBroker();
  const log = new LogSink();
  const tokens: TestApp['tokens'] = { alice: makeToken('alice'), bob: makeToken('bob'), narrow: makeToken('narrow', 'narrow', ['other-model']) };
  const entries = Object.fromEntries(Object.entries(tokens).map(([id, t]) => [id, t.entry]));
  const { models, ...rest } = over;
  const list = Array.isArray(models) || models === undefined ? (models ?? [readyModel('tiny'), readyModel('other-model')]) : undefined;
  const app = Fastify({ ...options, ...harness.server, logger: { ...options.logger, level: 'info', stream: log } });
  await app.register(gatewayApp, {
    settings: testSettings(),
    tokens: staticTokenSource(entries, 'test'),
    sessions: broker,
    publish: plane.publish,
    responses: plane.router,
    ...(harness.storedFrames ? { readStored: plane.readStored } : {}),
    storedResponses: memoryResponseStore(),
    ...rest,
    models: list ? createModelCatalog({ list: () => Promise.resolve(list) }) : (models as GatewayAppOptions['models']),
  });
  await app.ready();
  return { app, plane, broker, log, tokens };
}

/** The `data:` payloads of an SSE body, parsed (`[DONE]` kept as a string). */
export function sseEvents(body: string): unknown[] {
  return body
    .split('\n\n')
    .map((e) => e.split('\n').find((line) => line.startsWith('data: '))) // after an `id:` line, when the stream is resumable
    .filter((d): d is string => d !== undefined)
    .map((d) => d.slice(6))
    .map((d) => (d === '[DONE]' ? d : (JSON.parse(d) as unknown)));
}

export const chunk = (seq: number, content: string): ResponseFrame => ({
  seq,
  type: 'chunk',
  data: { id: 'chatcmpl-x', object: 'chat.completion.chunk', created: 1, model: 'tiny', choices: [{ index: 0, delta: { content }, finish_reason: null }] },
});
