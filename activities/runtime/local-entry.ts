/**
 * The `local` runtime's entry in the registry (./index.ts): instances are processes on this
 * machine (local.ts), the default `MAGUS_RUNTIME`, with distributed-llama topologies when the
 * `MAGUS_DLLAMA_*` variables name its binaries. The runtime itself, and with it the NATS bridge
 * and the engines' supervision, is loaded only when a worker builds it: every `magus` command
 * reads its configuration through here.
 */
import { accessSync, constants, statSync } from 'node:fs';
import { delimiter, isAbsolute, join, resolve } from 'node:path';
import { distributedFirst, ENGINE_KINDS, formatsLoadedBy, isDistributed, isEngineKind, type EngineKind } from '../../shared/engines';
import { DLLAMA_NODE_COUNTS } from '../size/memory';
import type { RuntimeEntry } from './entry';
import type { StartedStandby } from './launcher';
import type * as LocalModule from './local';

/**
 * `MAGUS_DLLAMA_API_BIN` + `MAGUS_DLLAMA_BIN` (both or neither): the local runtime serves models
 * that have a distributed-llama artifact with a root `dllama-api` and `nodes − 1` `dllama worker`
 * processes on loopback ports.
 */
export interface DllamaConfig {
  /** Absolute path of `dllama-api`. */
  apiBin: string;
  /** Absolute path of `dllama` (run as `dllama worker`). */
  workerBin: string;
  /** Nodes per topology, root included: a power of two (distributed-llama splits by 2^n). */
  nodes: number;
  /** `--nthreads` of every process of a topology. */
  threads: number;
}

/** The local runtime's settings. */
export interface LocalRuntimeConfig {
  /** distributed-llama topologies; unset: llama.cpp only. */
  dllama?: DllamaConfig;
  /** `MAGUS_ENGINES`: the engines it may run, in the order it tries them; unset: every engine it can run, distributed ones first. */
  engines?: EngineKind[];
  /** `MAGUS_ENGINE_STANDBY`: the llama.cpp engine on standby beside each (launcher.ts `standby`); unset: `auto`. */
  standby?: StartedStandby | 'none';
}

/** `MAGUS_ENGINE_STANDBY`: `1` or `auto` (the default), `warm`, `mapped` or `0`. */
function standbyConfig(env: NodeJS.ProcessEnv, problems: string[]): LocalRuntimeConfig['standby'] {
  const text = env.MAGUS_ENGINE_STANDBY?.trim();
  if (text === undefined || text === '' || text === '1' || text === 'auto') return undefined;
  if (text === '0') return 'none';
  if (text === 'warm' || text === 'mapped') return text;
  problems.push(
    `MAGUS_ENGINE_STANDBY=${text} must be auto or 1 (an engine on standby beside each llama.cpp engine, warm when the memory allows: the default), warm, mapped or 0 (none)`,
  );
  return undefined;
}

/**
 * `MAGUS_ENGINES=kind[,kind…]` (shared/engines.ts): which engines instances here run, tried in
 * that order. A distributed engine needs distributed-llama's binaries (`dllama`).
 */
function enginesConfig(env: NodeJS.ProcessEnv, dllama: DllamaConfig | undefined, problems: string[]): EngineKind[] | undefined {
  const text = env.MAGUS_ENGINES?.trim();
  if (!text) return undefined;
  const kinds = text.split(',').map((k) => k.trim());
  const unknown = kinds.filter((k) => !isEngineKind(k));
  if (unknown.length > 0) {
    problems.push(
      `MAGUS_ENGINES=${text}: ${unknown.join(', ')} ${unknown.length > 1 ? 'are not engines' : 'is not an engine'}; the engines are ${ENGINE_KINDS.join(', ')}`,
    );
    return undefined;
  }
  const engines = [...new Set(kinds as EngineKind[])];
  const needsDllama = engines.filter(isDistributed);
  if (needsDllama.length > 0 && !dllama)
    problems.push(`MAGUS_ENGINES lists ${needsDllama.join(', ')}, which needs distributed-llama's binaries: set MAGUS_DLLAMA_API_BIN and MAGUS_DLLAMA_BIN`);
  return engines;
}

/** The engines a local runtime with `config` runs (its advert's), in the order it tries them. */
export function localEngines(config: LocalRuntimeConfig): EngineKind[] {
  const runnable = (k: EngineKind) => !isDistributed(k) || config.dllama !== undefined;
  return (config.engines ?? distributedFirst()).filter(runnable);
}

/** An executable file: a path (relative to the working directory) or a bare name looked up in PATH. */
function executable(name: string, value: string, env: NodeJS.ProcessEnv, problems: string[]): string {
  const isExecutableFile = (p: string): boolean => {
    try {
      accessSync(p, constants.X_OK);
      return statSync(p).isFile();
    } catch {
      return false;
    }
  };
  if (value.includes('/')) {
    const path = isAbsolute(value) ? value : resolve(value);
    if (!isExecutableFile(path)) problems.push(`${name}=${value} is not an executable file`);
    return path;
  }
  const found = (env.PATH ?? '')
    .split(delimiter)
    .filter(Boolean)
    .map((dir) => join(dir, value))
    .find(isExecutableFile);
  if (!found) problems.push(`${name}=${value} is not an executable file in PATH`);
  return found ?? value;
}

function dllamaConfig(env: NodeJS.ProcessEnv, problems: string[]): DllamaConfig | undefined {
  const apiBin = env.MAGUS_DLLAMA_API_BIN?.trim();
  const workerBin = env.MAGUS_DLLAMA_BIN?.trim();
  const nodesText = env.MAGUS_DLLAMA_NODES?.trim();
  const threadsText = env.MAGUS_DLLAMA_THREADS?.trim();
  if (!apiBin && !workerBin) {
    const stray = [nodesText && 'MAGUS_DLLAMA_NODES', threadsText && 'MAGUS_DLLAMA_THREADS'].filter(Boolean);
    if (stray.length > 0)
      problems.push(
        `${stray.join(' and ')} ${stray.length > 1 ? 'are' : 'is'} set, but distributed-llama is off: set MAGUS_DLLAMA_API_BIN and MAGUS_DLLAMA_BIN`,
      );
    return undefined;
  }
  if (!apiBin || !workerBin) {
    problems.push(
      `distributed-llama needs both MAGUS_DLLAMA_API_BIN (dllama-api) and MAGUS_DLLAMA_BIN (dllama); only ${apiBin ? 'MAGUS_DLLAMA_API_BIN' : 'MAGUS_DLLAMA_BIN'} is set`,
    );
    return undefined;
  }
  const nodes = Number(nodesText ?? '2');
  if (!(DLLAMA_NODE_COUNTS as readonly number[]).includes(nodes)) {
    problems.push(
      `MAGUS_DLLAMA_NODES=${nodesText} must be a power of two from 1 to 16 (the root plus 2^n − 1 workers): one of ${DLLAMA_NODE_COUNTS.join(', ')}`,
    );
  }
  const threads = Number(threadsText ?? '1');
  if (!Number.isInteger(threads) || threads < 1 || threads > 256) problems.push(`MAGUS_DLLAMA_THREADS=${threadsText} must be 1..256`);
  return {
    apiBin: executable('MAGUS_DLLAMA_API_BIN', apiBin, env, problems),
    workerBin: executable('MAGUS_DLLAMA_BIN', workerBin, env, problems),
    nodes,
    threads,
  };
}

/** Processes on this machine (local.ts), children of the worker that started them. */
export const local: RuntimeEntry<LocalRuntimeConfig> = {
  kind: 'local',
  ownsInstances: true,
  settingsFrom: (env, problems) => {
    const dllama = dllamaConfig(env, problems);
    const engines = enginesConfig(env, dllama, problems);
    const standby = standbyConfig(env, problems);
    return { ...(dllama ? { dllama } : {}), ...(engines ? { engines } : {}), ...(standby ? { standby } : {}) };
  },
  // Checked on a worker of another runtime too: a bad MAGUS_DLLAMA_* value is reported, not ignored.
  unselected: (env, problems) => void dllamaConfig(env, problems),
  create: (config, { s3, modelCacheDir, instanceMemory }, deps) => {
    const { dllama } = config;
    // eslint-disable-next-line @typescript-eslint/no-require-imports -- loaded only by a worker that runs it (the file's comment)
    const { LocalRuntime } = require('./local') as typeof LocalModule;
    return new LocalRuntime({
      nc: deps.nc,
      names: deps.names,
      registry: deps.registry,
      s3: deps.s3,
      bucket: s3.bucket,
      cacheDir: modelCacheDir,
      dllama,
      engines: localEngines(config),
      ...(config.standby !== 'none' ? { standby: config.standby ?? 'auto' } : {}),
      ...(instanceMemory ? { instanceMemory } : {}),
      log: deps.log,
    });
  },
  advert: (config) => {
    const engines = localEngines(config);
    const distributed = engines.some(isDistributed);
    return {
      formats: formatsLoadedBy(engines),
      engines,
      ...(distributed && config.dllama ? { dllamaNodes: config.dllama.nodes } : {}),
    };
  },
};
