/**
 * The local runtime's instances that serve, by id (`<pool>/<instance>`): an instance is in the
 * table only once its start completed without being aborted, and leaves it before it is torn down,
 * so `describe` and `processes` never answer for one that is stopping.
 */
import type { Bridge, BridgeSample } from '../../dataplane/bridge';
import type { EngineKind } from '../../shared/engines';
import type { LocalServing } from './engines';
import type { InstanceInfo } from './runtime';

/** What serves an instance's requests, and which engine it is. */
export interface Serving {
  kind: EngineKind;
  engine: LocalServing;
  /** The model revision it loaded (shared/model.ts `modelRevision`). */
  revision: string;
}

export interface LocalInstance {
  pool: string;
  info: Omit<InstanceInfo, 'healthy'>;
  serving: Serving;
  bridge: Bridge;
}

/** One process of an instance, as `LocalRuntime.processes` reports it. */
export interface LocalProcessInfo {
  /** `engine` (llama.cpp), or the `root`/`worker`s of a distributed-llama topology. */
  role: 'engine' | 'root' | 'worker';
  /** 0 for an engine or root; workers 1..n-1 in the root's `--workers` order. */
  index: number;
  pid: number | undefined;
  /** Loopback port it serves on (HTTP for an engine or root, distributed-llama's protocol for a worker). */
  port: number;
  /** Program and arguments. */
  argv: readonly string[];
  running: boolean;
}

/** The id of an instance in the runtime's tables. */
export const instanceKey = (pool: string, instance: string): string => `${pool}/${instance}`;

export class InstanceTable {
  private readonly byKey = new Map<string, LocalInstance>();

  get(key: string): LocalInstance | undefined {
    return this.byKey.get(key);
  }

  add(i: LocalInstance): void {
    this.byKey.set(instanceKey(i.pool, i.info.instance), i);
  }

  /** Removes the instance and returns it (to be torn down), if there was one. */
  take(key: string): LocalInstance | undefined {
    const i = this.byKey.get(key);
    this.byKey.delete(key);
    return i;
  }

  all(): LocalInstance[] {
    return [...this.byKey.values()];
  }

  /** The instance as callers see it, healthy while its engine is. */
  static info(i: LocalInstance): InstanceInfo {
    return { ...i.info, healthy: i.serving.engine.healthy(), restarts: i.serving.engine.restarts() };
  }

  static processes(i: LocalInstance): LocalProcessInfo[] {
    return i.serving.engine.processes.map((p) => ({
      role: p.role,
      index: p.index,
      pid: p.process.child.pid,
      port: p.port,
      argv: p.process.argv,
      running: !p.process.exit,
    }));
  }

  static bridge(i: LocalInstance): BridgeSample {
    return { pool: i.pool, instance: i.info.instance, stats: i.bridge.stats, health: i.bridge.health() };
  }

  /** Stops the instance's bridge, then its processes. */
  static async teardown(i: LocalInstance): Promise<void> {
    await i.bridge.stop();
    await i.serving.engine.stop();
  }
}
