/**
 * The container images, run with podman as a cluster would run them: a read-only root
 * filesystem, the numeric non-root user of the image, models mounted read-only.
 * - magus: `--version` and `--help`; `magus engine` serves the tiny GGUF with nothing writable at
 *   all; `magus worker` reaches the real Temporal, NATS and S3 of this run (host network) and is
 *   ready, then stops on SIGTERM.
 * - the distributed-llama stand-in (test/fixtures/fake-dllama.js as dllama and dllama-api):
 *   refuses flags the real programs refuse; a root and a worker in two containers sharing one
 *   network namespace (as in a pod) serve the tiny model, and tini makes SIGTERM stop them.
 *
 * The images come from scripts/images (the test command runs it before jest): this test only
 * asks it, with --check, which images to run, and fails if they are missing or stale. The real
 * distributed-llama image is built only where its source archive is given; README "Container
 * images" says how it was checked.
 */
import { execFile } from 'node:child_process';
import { chmodSync, copyFileSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { convertModel } from '../convert/convert';
import { MODES } from '../shared/constants';
import { freePort } from '../workers/dev/services';
import { writeTinyModel } from '../workers/dev/tiny-model';
import { isolation, workerEnv } from './harness';
import { eventually, processRunning } from './harness/wait';

const REPO = join(__dirname, '..');
const VERSION = (JSON.parse(readFileSync(join(REPO, 'package.json'), 'utf8')) as { version: string }).version;
// The host quirks scripts/images works around (images/containers.conf, the storage driver) apply
// to every podman call here too.
const ENV = { ...process.env, CONTAINERS_CONF: process.env.CONTAINERS_CONF ?? join(REPO, 'images', 'containers.conf') };
const DRIVER = process.env.MAGUS_STORAGE_DRIVER ?? 'overlay';
/** As Kubernetes runs a pod with readOnlyRootFilesystem and no volumes: podman adds no tmpfs. */
const READ_ONLY = ['--read-only', '--read-only-tmpfs=false'];

interface Ran {
  code: number;
  stdout: string;
  stderr: string;
}

function execute(file: string, args: string[], timeoutMs: number): Promise<Ran> {
  return new Promise((resolve, reject) => {
    execFile(file, args, { env: ENV, timeout: timeoutMs, maxBuffer: 16 << 20 }, (err, stdout, stderr) => {
      if (err && typeof err.code !== 'number') {
        reject(
          new Error(
            err.code === 'ENOENT' ? `${file} is not installed: scripts/images installs it (apt)` : `${file} ${args.join(' ')}: ${err.message}\n${stderr}`,
          ),
        );
        return;
      }
      resolve({ code: typeof err?.code === 'number' ? err.code : 0, stdout, stderr });
    });
  });
}

const podman = (args: string[], timeoutMs = 60_000): Promise<Ran> => execute('podman', ['--storage-driver', DRIVER, ...args], timeoutMs);

/** podman that must succeed; its stdout, trimmed. */
async function podmanOk(args: string[], timeoutMs?: number): Promise<string> {
  const ran = await podman(args, timeoutMs);
  if (ran.code !== 0) throw new Error(`podman ${args.join(' ')} exited with ${ran.code}: ${ran.stderr}`);
  return ran.stdout.trim();
}

interface ImageConfig {
  Size: number;
  Labels: Record<string, string> | null;
  Config: { User: string; Entrypoint: string[] | null; Env: string[] };
}

async function inspectImage(image: string): Promise<ImageConfig> {
  return (JSON.parse(await podmanOk(['image', 'inspect', image])) as ImageConfig[])[0]!;
}

/** The host address podman published a container's port on. */
async function published(container: string, port: number): Promise<string> {
  return `http://${await podmanOk(['port', container, `${port}/tcp`])}`;
}

async function json<T>(url: string, init?: RequestInit): Promise<T> {
  const res = await fetch(url, { ...init, signal: AbortSignal.timeout(10_000) });
  if (!res.ok) throw new Error(`${init?.method ?? 'GET'} ${url}: ${res.status} ${await res.text()}`);
  return (await res.json()) as T;
}

interface Models {
  data: { id: string }[];
}
interface Completion {
  choices: { message: { role: string; content: string }; finish_reason: string }[];
  usage: { completion_tokens: number };
}
const ask = (base: string, content: string): Promise<Completion> =>
  json<Completion>(`${base}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ messages: [{ role: 'user', content }], max_tokens: 4, temperature: 0 }),
  });

/** Stops a container with SIGTERM (SIGKILL after `graceSec`); how long it took, and its exit code. */
async function stop(container: string, graceSec: number): Promise<{ ms: number; exitCode: number }> {
  const started = Date.now();
  await podmanOk(['stop', '-t', String(graceSec), container], (graceSec + 30) * 1000);
  const ms = Date.now() - started;
  return { ms, exitCode: Number(await podmanOk(['inspect', '--format', '{{.State.ExitCode}}', container])) };
}

const iso = isolation();
let images: Record<string, string>;
let dir: string;
const containers: string[] = [];
/** Marks this run's containers, so that a later run removes those a killed run left behind. */
const OWNER_LABEL = 'dev.magus.test-images-pid';

/** `podman run -d` of a container of this run (removed after it); its name. */
async function runDetached(role: string, args: string[]): Promise<string> {
  const name = `${iso.id}-${role}`;
  containers.push(name);
  await podmanOk(['run', '-d', '--name', name, '--label', `${OWNER_LABEL}=${process.pid}`, ...args]);
  return name;
}

/** Removes a container, and any that joined its network namespace, whatever state they are in. */
async function removeContainer(name: string): Promise<void> {
  await podman(['rm', '-f', '--depend', '-t', '0', name]);
}

async function removeLeftovers(): Promise<void> {
  const listed = await podmanOk(['ps', '-a', '--filter', `label=${OWNER_LABEL}`, '--format', `{{.Names}} {{index .Labels "${OWNER_LABEL}"}}`]);
  const dead = listed
    .split('\n')
    .filter(Boolean)
    .map((line) => line.split(' '))
    .filter(([, pid]) => !processRunning(Number(pid)));
  for (const [name] of dead) await removeContainer(name!);
}

beforeAll(async () => {
  const version = await podman(['version', '--format', '{{.Client.Version}}']);
  if (version.code !== 0) throw new Error(`podman cannot run here: ${version.stderr}`);
  const check = await execute(join(REPO, 'scripts', 'images'), ['--check', '--json'], 60_000);
  if (check.code !== 0) throw new Error(`the images are missing or stale: run scripts/images (npm test does)\n${check.stderr}`);
  images = JSON.parse(check.stdout) as Record<string, string>;
  await removeLeftovers();

  dir = mkdtempSync(join(tmpdir(), 'magus-images-'));
  chmodSync(dir, 0o755); // the images' user reads what is mounted from here
  await writeTinyModel(join(dir, 'tiny'), { seed: 51 });
  await convertModel({ source: join(dir, 'tiny'), format: 'gguf', weights: 'q80', output: join(dir, 'tiny.gguf'), threads: 1 });
  await convertModel({ source: join(dir, 'tiny'), format: 'dllama', weights: 'q40', output: join(dir, 'dllama'), threads: 1 });
});

afterAll(async () => {
  for (const name of containers) await removeContainer(name);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

describe('the magus image', () => {
  test('is built as its Dockerfile says: non-root, the CLI as entrypoint, production dependencies only', async () => {
    const image = await inspectImage(images.magus!);
    expect(image.Config.User).toBe('65532:65532');
    expect(image.Config.Entrypoint).toEqual(['node', '/app/bin/magus.js']);
    expect(image.Labels?.['org.opencontainers.image.version']).toBe(VERSION);
    const llamaBuilds = await podmanOk(['run', '--rm', ...READ_ONLY, '--entrypoint', 'ls', images.magus!, '/app/node_modules/@node-llama-cpp']);
    expect(llamaBuilds.split('\n')).toEqual([`linux-${process.arch}`]); // the CPU build of llama.cpp, no GPU builds
    const devDependency = await podman(['run', '--rm', ...READ_ONLY, '--entrypoint', 'ls', images.magus!, '/app/node_modules/typescript-eslint']);
    expect(devDependency.stderr).toContain('No such file');
    console.log(
      `image sizes: magus ${(image.Size / 1e6).toFixed(0)} MB, dllama stand-in ${((await inspectImage(images['dllama-stand-in']!)).Size / 1e6).toFixed(0)} MB`,
    );
    expect(image.Size).toBeLessThan(700e6);
  });

  test('--version prints the package version and --help names every mode', async () => {
    const version = await podman(['run', '--rm', ...READ_ONLY, images.magus!, '--version']);
    expect(version).toMatchObject({ code: 0, stdout: `${VERSION}\n` });
    const help = await podman(['run', '--rm', ...READ_ONLY, images.magus!, '--help']);
    expect(help.code).toBe(0);
    for (const mode of MODES) expect(help.stdout).toMatch(new RegExp(`^  ${mode} `, 'm'));
  });

  test('magus engine serves the tiny model from a read-only root with nothing writable, and stops on SIGTERM', async () => {
    const name = await runDetached('engine', [
      ...READ_ONLY,
      '-v',
      `${join(dir, 'tiny.gguf')}:/models/tiny.gguf:ro`,
      '-p',
      '127.0.0.1::8080',
      images.magus!,
      'engine',
      '--model',
      '/models/tiny.gguf',
      '--host',
      '0.0.0.0',
      '--port',
      '8080',
      '--threads',
      '1',
      '--ctx',
      '256',
    ]);
    const base = await published(name, 8080);
    const models = await eventually(() => json<Models>(`${base}/v1/models`), 60_000);
    expect(models.data.map((m) => m.id)).toEqual(['tiny.gguf']);
    await eventually(() => json(`${base}/health`), 60_000); // 200 once the model is loaded
    const answer = await ask(base, 'Hello!');
    expect(answer.choices[0]!.message.role).toBe('assistant');
    expect(answer.usage.completion_tokens).toBeGreaterThanOrEqual(1);
    expect(answer.usage.completion_tokens).toBeLessThanOrEqual(4);
    const stopped = await stop(name, 20);
    expect(stopped.exitCode).toBe(0);
    expect(stopped.ms).toBeLessThan(15_000);
  });

  test('magus worker runs against the real Temporal, NATS and S3 from a read-only root, and stops on SIGTERM', async () => {
    // Host network: the test servers listen on this machine's loopback. The worker's ports come
    // from outside the ephemeral range: between this pick and the container's listen, an
    // outgoing connection could take an ephemeral one as its source port (seen in CI).
    const [health, metrics] = [await freePort(), await freePort()];
    const env: NodeJS.ProcessEnv = {
      ...workerEnv(iso),
      MAGUS_TASK_QUEUE: iso.taskQueue,
      MAGUS_HEALTH_ADDRESS: `127.0.0.1:${health}`,
      MAGUS_METRICS_ADDRESS: `127.0.0.1:${metrics}`,
    };
    // Its NATS user's file, mounted as the chart mounts it (a copy the container's user can read).
    const creds = env.MAGUS_NATS_CREDENTIALS;
    const credsDir = mkdtempSync(join(tmpdir(), 'magus-image-nats-'));
    chmodSync(credsDir, 0o755);
    if (creds) {
      copyFileSync(creds, join(credsDir, 'creds'));
      chmodSync(join(credsDir, 'creds'), 0o644);
      env.MAGUS_NATS_CREDENTIALS = '/etc/magus/nats/creds';
    }
    const name = await runDetached('worker', [
      ...READ_ONLY,
      '--network',
      'host',
      ...(creds ? ['-v', `${credsDir}:/etc/magus/nats:ro`] : []),
      ...Object.entries(env).flatMap(([k, v]) => ['-e', `${k}=${v}`]),
      images.magus!,
      'worker',
    ]);
    await eventually(async () => {
      const res = await fetch(`http://127.0.0.1:${health}/readyz`, { signal: AbortSignal.timeout(5_000) });
      if (res.status !== 200) throw new Error(`/readyz: ${res.status}`);
    }, 90_000).catch(async (err: Error) => {
      throw new Error(`${err.message}\n${(await podman(['logs', name])).stderr.slice(-4000)}`);
    });
    const stopped = await stop(name, 30);
    expect(stopped.exitCode).toBe(0);
    expect(stopped.ms).toBeLessThan(25_000);
  });
});

describe('the distributed-llama stand-in image', () => {
  test('refuses what the real programs refuse', async () => {
    const image = images['dllama-stand-in']!;
    const unknown = await podman(['run', '--rm', ...READ_ONLY, '--tmpfs', '/tmp', image, 'dllama-api', '--bogus', '1']);
    expect(unknown).toMatchObject({ code: 1, stderr: expect.stringContaining('Unknown option: --bogus') as unknown });
    const workerWithModel = await podman(['run', '--rm', ...READ_ONLY, '--tmpfs', '/tmp', image, 'dllama', 'worker', '--port', '9998', '--model', '/m']);
    expect(workerWithModel).toMatchObject({ code: 1, stderr: expect.stringContaining('dllama worker ignores --model') as unknown });
    const threeNodes = await podman([
      'run',
      '--rm',
      ...READ_ONLY,
      '--tmpfs',
      '/tmp',
      '-v',
      `${join(dir, 'dllama')}:/models:ro`,
      image,
      'dllama-api',
      '--model',
      '/models/model.m',
      '--tokenizer',
      '/models/tokenizer.t',
      '--workers',
      '127.0.0.1:9001',
      '127.0.0.1:9002',
    ]);
    expect(threeNodes).toMatchObject({ code: 1, stderr: expect.stringContaining('3 nodes') as unknown });
  });

  test('a root and a worker sharing a network namespace serve the tiny model, and stop on SIGTERM', async () => {
    const image = images['dllama-stand-in']!;
    // The fake loads its HTTP layer through SWC, whose native addon unpacks itself under HOME
    // (/tmp): an emptyDir's place in a pod.
    const ro = [...READ_ONLY, '--tmpfs', '/tmp'];
    // The worker's container owns the namespace, so it publishes the root's port.
    const worker = await runDetached('dllama-worker', [
      ...ro,
      '-p',
      '127.0.0.1::9990',
      image,
      'dllama',
      'worker',
      '--host',
      '127.0.0.1',
      '--port',
      '9998',
      '--nthreads',
      '1',
    ]);
    const root = await runDetached('dllama-root', [
      ...ro,
      '--network',
      `container:${worker}`,
      '-v',
      `${join(dir, 'dllama')}:/models:ro`,
      image,
      'dllama-api',
      '--host',
      '0.0.0.0',
      '--port',
      '9990',
      '--model',
      '/models/model.m',
      '--tokenizer',
      '/models/tokenizer.t',
      '--buffer-float-type',
      'q80',
      '--nthreads',
      '1',
      '--max-seq-len',
      '256',
      '--workers',
      '127.0.0.1:9998',
    ]);
    const base = await published(worker, 9990);
    const models = await eventually(() => json<Models>(`${base}/v1/models`), 60_000);
    expect(models.data.map((m) => m.id)).toEqual(['model.m']);
    expect((await ask(base, 'Hello!')).choices[0]!.message.content).toBe('Hello! [2 nodes]');
    // tini is PID 1 and passes SIGTERM on (node as PID 1 would ignore it and wait for SIGKILL).
    for (const name of [root, worker]) {
      const stopped = await stop(name, 20);
      expect(stopped.ms).toBeLessThan(10_000);
      expect(stopped.exitCode).toBe(143); // killed by SIGTERM, as tini reports it
    }
  });
});
