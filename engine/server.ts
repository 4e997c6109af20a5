/**
 * The engine process: listen first (so `/health` can answer 503 while the model loads), load the
 * model, serve, and on stop drain: refuse new requests, turn queued ones away, let generations in
 * flight finish for a grace period then abort them, close, and free the model.
 */
import type { AddressInfo } from 'node:net';
import { performance } from 'node:perf_hooks';
import type { FastifyInstance } from 'fastify';
import { createEngineHttp } from './app';
import { EngineCore } from './core';
import { LlamaBackend, type ChatTemplateInfo } from './llama';
import type { EngineOptions } from './options';

/** What a loaded engine serves. */
export interface LoadedEngine {
  model: string;
  slots: number;
  /** Tokens per slot. */
  contextSize: number;
  chatTemplate: ChatTemplateInfo;
  loadMs: number;
}

export interface RunningEngine {
  /** Base URL, e.g. `http://127.0.0.1:41234` (the API is under `/v1`). */
  url: string;
  core: EngineCore;
  /** The engine's HTTP app (for in-process calls: `inject`). */
  app: FastifyInstance;
  /** Resolves once the model is loaded and served; rejects if it cannot be loaded. */
  loaded: Promise<LoadedEngine>;
  /** Drains and stops (idempotent): see the file comment. */
  stop(): Promise<void>;
}

/**
 * An engine started on standby (`magus engine --standby`): it maps the model's weights, says so,
 * and waits to be told to serve — then listens (on a port another engine may have held until
 * then) and makes its context, so a restart in place costs that part only. A warm one
 * (`--warm`) makes its context before it waits: a start is the listening alone, at the cost of
 * a second KV cache's memory while it waits.
 */
export interface Standby {
  /** Make the context before waiting. */
  warm?: boolean;
  /** Called once the weights are mapped, before the engine listens. */
  waiting(): void;
  /** Resolves when the engine is to serve; a rejection ends the standby (nothing is served). */
  go: Promise<void>;
}

export async function startEngine(opts: EngineOptions, log: (message: string) => void, standby?: Standby): Promise<RunningEngine> {
  const backendOptions = {
    modelPath: opts.model,
    slots: opts.slots + opts.resumeSlots,
    threads: opts.threads,
    contextSize: opts.ctx,
    ...(opts.snapshots ? { snapshots: opts.snapshots } : {}),
    log,
  };
  const core = new EngineCore({ modelId: opts.modelId, slots: opts.slots, queue: opts.queue, resumeSlots: opts.resumeSlots });
  const app = createEngineHttp(core, { logError: log });
  let preloaded: Awaited<ReturnType<typeof LlamaBackend.preload>> | undefined;
  /** A warm standby's context, made before it waited. */
  let made: LlamaBackend | undefined;
  if (standby) {
    preloaded = await LlamaBackend.preload(backendOptions);
    try {
      if (standby.warm) made = await preloaded.finish();
      await app.ready();
      standby.waiting();
      await standby.go;
      core.mapped = true;
    } catch (err) {
      await (made ?? preloaded).dispose();
      throw err;
    }
  }
  try {
    await app.listen({ host: opts.host, port: opts.port });
  } catch (err) {
    await (made ?? preloaded)?.dispose();
    throw err;
  }
  const { port } = app.server.address() as AddressInfo;
  const url = `http://${opts.host.includes(':') ? `[${opts.host}]` : opts.host}:${port}`;

  const started = performance.now();
  let backend: LlamaBackend | undefined;
  const loaded = (made ? Promise.resolve(made) : preloaded ? preloaded.finish() : LlamaBackend.load(backendOptions)).then((b) => {
    backend = b;
    core.ready(b);
    return { model: opts.modelId, slots: opts.slots, contextSize: b.contextSize, chatTemplate: b.template, loadMs: Math.round(performance.now() - started) };
  });
  loaded.catch(() => undefined); // the caller awaits it; stop() must not raise an unhandled rejection

  let stopping: Promise<void> | undefined;
  const stop = (): Promise<void> =>
    (stopping ??= (async () => {
      core.drain();
      const timer = setTimeout(() => core.abortInFlight(), opts.graceMs);
      // close() ends the connections idle at that moment; a keep-alive connection whose answer
      // finishes later would hold the server open until its keep-alive timeout.
      const sweep = setInterval(() => app.server.closeIdleConnections(), 50);
      try {
        await app.close();
      } finally {
        clearTimeout(timer);
        clearInterval(sweep);
      }
      await loaded.catch(() => undefined); // a load under way completes before its model is freed
      await backend?.dispose();
    })());

  return { url, core, app, loaded, stop };
}
