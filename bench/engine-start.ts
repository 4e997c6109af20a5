/**
 * What a local runtime's llama.cpp engine costs to start, with and without its engine on standby:
 * SmolLM2-135M-Instruct with bench:chaos's shape (4 slots, 2 resume sequences of 4,096 tokens, 1
 * thread), started `ENGINE_START_RUNS` times (default 4) each way in turn. Each start reports the
 * time from the call to the engine's `ready` (what a cold first turn waits for) and, with a warm
 * standby, to the standby's `waits on standby` (until then it loads and makes its context beside
 * whatever the engine serves).
 *
 * `npm run bench:engine-start`; each engine is stopped (with its standby) after its run.
 */
import { startSupervisedEngine } from '../activities/runtime/llama-cpp';
import { sleep, until } from '../test/harness/wait';
import { demoModelFile } from '../workers/dev/demo-model';
import { fmt, p50 } from './common';

const RUNS = Number(process.env.ENGINE_START_RUNS ?? 4);
const KINDS = ['none', 'warm', 'mapped'] as const;

interface Start {
  readyMs: number;
  standbyMs?: number;
}

async function startOnce(gguf: string, kind: (typeof KINDS)[number]): Promise<Start> {
  const t0 = performance.now();
  let standbyMs: number | undefined;
  const engine = await startSupervisedEngine(gguf, {
    modelId: 'bench',
    slots: 4,
    resumeSlots: 2,
    threads: 1,
    ctx: 4096,
    startTimeoutSec: 120,
    name: 'engine',
    log: (line) => {
      if (/waits on standby/.test(line)) standbyMs = performance.now() - t0;
    },
    stopGraceMs: 1000,
    ...(kind !== 'none' ? { standby: kind } : {}),
  });
  const readyMs = performance.now() - t0;
  if (kind !== 'none') await until('its engine on standby', () => standbyMs !== undefined, 60_000);
  await engine.stop();
  return { readyMs, ...(standbyMs !== undefined ? { standbyMs } : {}) };
}

async function main(): Promise<void> {
  const gguf = await demoModelFile((line) => console.log(line));
  const runs = new Map<string, Start[]>(KINDS.map((k) => [k, []]));
  for (let i = 0; i < RUNS; i++)
    for (const kind of KINDS) {
      const r = await startOnce(gguf, kind);
      runs.get(kind)!.push(r);
      console.log(
        `run ${i + 1}, standby ${kind}: ready after ${fmt(r.readyMs, 0)} ms${r.standbyMs !== undefined ? `, standby waiting after ${fmt(r.standbyMs, 0)} ms` : ''}`,
      );
      await sleep(500);
    }
  const of = (xs: number[]) => `p50 ${fmt(p50(xs))} / max ${fmt(Math.max(...xs))} s`;
  console.log(`bench:engine-start: ${RUNS} starts each`);
  for (const [kind, rs] of runs) {
    const standby = rs.flatMap((r) => (r.standbyMs !== undefined ? [r.standbyMs / 1000] : []));
    console.log(`  standby ${kind}: ready ${of(rs.map((r) => r.readyMs / 1000))}${standby.length > 0 ? `; standby waiting ${of(standby)}` : ''}`);
  }
}

void main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});
