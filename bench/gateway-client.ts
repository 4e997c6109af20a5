/**
 * The load generator of `npm run bench:gateway`, forked by bench/gateway.ts so that the process
 * measured (the gateway) never shares an event loop with the client. It runs one
 * {@link LoadSpec} per IPC message over keep-alive HTTP/1.1 connections (plain `node:http`: the
 * least client overhead) and answers with every request's timestamps; it checks each answer is
 * the stub's echo, so a fast wrong answer cannot count.
 *
 * Timestamps are `performance.timeOrigin + performance.now()` (epoch ms, sub-µs resolution), so
 * the parent can line them up with those of the other processes on this machine.
 */
import { Agent, request } from 'node:http';

export interface LoadSpec {
  /** The chat-completions URL (the stub's or the gateway's). */
  url: string;
  token: string;
  model: string;
  /** Requests in flight at once. */
  concurrency: number;
  requests: number;
  /** Worker `w` uses `sessionIds[w]`; or every request its own: `${sessionPrefix}-${i}`. */
  sessionIds?: string[];
  sessionPrefix?: string;
  stream: boolean;
  prompt: string;
  /** The text the answer must carry (the stub's echo); absent: any answer with status 200. */
  expectText?: string;
  maxTokens?: number;
  /** Sampling temperature (absent: the server's default). */
  temperature?: number;
  /** Appends ` (request <index>)` to the prompt: every request evaluates new tokens, the same ones on every path. */
  varyPrompt?: boolean;
  /** Each worker waits this long after an answer before its next request (a user reading it); default none. */
  pauseMs?: number;
  /** Streams ask for the final usage chunk (`stream_options.include_usage`); the sample keeps its completion tokens. */
  usage?: boolean;
}

/** One request: epoch ms of send, response headers and end; streams also their content chunks' arrival. */
export interface Sample {
  start: number;
  headers: number;
  end: number;
  /** `x-request-id` (gateway only). */
  requestId?: string;
  /** Arrival of each `data:` event that carries content (streams). */
  chunks?: number[];
  /** `usage.completion_tokens` of the answer (with {@link LoadSpec.usage}). */
  completionTokens?: number;
  /** `usage.prompt_tokens_details.cached_tokens`: the prompt found in the engine's cache. */
  cachedTokens?: number;
}

export interface LoadResult {
  samples: Sample[];
  wallMs: number;
}

const now = (): number => performance.timeOrigin + performance.now();
const agents = new Map<string, Agent>();

function agentFor(url: string): Agent {
  const origin = new URL(url).origin;
  let a = agents.get(origin);
  if (!a) agents.set(origin, (a = new Agent({ keepAlive: true, maxSockets: 256 })));
  return a;
}

function one(spec: LoadSpec, sessionId: string, index: number): Promise<Sample> {
  const body = JSON.stringify({
    model: spec.model,
    messages: [{ role: 'user', content: spec.varyPrompt ? `${spec.prompt} (request ${index})` : spec.prompt }],
    stream: spec.stream,
    ...(spec.maxTokens !== undefined ? { max_tokens: spec.maxTokens } : {}),
    ...(spec.temperature !== undefined ? { temperature: spec.temperature } : {}),
    ...(spec.usage && spec.stream ? { stream_options: { include_usage: true } } : {}),
  });
  return new Promise<Sample>((resolve, reject) => {
    const start = now();
    const req = request(
      spec.url,
      {
        method: 'POST',
        agent: agentFor(spec.url),
        headers: {
          'content-type': 'application/json',
          'content-length': Buffer.byteLength(body),
          authorization: `Bearer ${spec.token}`,
          'x-session-id': sessionId,
          'x-bench-seq': String(index),
        },
      },
      (res) => {
        const headers = now();
        const chunks: number[] = [];
        let raw = '';
        let text = '';
        let completionTokens: number | undefined;
        let cachedTokens: number | undefined;
        res.setEncoding('utf8');
        res.on('data', (d: string) => {
          const t = now();
          if (!spec.stream) {
            raw += d;
            return;
          }
          raw += d.replace(/\r/g, ''); // events may end in CRLF CRLF (dllama-api's do)
          for (let at = raw.indexOf('\n\n'); at >= 0; at = raw.indexOf('\n\n')) {
            // The gateway's chunk events have an `id:` line before their data.
            const event = raw
              .slice(0, at)
              .split('\n')
              .find((line) => line.startsWith('data: '));
            raw = raw.slice(at + 2);
            if (event === undefined || event === 'data: [DONE]') continue;
            const data = JSON.parse(event.slice(6)) as {
              choices?: { delta?: { content?: string } }[];
              usage?: { completion_tokens?: number; prompt_tokens_details?: { cached_tokens?: number } } | null;
            };
            if (data.usage?.completion_tokens !== undefined) completionTokens = data.usage.completion_tokens;
            if (data.usage?.prompt_tokens_details?.cached_tokens !== undefined) cachedTokens = data.usage.prompt_tokens_details.cached_tokens;
            const content = data.choices?.[0]?.delta?.content;
            if (content) {
              chunks.push(t);
              text += content;
            }
          }
        });
        res.on('error', reject);
        res.on('end', () => {
          const end = now();
          if (res.statusCode !== 200) return reject(new Error(`${spec.url}: HTTP ${res.statusCode}: ${raw.slice(0, 300)}`));
          if (!spec.stream) {
            const body = JSON.parse(raw) as { choices: { message: { content: string } }[]; usage?: { completion_tokens?: number } };
            text = body.choices[0]?.message.content ?? '';
            completionTokens = body.usage?.completion_tokens;
          }
          if (spec.expectText !== undefined && text !== spec.expectText)
            return reject(new Error(`${spec.url}: unexpected answer ${JSON.stringify(text.slice(0, 200))}`));
          const requestId = res.headers['x-request-id'];
          resolve({
            start,
            headers,
            end,
            ...(typeof requestId === 'string' ? { requestId } : {}),
            ...(spec.stream ? { chunks } : {}),
            ...(completionTokens !== undefined ? { completionTokens } : {}),
            ...(cachedTokens !== undefined ? { cachedTokens } : {}),
          });
        });
      },
    );
    req.on('error', reject);
    req.end(body);
  });
}

/** Runs `spec.requests` requests, `spec.concurrency` at a time. */
export async function runLoad(spec: LoadSpec): Promise<LoadResult> {
  const samples: Sample[] = new Array<Sample>(spec.requests);
  let next = 0;
  const t0 = now();
  await Promise.all(
    Array.from({ length: spec.concurrency }, async (_, w) => {
      for (let i = next++; i < spec.requests; i = next++) {
        const sid = spec.sessionPrefix !== undefined ? `${spec.sessionPrefix}-${i}` : spec.sessionIds?.[w % spec.sessionIds.length];
        if (sid === undefined) throw new Error('a LoadSpec needs sessionIds or sessionPrefix');
        samples[i] = await one(spec, sid, i);
        if (spec.pauseMs) await new Promise((r) => setTimeout(r, spec.pauseMs));
      }
    }),
  );
  return { samples, wallMs: now() - t0 };
}

if (require.main === module) {
  process.on('message', (msg: { spec: LoadSpec }) => {
    runLoad(msg.spec).then(
      (result) => process.send!({ result }),
      (err: unknown) => process.send!({ error: (err as Error).message ?? String(err) }),
    );
  });
  process.on('disconnect', () => process.exit(0));
}
