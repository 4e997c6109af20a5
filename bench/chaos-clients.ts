/**
 * bench:chaos's clients (chaos.ts), in a process of their own: each streams greedy answers one
 * after the other through the gateways, with plain `fetch` and an SSE reader that does what the
 * gateway's README asks of a client that loses its stream — the same request again, to any gateway,
 * with `Last-Event-ID`. Apart from the bench's bridges and engine supervisors, as clients are apart
 * from a worker: a turn of either's event loop does not delay what the other does or records.
 *
 * Run by chaos.ts with `fork` (the messages below); {@link answer} is also what chaos.ts asks its
 * reference answers with, in its own process.
 */
import { subscribe } from 'node:diagnostics_channel';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { parseLastEventId } from '../gateway/serving/resume';
import { sseRecords } from '../test/harness/sse-stream';
import { sleep } from '../test/harness/wait';

export interface Answer {
  /** The chunks' id. */
  id?: string;
  /** The instance its first event id names (where it was first published). */
  instance?: string;
  /** Every instance its event ids named, in order (moves and continuations: more than one). */
  instances: string[];
  /** When it was first asked for (epoch ms). */
  asked: number;
  prompt: number;
  text: string;
  pieces: number;
  times: number[];
  finish?: string;
  completionTokens?: number;
  done: boolean;
  error?: string;
  reconnects: number;
  refused: number;
  /** Each reconnect (epoch ms): its stream lost, asked again, its request's headers written to the socket, the answer's headers, its first event. */
  resumes: Resume[];
}

export interface Resume {
  lost: number;
  asked?: number;
  written?: number;
  headers?: number;
  event?: number;
  gateway?: string;
}

/**
 * The resumes whose request is on its way, by `Last-Event-ID`: `fetch` (undici) says on a
 * diagnostics channel when it writes a request's headers to its socket — the client's own share
 * of the wait, apart from the gateway's.
 */
const sending = new Map<string, Resume>();
subscribe('undici:client:sendHeaders', (message) => {
  const { headers } = message as { headers?: string };
  const id = headers === undefined ? undefined : /^last-event-id: *(\S+)\r?$/im.exec(headers)?.[1];
  const r = id === undefined ? undefined : sending.get(id);
  if (r) r.written ??= Date.now();
});

/** What a client needs to ask: the gateways (their URLs now), the key, and what to ask for. */
export interface ClientContext {
  gateways: () => readonly string[];
  pool: string;
  token: string;
  tokenId: string;
  /** The gateways' secret: an event id names the instance the answer was first published on. */
  secret: string;
  prompts: readonly string[];
  maxTokens: number;
  /** Reconnects before a client gives an answer up as broken. */
  maxReconnects: number;
}

/** One streamed answer of `session` to prompt `prompt`, resumed with `Last-Event-ID` on any gateway after a lost stream. */
export async function answer(c: ClientContext, client: number, session: string, prompt: number): Promise<Answer> {
  const a: Answer = { prompt, text: '', pieces: 0, times: [], done: false, reconnects: 0, refused: 0, asked: Date.now(), resumes: [], instances: [] };
  let lastId: string | undefined;
  const body = JSON.stringify({
    model: c.pool,
    messages: [{ role: 'user', content: c.prompts[prompt] }],
    max_tokens: c.maxTokens,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
  });
  for (let attempt = 0; ; attempt++) {
    const gateways = c.gateways();
    const gw = gateways[(client + attempt) % gateways.length]!;
    const resume = a.resumes.at(-1);
    if (resume) {
      resume.asked ??= Date.now();
      resume.gateway = gw; // the last one asked: the one that answered, when one did
    }
    const resumedWith = resume ? lastId : undefined;
    if (resumedWith) sending.set(resumedWith, resume!);
    try {
      const res = await fetch(`${gw}/v1/chat/completions`, {
        method: 'POST',
        headers: {
          authorization: `Bearer ${c.token}`,
          'content-type': 'application/json',
          'x-session-id': session,
          ...(lastId ? { 'last-event-id': lastId } : {}),
        },
        body,
      });
      if (res.status === 429 || res.status === 503) {
        a.refused += 1;
        await res.body?.cancel();
        await sleep(Math.min(2000, Number(res.headers.get('retry-after') ?? 1) * 1000));
        continue;
      }
      if (res.status !== 200) {
        a.error = `${res.status} ${(await res.text()).slice(0, 200)}`;
        return a;
      }
      // Every message, as an `EventSource` reads them: a keep-alive before the first chunk says the
      // answer's id with no data (gateway/README.md, "Resuming a stream"), kept as the last event id.
      if (resume) resume.headers ??= Date.now();
      for await (const e of sseRecords(res)) {
        if (resume) resume.event ??= Date.now();
        if (e.id) {
          lastId = e.id;
          const named = parseLastEventId(c.secret, c.tokenId, e.id)?.instance;
          a.instance ??= named;
          if (named && a.instances.at(-1) !== named) a.instances.push(named);
        }
        if (e.data === undefined) continue;
        if (e.data === '[DONE]') {
          a.done = true;
          return a;
        }
        const chunk = JSON.parse(e.data) as {
          id?: string;
          error?: { message?: string; code?: string };
          choices?: { delta?: { content?: string }; finish_reason?: string | null }[];
          usage?: { completion_tokens: number };
        };
        if (chunk.error) {
          a.error = `error event: ${chunk.error.code ?? ''} ${chunk.error.message ?? ''}`;
          return a;
        }
        a.id ??= chunk.id;
        if (chunk.usage) a.completionTokens = chunk.usage.completion_tokens;
        const ch = chunk.choices?.[0];
        if (ch?.finish_reason) a.finish = ch.finish_reason;
        const piece = ch?.delta?.content ?? '';
        if (piece !== '') {
          a.text += piece;
          a.pieces += 1;
          a.times.push(Date.now());
        }
      }
    } catch {
      // the connection broke: resume
    } finally {
      if (resumedWith) sending.delete(resumedWith);
    }
    a.reconnects += 1;
    a.resumes.push({ lost: Date.now() });
    if (a.reconnects > c.maxReconnects) {
      a.error = `gave up after ${c.maxReconnects} reconnects`;
      return a;
    }
    await sleep(100);
  }
}

/** chaos.ts → the clients' process. */
export type ToClients =
  | { type: 'start'; context: Omit<ClientContext, 'gateways'>; gateways: string[] }
  | { type: 'gateways'; gateways: string[] }
  /**
   * Each session asks turn after turn until `until` (epoch ms), client n to prompt (n + turn) mod
   * prompts; `first` is client n's of `sessions[0]` (a share of the clients, in one of several processes).
   */
  | { type: 'phase'; sessions: string[]; first: number; until: number };

/** The clients' process → chaos.ts. */
export type FromClients =
  | { type: 'answer'; answer: Answer }
  /** Every client's last turn has ended; how late this process's event loop was meanwhile. */
  | { type: 'phase-done'; lateness: LoopLateness };

/** How late an event loop was while watched: p99 and max (ms), and each turn {@link LATE_TURN_MS} or more late. */
export interface LoopLateness {
  p99Ms: number;
  maxMs: number;
  late: { at: number; ms: number }[];
}

/** A turn of an event loop this late is kept (chaos.ts logs them, verbose). */
const LATE_TURN_MS = 200;

/** Watches how late this process's event loop is, until the returned function is called. */
export function watchLoop(): () => LoopLateness {
  const delay = monitorEventLoopDelay({ resolution: 20 });
  delay.enable();
  const late: { at: number; ms: number }[] = [];
  let tick = Date.now();
  const watch = setInterval(() => {
    const ms = Date.now() - tick - 100;
    tick = Date.now();
    if (ms >= LATE_TURN_MS) late.push({ at: tick, ms });
  }, 100);
  return () => {
    clearInterval(watch);
    delay.disable();
    return { p99Ms: delay.percentile(99) / 1e6, maxMs: delay.max / 1e6, late };
  };
}

function serve(): void {
  let context: ClientContext | undefined;
  let gateways: string[] = [];
  const send = (m: FromClients) => process.send!(m);
  process.on('message', (m: ToClients) => {
    if (m.type === 'start') context = { ...m.context, gateways: () => gateways };
    if (m.type === 'start' || m.type === 'gateways') gateways = m.gateways;
    if (m.type !== 'phase') return;
    const c = context!;
    const watched = watchLoop();
    void Promise.all(
      m.sessions.map(async (session, i) => {
        const client = m.first + i;
        for (let turn = 0; Date.now() < m.until; turn++) send({ type: 'answer', answer: await answer(c, client, session, (client + turn) % c.prompts.length) });
      }),
    ).then(() => {
      send({ type: 'phase-done', lateness: watched() });
    });
  });
  // Gone with the bench.
  process.on('disconnect', () => process.exit(0));
}

if (require.main === module && process.send) serve();
