/**
 * `npm run bench:dllama`: distributed-llama on 1, 2 and 4 nodes against llama.cpp (`magus engine`)
 * on the same weights, each called directly and through magus (client → gateway → NATS JetStream
 * → bridge → engine), in one run on this machine.
 *
 * The model is a random Llama written by workers/dev/tiny-model (seeded, so every run has the same
 * one), big enough that computing a token costs far more than distributed-llama's syncs between
 * nodes on loopback: hidden 1024, 16 layers, 16 heads and 4 KV heads of 64, FFN 2816, vocabulary
 * 4096 (188.8 M parameters; every per-node slice of 4 nodes whole q40 blocks of 32). It is
 * converted by magus (convert/convert.ts) to a GGUF Q4_0 for llama.cpp and a distributed-llama
 * q40 `.m` + `.t`, run with q80 sync buffers as the runtime runs them. Its answers are noise, made
 * of printable tokens only ({@link printableAnswers}: so that each token streams as one chunk), and
 * never stop before `max_tokens` (checked: every answer's token count is shown). All of it is
 * written to a temporary folder (~0.6 GB, ~10 s), removed at the end.
 *
 * Engines run one at a time, started as the local runtime starts them: llama.cpp by
 * `startLlamaCppEngine` (1 slot), distributed-llama by `startDllamaTopology` (the real `dllama-api`
 * root and `dllama worker`s on loopback, built with magus's patches by scripts/dev-services), each
 * process with BENCH_THREADS threads. Each topology also runs with `--net-turbo 0` (`-noturbo`):
 * distributed-llama's default polls non-blocking sockets in a busy loop while it waits for the
 * other nodes, and on fewer cores than processes those loops take the CPU from the nodes that
 * compute (bench/README.md has what it costs). Those rows start the same programs through a
 * wrapper that adds the flag. Since these figures were taken, `startDllamaTopology` itself passes
 * `--net-turbo 0` whenever nodes × threads exceed the machine's cores, so there the plain rows
 * run without it too (the runtime's log line says so).
 *
 * Per engine, rounds alternate the two paths (the order flips each round, so drift in the
 * machine's load hits both alike); a round asks each path for one answer not streamed and one
 * streamed, greedy (temperature 0), `max_tokens` BENCH_MAX_TOKENS, at concurrency 1, each request a
 * prompt of its own (a number first, so llama.cpp's slot cannot reuse the last prompt: both
 * engines evaluate the whole prompt, ~100 tokens, every time). Measured:
 * - tokens/s: completion tokens (usage) over the whole request not streamed, prompt included;
 * - generation tokens/s: streamed content chunks after the first over the time from the first to
 *   the last (one chunk a token, as both engines stream these answers);
 * - time to first token: the first streamed content chunk;
 * - what magus adds at concurrency 1, paired per request: the bridge (bench/gateway-serving.ts)
 *   notes when it called the engine and when the answer (not streamed) or the first token
 *   (streamed) came back; the request's time at the client less that is magus's (as in
 *   bench/gateway-real.ts). The difference of two p50s of seconds-long answers cannot resolve
 *   milliseconds; it is shown beside it;
 * - CPU seconds of the engine's processes per generated token.
 * The load average before and after is printed: on a shared 2-core VM it moves every figure.
 *
 * No round of a target begins after its first once it has used BENCH_TARGET_SEC of wall time, so a
 * slow topology cannot stretch the run much (a round is never cut): the tables say how many
 * requests each figure has.
 * Ctrl-C (or SIGTERM) stops every process started (engines, topologies, bridge, NATS) before it
 * exits; they also run under `setpriv --pdeathsig KILL`, so none outlives this process.
 *
 * Environment: BENCH_TARGETS (default `llamacpp,dllama1,dllama2,dllama4,dllama2-noturbo,dllama4-noturbo`),
 * BENCH_ROUNDS (default 4), BENCH_TARGET_SEC (default 100), BENCH_MAX_TOKENS (default 64),
 * BENCH_THREADS (per process, default 1 as the local runtime: MAGUS_DLLAMA_THREADS, the llama.cpp
 * engine's default), BENCH_LAYERS (default 16: the model's size), BENCH_WARM_UP (short requests
 * through magus before the first target is measured, default 20).
 */
import { randomBytes } from 'node:crypto';
import { chmodSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { open } from 'node:fs/promises';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { connect, type KV, type NatsConnection } from 'nats';
import { startDllamaTopology, type DllamaTopology } from '../activities/runtime/dllama';
import { startLlamaCppEngine } from '../activities/runtime/llama-cpp';
import { convertModel } from '../convert/convert';
import { ensureDataPlane } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { loadGatewayConfig } from '../gateway/config';
import { tokenDigest } from '../gateway/plugins/auth';
import type { ColdStart } from '../gateway/serving/sessions';
import { startGateway } from '../gateway/server';
import type { EngineKind } from '../shared/engines';
import type { ReadyModel } from '../shared/model';
import type { SessionEntry } from '../shared/serving';
import { binaryPath, resolveBinaries, startServices } from '../workers/dev/services';
import { gpt2ByteChars, writeTinyModel, type TinyModel } from '../workers/dev/tiny-model';
import { ask, child, cpuOf, fmt, load, p50, signed } from './common';
import type { LoadResult, LoadSpec, Sample } from './gateway-client';
import type { ServingCommand, ServingReply, TraceEvent } from './gateway-serving';

const TARGETS = (process.env.BENCH_TARGETS ?? 'llamacpp,dllama1,dllama2,dllama4,dllama2-noturbo,dllama4-noturbo').split(',').map((t) => t.trim());
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? '4');
/** A target's rounds stop after this much wall time (once it has {@link MIN_ROUNDS}). */
const TARGET_SEC = Number(process.env.BENCH_TARGET_SEC ?? '100');
const MIN_ROUNDS = 1;
const MAX_TOKENS = Number(process.env.BENCH_MAX_TOKENS ?? '64');
const THREADS = Number(process.env.BENCH_THREADS ?? '1');
const LAYERS = Number(process.env.BENCH_LAYERS ?? '16');
const WARM_UP = Number(process.env.BENCH_WARM_UP ?? '20');
const LAYOUT = {
  seed: 37,
  hiddenSize: 1024,
  intermediateSize: 2816,
  numLayers: LAYERS,
  numHeads: 16,
  numKvHeads: 4,
  vocabSize: 4096,
  maxPositionEmbeddings: 2048,
};
/** Context of the engines (`--ctx`, `--max-seq-len`): the prompt and answer fit many times over. */
const CTX = 1024;
/** The added latency `npm run bench:gateway` measures against a stub (bench/README.md, "Gateway overhead"): non-stream, c=1, p50. */
const STUB_ADDED_MS = 1.52;
const PREFIX = 'BENCHDLLAMA';
const PROMPT = 'Write a short story about a lighthouse keeper who finds a message in a bottle. Keep it simple.';
const TOKEN_ID = 'bench';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(24).toString('hex')}`;

type Path = 'direct' | 'magus';
const PATHS: readonly Path[] = ['direct', 'magus'];

interface Target {
  name: string;
  engine: EngineKind;
  nodes: number;
  /** distributed-llama's `--net-turbo` (its default, 1, is what magus runs). */
  turbo: boolean;
}

function parseTarget(name: string): Target {
  if (name === 'llamacpp') return { name, engine: 'llamacpp', nodes: 1, turbo: true };
  const m = /^dllama(1|2|4|8|16)(-noturbo)?$/.exec(name);
  if (!m) throw new Error(`BENCH_TARGETS: ${name} is not llamacpp, dllama<nodes> or dllama<nodes>-noturbo`);
  return { name, engine: 'dllama', nodes: Number(m[1]), turbo: m[2] === undefined };
}

const describe = (t: Target): string =>
  t.engine === 'llamacpp'
    ? `llama.cpp (magus engine), Q4_0, ${THREADS} thread(s)`
    : `distributed-llama, q40, ${t.nodes} node(s) × ${THREADS} thread(s)${t.turbo ? '' : ', --net-turbo 0'}`;

/** What one target measured. */
interface Measured {
  target: Target;
  rounds: number;
  /** Not streamed / streamed, per path. */
  whole: Record<Path, Sample[]>;
  streamed: Record<Path, Sample[]>;
  /** Through magus, per request: its time at the client less the engine call's as the bridge saw it (non-stream: whole; stream: first token). */
  outsideWhole: number[];
  outsideFirst: number[];
  promptTokens: number;
  /** Engine CPU seconds while measuring, and the tokens generated meanwhile. */
  cpuSec: number;
  tokens: number;
  startSec: number;
  wallSec: number;
}

/** Each non-stream answer's tokens/s (completion tokens over the whole request). */
const requestRates = (s: Sample[]) => s.map((x) => x.completionTokens! / ((x.end - x.start) / 1000));
/** Each streamed answer's generation rate: chunks after the first over the first to the last. */
const generationRates = (s: Sample[]) =>
  s.filter((x) => x.chunks!.length > 1).map((x) => (x.chunks!.length - 1) / ((x.chunks!.at(-1)! - x.chunks![0]!) / 1000));
const firstTokenMs = (s: Sample[]) => s.map((x) => x.chunks![0]! - x.start);
const wallMs = (s: Sample[]) => s.map((x) => x.end - x.start);
const range = (v: number[]) => (v.length === 0 ? '—' : `${Math.min(...v)}–${Math.max(...v)}`);

/**
 * Zeroes the output rows (`lm_head.weight`, F16) of every token that is not printable ASCII, or
 * holds `<` or `|`, special tokens included; returns how many tokens are left to answer with.
 * A random model's greedy answer is otherwise full of lone bytes of UTF-8 sequences, which
 * neither engine streams until they form a character (often never), and of pieces of
 * distributed-llama's stop strings (`<|eot_id|>`), which it holds back: the stream would not
 * show when each token was made. A zero row's logit is 0, below the best of the thousands of
 * random ones, so the answer never has those tokens (and never ends before `max_tokens`).
 */
async function printableAnswers(model: TinyModel): Promise<number> {
  const tokenizer = JSON.parse(readFileSync(join(model.dir, 'tokenizer.json'), 'utf8')) as { model: { vocab: Record<string, number> } };
  const { char } = gpt2ByteChars();
  const byteOf = new Map(char.map((c, b) => [c, b]));
  const printable = new Set<number>();
  for (const [piece, id] of Object.entries(tokenizer.model.vocab)) {
    const bytes = [...piece].map((c) => byteOf.get(c) ?? -1);
    if (bytes.every((b) => b >= 0x20 && b <= 0x7e && b !== 0x3c && b !== 0x7c)) printable.add(id);
  }
  const file = join(model.dir, 'model.safetensors');
  const fh = await open(file, 'r+');
  try {
    const head = Buffer.alloc(8);
    await fh.read(head, 0, 8, 0);
    const headerBytes = Number(head.readBigUInt64LE(0));
    const header = Buffer.alloc(headerBytes);
    await fh.read(header, 0, headerBytes, 8);
    const entry = (JSON.parse(header.toString('utf8')) as Record<string, { dtype: string; shape: number[]; data_offsets: [number, number] }>)['lm_head.weight'];
    if (!entry || entry.dtype !== 'F16') throw new Error('the model has no F16 lm_head.weight');
    const [rows, cols] = entry.shape as [number, number];
    const zeros = Buffer.alloc(cols * 2);
    for (let row = 0; row < rows; row++) {
      if (!printable.has(row)) await fh.write(zeros, 0, zeros.length, 8 + headerBytes + entry.data_offsets[0] + row * cols * 2);
    }
  } finally {
    await fh.close();
  }
  return printable.size;
}

/** Everything to stop, newest first; run once, on the way out or on a signal. */
const cleanups: (() => unknown)[] = [];
const abort = new AbortController();
let stopping: Promise<void> | undefined;
const stopAll = (): Promise<void> =>
  (stopping ??= (async () => {
    for (const c of cleanups.reverse()) {
      try {
        await c();
      } catch (err) {
        console.error(`cleanup: ${String(err)}`);
      }
    }
  })());
const deferred = (fn: () => unknown): (() => Promise<void>) => {
  cleanups.push(fn);
  return async () => {
    cleanups.splice(cleanups.indexOf(fn), 1);
    await fn();
  };
};

/** Whether `pid` still runs (a zombie does not). */
function running(pid: number): boolean {
  try {
    return !/^\d+ \([^)]*\) Z/.test(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return false;
  }
}

async function main(): Promise<void> {
  const targets = TARGETS.map(parseTarget);
  const load0 = loadavg();
  const t0 = performance.now();
  const bins = await resolveBinaries(['dllama', 'dllama-api'], (line) => console.log(line));
  const dir = mkdtempSync(join(tmpdir(), 'magus-bench-dllama-'));
  deferred(() => rmSync(dir, { recursive: true, force: true }));

  // --- The model, and what magus converts it to.
  console.log('writing the model and converting it (GGUF Q4_0, distributed-llama q40) …');
  const hf = await writeTinyModel(join(dir, 'hf'), LAYOUT);
  const answering = await printableAnswers(hf);
  const params = hf.tensors.reduce((a, t) => a + t.shape.reduce((x, y) => x * y, 1), 0);
  const gguf = join(dir, 'model-q4_0.gguf');
  await convertModel({ source: hf.dir, format: 'gguf', weights: 'q40', output: gguf, threads: 2 });
  const dllamaDir = join(dir, 'dllama');
  await convertModel({ source: hf.dir, format: 'dllama', weights: 'q40', output: dllamaDir, threads: 2 });
  const files = { model: join(dllamaDir, 'model.m'), tokenizer: join(dllamaDir, 'tokenizer.t') };
  const size = {
    f16: hf.totalSize,
    gguf: statSync(gguf).size,
    m: statSync(files.model).size,
  };
  const mb = (n: number) => `${fmt(n / 1e6, 1)} MB`;
  const modelLine = `model: random Llama (tiny-model, seed ${LAYOUT.seed}), hidden ${LAYOUT.hiddenSize}, ${LAYOUT.numLayers} layers, ${LAYOUT.numHeads} heads / ${LAYOUT.numKvHeads} KV heads of ${LAYOUT.hiddenSize / LAYOUT.numHeads}, FFN ${LAYOUT.intermediateSize}, vocabulary ${LAYOUT.vocabSize} (answers from its ${answering} printable tokens): ${fmt(params / 1e6, 1)} M parameters; F16 safetensors ${mb(size.f16)}, GGUF Q4_0 ${mb(size.gguf)}, distributed-llama q40 .m ${mb(size.m)}`;
  console.log(`${modelLine} (ready in ${fmt((performance.now() - t0) / 1000, 1)} s)`);

  // distributed-llama with `--net-turbo 0`: the same programs through a wrapper (the runtime's argument builders have no such flag).
  const wrapper = (name: string, bin: string, flagFirst: boolean) => {
    const path = join(dir, name);
    // The root's `--workers` takes every argument after it: the flag goes first there, last for a worker.
    writeFileSync(path, `#!/bin/sh\nexec '${bin}' ${flagFirst ? '--net-turbo 0 "$@"' : '"$@" --net-turbo 0'}\n`);
    chmodSync(path, 0o755);
    return path;
  };
  const programs = {
    turbo: { apiBin: binaryPath(bins, 'dllama-api'), workerBin: binaryPath(bins, 'dllama') },
    noturbo: {
      apiBin: wrapper('dllama-api-noturbo', binaryPath(bins, 'dllama-api'), true),
      workerBin: wrapper('dllama-noturbo', binaryPath(bins, 'dllama'), false),
    },
  };

  // --- NATS, the gateway (this process), the bridge and the load (children).
  const services = await startServices({ services: ['nats'], dataDir: dir });
  deferred(() => services.stop());
  const nats = services.endpoints.nats!.servers;
  // A child a Ctrl-C ended (it shares the terminal's process group) is asked nothing more.
  const serving = child('gateway-serving.ts').on('error', () => undefined);
  deferred(async () => {
    await askBriefly({ type: 'stop' });
    serving.kill();
  });
  /** Asks the serving child on the way out: not at all once it is gone, and for 10 s at most. */
  const askBriefly = async (cmd: ServingCommand) => {
    if (!serving.connected) return;
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([ask(serving, cmd).catch(() => undefined), new Promise((r) => (timer = setTimeout(r, 10_000)))]);
    clearTimeout(timer);
  };
  const client = child('gateway-client.ts').on('error', () => undefined);
  deferred(() => client.kill());
  const nc: NatsConnection = await connect({ servers: nats, name: 'bench', noAsyncTraces: true });
  deferred(() => nc.drain());
  const names = await ensureDataPlane(nc, { prefix: PREFIX });
  const registry = await openModelRegistry(nc, names.modelsBucket);
  const sessionsKv: KV = await nc.jetstream().views.kv(names.sessionsBucket);
  /** Where each target's conversation goes: its entry while it is being seeded, no cold path otherwise. */
  const seeding = new Map<string, SessionEntry>();
  const coldStart: ColdStart = async (req) => {
    const entry = seeding.get(req.model.name);
    if (!entry) throw new Error(`cold start of ${req.model.name} while measuring`);
    await sessionsKv.put(req.conversationKey, new TextEncoder().encode(JSON.stringify(entry)));
    return entry;
  };
  const config = loadGatewayConfig({
    MAGUS_GATEWAY_HOST: '127.0.0.1',
    MAGUS_GATEWAY_PORT: '0',
    MAGUS_NATS_URL: nats,
    MAGUS_NATS_PREFIX: PREFIX,
    MAGUS_GATEWAY_SECRET: randomBytes(32).toString('hex'),
    MAGUS_GATEWAY_TOKENS: JSON.stringify({ [TOKEN_ID]: { digest: tokenDigest(TOKEN), name: 'bench' } }),
    MAGUS_LOG_LEVEL: 'warn',
  });
  const gateway = await startGateway(config, { nc, coldStart });
  deferred(() => gateway.close());

  let promptNo = 0;
  const results: Measured[] = [];
  const startedPids: number[] = [];
  for (const [i, target] of targets.entries()) {
    if (abort.signal.aborted) break;
    console.log(`\n${target.name}: ${describe(target)}`);
    const started = performance.now();
    let url: string;
    let pids: number[];
    let stopEngine: () => Promise<void>;
    if (target.engine === 'llamacpp') {
      const engine = await startLlamaCppEngine(gguf, {
        modelId: target.name,
        slots: 1,
        threads: THREADS,
        ctx: CTX,
        startTimeoutSec: 300,
        name: 'bench-llamacpp',
        log: (line) => console.log(line),
        signal: abort.signal,
      });
      url = engine.url;
      pids = [engine.process.child.pid!];
      stopEngine = deferred(() => engine.process.stop(5_000));
    } else {
      const topology: DllamaTopology = await startDllamaTopology(
        { ...files, maxSeqLen: CTX, buffer: 'q80' },
        {
          ...programs[target.turbo ? 'turbo' : 'noturbo'],
          nodes: target.nodes,
          threads: THREADS,
          name: target.name,
          log: (line) => console.log(line),
          signal: abort.signal,
        },
      );
      url = topology.url;
      pids = topology.nodes.map((n) => n.process.child.pid!);
      stopEngine = deferred(() => topology.stop());
    }
    startedPids.push(...pids);
    const startSec = (performance.now() - started) / 1000;
    const model: ReadyModel = {
      namespace: 'default',
      name: target.name,
      source: { repo: `bench/${target.name}`, revision: 'main', sha: '0'.repeat(40) },
      artifacts: [],
      memory: [],
      readyAt: new Date().toISOString(),
    };
    await registry.put(model);
    const bridge = await ask<Extract<ServingReply, { re: 'bridge' }>>(serving, {
      type: 'bridge',
      nats,
      prefix: PREFIX,
      pool: target.name,
      instance: 'i1',
      slots: 1,
      engineUrl: url,
      engineKind: target.engine,
    } satisfies ServingCommand);
    const stopBridge = deferred(() => askBriefly({ type: 'unbridge' }));
    const session = `dllama-bench-${target.name}`;
    const spec = (path: Path, stream: boolean, prompt: string, maxTokens = MAX_TOKENS): LoadSpec => ({
      url: `${path === 'direct' ? url : gateway.url}/v1/chat/completions`,
      token: TOKEN,
      model: target.name,
      concurrency: 1,
      requests: 1,
      sessionIds: [session],
      stream,
      prompt,
      maxTokens,
      temperature: 0,
      varyPrompt: true, // `(request 0)` last: the mark by which the bridge's trace names the request
    });

    // The conversation's first turn pins it to the instance (the gateway's cold path); the prompt's size, directly.
    seeding.set(target.name, { subject: bridge.subject, pool: target.name, instance: 'i1', expiresAt: Date.now() + 24 * 3_600_000 });
    await load(client, spec('magus', false, 'Hi', 1));
    seeding.delete(target.name);
    const probe = (await (
      await fetch(`${url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ messages: [{ role: 'user', content: `0. ${PROMPT} (request 0)` }], max_tokens: 1, temperature: 0 }),
        signal: abort.signal,
      })
    ).json()) as { usage?: { prompt_tokens?: number } };
    if (i === 0 && WARM_UP > 0) {
      // The gateway's and the bridge's code compiled by V8's optimizing tiers before anything is measured.
      const w0 = performance.now();
      for (let n = 0; n < WARM_UP; n++) await load(client, spec('magus', n % 2 === 1, 'Hi', 1));
      console.log(`warm-up: ${WARM_UP} requests of 1 token through magus in ${fmt((performance.now() - w0) / 1000, 1)} s`);
    }

    const m: Measured = {
      target,
      rounds: 0,
      whole: { direct: [], magus: [] },
      streamed: { direct: [], magus: [] },
      outsideWhole: [],
      outsideFirst: [],
      promptTokens: probe.usage?.prompt_tokens ?? NaN,
      cpuSec: 0,
      tokens: 0,
      startSec,
      wallSec: 0,
    };
    const cpu0 = pids.reduce((a, p) => a + cpuOf(p), 0);
    const m0 = performance.now();
    for (let round = 0; round < ROUNDS && !abort.signal.aborted; round++) {
      if (round >= MIN_ROUNDS && (performance.now() - m0) / 1000 > TARGET_SEC) break;
      const order = round % 2 === 0 ? PATHS : [...PATHS].reverse();
      for (const path of order) {
        for (const stream of [false, true]) {
          const prompt = `${++promptNo}. ${PROMPT}`;
          if (path === 'magus') await ask(serving, { type: 'trace', on: true } satisfies ServingCommand);
          const r: LoadResult = await load(client, spec(path, stream, prompt));
          const s = r.samples[0]!;
          (stream ? m.streamed : m.whole)[path].push(s);
          m.tokens += stream ? s.chunks!.length : s.completionTokens!;
          if (path === 'magus') {
            const { events } = await ask<{ events: TraceEvent[] }>(serving, { type: 'trace', on: false } satisfies ServingCommand);
            const engine = events.filter((e) => e[0] === 'engine');
            if (engine.length !== 1)
              throw new Error(
                `the bridge saw ${engine.length} engine calls for one request (stream ${stream}): ${JSON.stringify(events)} ${JSON.stringify(s)}`,
              );
            const engineMs = engine[0]![3] - engine[0]![2];
            if (stream) m.outsideFirst.push(s.chunks![0]! - s.start - engineMs);
            else m.outsideWhole.push(s.end - s.start - engineMs);
          }
        }
      }
      m.rounds = round + 1;
      console.log(
        `  round ${round + 1}: ${PATHS.map((p) => `${p} ${fmt(requestRates(m.whole[p].slice(-1))[0]!, 1)} tokens/s, first token ${fmt(firstTokenMs(m.streamed[p].slice(-1))[0]!, 0)} ms`).join('; ')}`,
      );
    }
    m.wallSec = (performance.now() - m0) / 1000;
    m.cpuSec = pids.reduce((a, p) => a + cpuOf(p), 0) - cpu0;
    results.push(m);
    await stopBridge();
    await stopEngine();
  }
  const load1 = loadavg();

  // --- The figures.
  const out: string[] = [];
  out.push(
    `bench:dllama — ${cpus().length} cores, load ${load0.map((l) => l.toFixed(2)).join(' ')} → ${load1.map((l) => l.toFixed(2)).join(' ')}; ${fmt((performance.now() - t0) / 1000, 0)} s in all`,
  );
  out.push(modelLine);
  out.push(
    `per round and path: one answer not streamed and one streamed, greedy, max_tokens ${MAX_TOKENS}, concurrency 1; up to ${ROUNDS} rounds (none begun past ${TARGET_SEC} s)`,
  );
  out.push('');
  out.push(
    '| engine | requests per path | tokens/s direct | through magus | ratio | generation tokens/s direct / magus | first token p50 direct | through magus | engine CPU per token |',
  );
  out.push('|---|---|---|---|---|---|---|---|---|');
  const baseline = results.find((r) => r.target.engine === 'llamacpp');
  for (const r of results) {
    const rate = (p: Path) => p50(requestRates(r.whole[p]));
    const vsLlama = baseline && baseline !== r ? ` (${fmt(rate('direct') / p50(requestRates(baseline.whole.direct)), 2)}× llama.cpp)` : '';
    out.push(
      `| ${describe(r.target)} | ${r.whole.direct.length} + ${r.streamed.direct.length} | ${fmt(rate('direct'), 1)}${vsLlama} | ${fmt(rate('magus'), 1)} | ${fmt(rate('magus') / rate('direct'), 3)}× | ${fmt(p50(generationRates(r.streamed.direct)), 1)} / ${fmt(p50(generationRates(r.streamed.magus)), 1)} | ${fmt(p50(firstTokenMs(r.streamed.direct)), 0)} ms | ${fmt(p50(firstTokenMs(r.streamed.magus)), 0)} ms | ${fmt((r.cpuSec * 1000) / r.tokens, 0)} ms |`,
    );
  }
  out.push('');
  out.push(
    `| engine | magus's cost, not streamed, p50 (paired) | to the first token, p50 (paired) | whole request p50 through magus − direct (unpaired) | bench:gateway against a stub |`,
  );
  out.push('|---|---|---|---|---|');
  for (const r of results) {
    out.push(
      `| ${describe(r.target)} | +${fmt(p50(r.outsideWhole))} ms | +${fmt(p50(r.outsideFirst))} ms | ${signed(p50(wallMs(r.whole.magus)) - p50(wallMs(r.whole.direct)), 0)} ms | +${STUB_ADDED_MS} ms |`,
    );
  }
  out.push('');
  out.push(`prompt tokens (usage, directly): ${results.map((r) => `${r.target.name} ${fmt(r.promptTokens, 0)}`).join(', ')}`);
  out.push(
    `tokens per answer (not streamed; streamed chunks): ${results.map((r) => `${r.target.name} ${range([...r.whole.direct, ...r.whole.magus].map((s) => s.completionTokens!))}; ${range([...r.streamed.direct, ...r.streamed.magus].map((s) => s.chunks!.length))}`).join(' · ')}`,
  );
  out.push(
    `start (engine serving): ${results.map((r) => `${r.target.name} ${fmt(r.startSec, 1)} s`).join(', ')}; measuring: ${results.map((r) => `${r.target.name} ${fmt(r.wallSec, 0)} s`).join(', ')}`,
  );
  console.log(`\n${out.join('\n')}`);

  await stopAll();
  const left = startedPids.filter(running);
  console.log(left.length === 0 ? `processes left: none of the ${startedPids.length} engine processes started` : `processes LEFT: ${left.join(', ')}`);
  if (left.length > 0) process.exitCode = 1;
}

for (const [signal, code] of [
  ['SIGINT', 130],
  ['SIGTERM', 143],
] as const) {
  process.once(signal, () => {
    console.error(`\n${signal}: stopping every process started …`);
    abort.abort(new Error(signal));
    void stopAll().finally(() => process.exit(code));
  });
}

main().then(
  () => process.exit(),
  async (err: unknown) => {
    // After a signal its handler exits, once everything is stopped.
    if (abort.signal.aborted) return;
    console.error(err);
    await stopAll();
    process.exit(1);
  },
);
