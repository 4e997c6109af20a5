/**
 * `npm run bench:convert`: converts a synthetic ~1 GB F16 Llama checkpoint with `magus convert`
 * (each run in its own process, so peak RSS is that conversion's alone) and reports input MB/s,
 * peak RSS and threads for distributed-llama q40, GGUF Q4_0 and GGUF Q8_0.
 *
 * Environment: BENCH_THREADS (default "2"), BENCH_DIR (default ~/.cache/magus/bench; the model
 * is generated once and reused), BENCH_KEEP=1 keeps the outputs.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { homedir, cpus } from 'node:os';
import { join } from 'node:path';
import { writeTinyModel, type TinyModelOptions } from '../workers/dev/tiny-model';

const MODEL: TinyModelOptions = {
  seed: 42,
  dtype: 'F16',
  hiddenSize: 2048,
  intermediateSize: 5632,
  numLayers: 8,
  numHeads: 16,
  numKvHeads: 4,
  vocabSize: 32000,
  maxPositionEmbeddings: 4096,
};

const root = process.env.BENCH_DIR ?? join(homedir(), '.cache', 'magus', 'bench');
const threads = (process.env.BENCH_THREADS ?? '2').split(',').map(Number);
const bin = join(__dirname, '..', 'bin', 'magus.js');

function dirBytes(dir: string): number {
  return readdirSync(dir)
    .filter((f) => f.endsWith('.safetensors'))
    .reduce((n, f) => n + statSync(join(dir, f)).size, 0);
}

async function main(): Promise<void> {
  const modelDir = join(root, `llama-f16-${MODEL.hiddenSize}x${MODEL.numLayers}-s${MODEL.seed}`);
  const marker = join(modelDir, '.complete');
  if (!existsSync(marker)) {
    rmSync(modelDir, { recursive: true, force: true });
    mkdirSync(modelDir, { recursive: true });
    const t0 = Date.now();
    process.stderr.write(`generating the benchmark model in ${modelDir} …\n`);
    await writeTinyModel(modelDir, MODEL);
    writeFileSync(marker, '');
    process.stderr.write(`generated in ${((Date.now() - t0) / 1000).toFixed(1)}s\n`);
  }
  const inputBytes = dirBytes(modelDir);
  const outDir = join(root, 'out');
  mkdirSync(outDir, { recursive: true });

  const runs = [
    { label: 'dllama q40', format: 'dllama', weights: 'q40', out: join(outDir, 'dllama-q40') },
    { label: 'GGUF Q4_0', format: 'gguf', weights: 'q40', out: join(outDir, 'model-Q4_0.gguf') },
    { label: 'GGUF Q8_0', format: 'gguf', weights: 'q80', out: join(outDir, 'model-Q8_0.gguf') },
  ];
  console.log(
    `input: ${(inputBytes / 1e6).toFixed(0)} MB of F16 safetensors (largest tensor: embeddings, ${((MODEL.vocabSize! * MODEL.hiddenSize! * 2) / 1e6).toFixed(0)} MB F16); cpu: ${cpus()[0]?.model ?? '?'} × ${cpus().length}`,
  );
  for (const t of threads) {
    for (const r of runs) {
      rmSync(r.out, { recursive: true, force: true });
      const t0 = process.hrtime.bigint();
      const p = spawnSync(process.execPath, [bin, 'convert', modelDir, '--format', r.format, '--weights', r.weights, '-o', r.out, '--threads', String(t)], {
        encoding: 'utf8',
      });
      const sec = Number(process.hrtime.bigint() - t0) / 1e9;
      if (p.status !== 0) throw new Error(`${r.label} failed:\n${p.stderr}`);
      const rss = /peak RSS ([\d.]+ [KMG]?B)/.exec(p.stderr)?.[1] ?? '?';
      // The CLI's own figure excludes process start-up (node, module loading, worker spawn).
      const inner = /in [\d.]+s \(([\d.]+ [KMG]?B)\/s/.exec(p.stderr)?.[1] ?? '?';
      const row = `${r.label.padEnd(11)} threads ${t}  ${(inputBytes / 1e6 / sec).toFixed(0).padStart(5)} MB/s input (whole process; ${inner}/s inside the conversion)  ${sec.toFixed(2).padStart(6)} s  peak RSS ${rss}`;
      console.log(row);
      if (!process.env.BENCH_KEEP) rmSync(r.out, { recursive: true, force: true });
    }
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
