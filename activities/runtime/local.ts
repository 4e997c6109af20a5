/**
 * The `local` runtime: a topology instance is an engine process on this machine (`magus engine`
 * over the model's GGUF, fetched once from S3 into a local cache) plus an in-process bridge that
 * pulls the instance's requests from NATS. Engines run under `setpriv --pdeathsig KILL`, so they
 * die with the worker that started them; the pool notices (describe) and starts new ones.
 */
import { GetObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { spawn, type ChildProcess } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { createWriteStream, existsSync, mkdirSync } from 'node:fs';
import { rename, rm } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { type Readable, Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { NatsConnection } from 'nats';
import { startBridge, type Bridge } from '../../workers/bridge';
import { deleteInstanceConsumer, ensureInstanceConsumer, requestSubjectOf, type DataPlaneNames } from '../nats/data-plane';
import type { ModelRegistry } from '../nats/registry';
import type { InstanceInfo, InstanceRequest, Runtime } from '../serving';

export interface LocalRuntimeOptions {
  nc: NatsConnection;
  names: DataPlaneNames;
  registry: ModelRegistry;
  s3: S3Client;
  bucket: string;
  /** Where GGUF files are cached, by sha256. */
  cacheDir: string;
  /** Engine slots per instance (default 1, like distributed-llama). */
  slots?: number;
  /** Engine threads (default 1: on small machines llama.cpp's spinning threads cost more than they give). */
  threads?: number;
  /** Seconds an engine may take to load its model. */
  startTimeoutSec?: number;
  log?: (line: string) => void;
}

interface LocalInstance {
  info: InstanceInfo;
  engine: ChildProcess;
  bridge: Bridge;
}

/** How to run `magus engine` from here: the compiled CLI, or the sources under a TS loader. */
function engineArgv(args: string[]): string[] {
  if (__filename.endsWith('.ts')) {
    const root = resolve(__dirname, '..', '..');
    return [process.execPath, '-r', require.resolve('@swc-node/register'), '-e', `require(${JSON.stringify(join(root, 'workers', 'engine'))}).engineCommand(process.argv.slice(1)).then((c) => process.exit(c))`, '--', ...args];
  }
  return [process.execPath, resolve(__dirname, '..', '..', '..', 'bin', 'magus.js'), 'engine', ...args];
}

export function createLocalRuntime(opts: LocalRuntimeOptions): Runtime & { stopAll(): Promise<void> } {
  const instances = new Map<string, LocalInstance>();
  const starting = new Map<string, Promise<InstanceInfo>>();
  const log = opts.log ?? (() => undefined);
  const slots = opts.slots ?? 1;
  const key = (pool: string, instance: string) => `${pool}/${instance}`;

  /** The model's GGUF in the local cache (downloaded and verified once). */
  async function modelFile(namespace: string, model: string): Promise<string> {
    const ready = await opts.registry.get(namespace, model);
    if (!ready) throw Object.assign(new Error(`model ${namespace}/${model} is not in the registry`), { name: 'ModelNotReady' });
    const gguf = ready.artifacts.filter((a) => a.format === 'gguf').sort((a, b) => ['q40', 'q80', 'f16', 'f32'].indexOf(a.weights) - ['q40', 'q80', 'f16', 'f32'].indexOf(b.weights))[0];
    const file = gguf?.files[0];
    if (!file) throw Object.assign(new Error(`model ${namespace}/${model} has no GGUF artifact for llama.cpp`), { name: 'NoArtifact' });
    mkdirSync(opts.cacheDir, { recursive: true });
    const path = join(opts.cacheDir, `${file.sha256}.gguf`);
    if (existsSync(path)) return path;
    const tmp = `${path}.tmp-${randomBytes(4).toString('hex')}`;
    const hash = createHash('sha256');
    try {
      const r = await opts.s3.send(new GetObjectCommand({ Bucket: opts.bucket, Key: file.key }));
      const hashing = new Transform({
        transform(chunk: Buffer, _enc, cb) {
          hash.update(chunk);
          cb(null, chunk);
        },
      });
      await pipeline(r.Body as Readable, hashing, createWriteStream(tmp));
      if (hash.digest('hex') !== file.sha256) throw new Error(`${file.key}: downloaded content does not match its sha256`);
      await rename(tmp, path);
    } finally {
      await rm(tmp, { force: true });
    }
    return path;
  }

  /** Starts an engine and resolves with its URL once it reports ready. */
  function startEngine(model: string, modelId: string): Promise<{ child: ChildProcess; url: string }> {
    const [cmd, ...args] = engineArgv(['--model', model, '--model-id', modelId, '--port', '0', '--json', '--slots', String(slots), '--threads', String(opts.threads ?? 1)]);
    const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', cmd!, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
    child.stderr?.on('data', (d: Buffer) => log(`engine: ${d.toString().trimEnd()}`));
    return new Promise((ok, fail) => {
      let url: string | null = null;
      const timer = setTimeout(() => {
        child.kill('SIGKILL');
        fail(new Error(`engine did not become ready within ${opts.startTimeoutSec ?? 120}s`));
      }, (opts.startTimeoutSec ?? 120) * 1000);
      child.once('exit', (code) => {
        clearTimeout(timer);
        fail(new Error(`engine exited with code ${code} before it was ready`));
      });
      createInterface({ input: child.stdout }).on('line', (line) => {
        let event: { event?: string; url?: string };
        try {
          event = JSON.parse(line) as typeof event;
        } catch {
          return;
        }
        if (event.event === 'listening' && event.url) url = event.url;
        if (event.event === 'ready' && url) {
          clearTimeout(timer);
          ok({ child, url });
        }
      });
    });
  }

  async function create(req: InstanceRequest): Promise<InstanceInfo> {
    const model = await modelFile(req.namespace, req.model);
    // Responses name the model as clients know it, not by its cached file.
    const { child, url } = await startEngine(model, req.model);
    try {
      await ensureInstanceConsumer(await opts.nc.jetstreamManager(), opts.names, { pool: req.pool, instance: req.instance, slots });
      const bridge = await startBridge({ nc: opts.nc, names: opts.names, pool: req.pool, instance: req.instance, engineUrl: url, slots, log });
      const info: InstanceInfo = { instance: req.instance, subject: requestSubjectOf(opts.names, req.pool, req.instance), healthy: true };
      instances.set(key(req.pool, req.instance), { info, engine: child, bridge });
      child.once('exit', () => {
        const i = instances.get(key(req.pool, req.instance));
        if (i) i.info = { ...i.info, healthy: false };
      });
      log(`instance ${req.pool}/${req.instance} serves ${model} at ${url}`);
      return info;
    } catch (err) {
      child.kill('SIGKILL');
      throw err;
    }
  }

  const runtime = {
    create(req: InstanceRequest): Promise<InstanceInfo> {
      const k = key(req.pool, req.instance);
      const existing = instances.get(k);
      if (existing?.info.healthy) return Promise.resolve(existing.info);
      let p = starting.get(k);
      if (!p) {
        p = create(req).finally(() => starting.delete(k));
        starting.set(k, p);
      }
      return p;
    },
    async destroy(pool: string, instance: string): Promise<void> {
      const k = key(pool, instance);
      const i = instances.get(k);
      instances.delete(k);
      if (i) {
        await i.bridge.stop();
        if (i.engine.exitCode === null && i.engine.signalCode === null) {
          const exited = new Promise((r) => i.engine.once('exit', r));
          i.engine.kill('SIGTERM');
          await Promise.race([exited, new Promise((r) => setTimeout(r, 10_000))]);
          i.engine.kill('SIGKILL');
        }
      }
      await deleteInstanceConsumer(await opts.nc.jetstreamManager(), opts.names, { pool, instance }).catch(() => false);
    },
    describe(pool: string, instance: string): Promise<InstanceInfo | null> {
      return Promise.resolve(instances.get(key(pool, instance))?.info ?? null);
    },
    async stopAll(): Promise<void> {
      await Promise.all([...instances.keys()].map((k) => runtime.destroy(...(k.split('/') as [string, string]))));
    },
  };
  return runtime;
}
