/**
 * The models the gateway serves, from the model registry (`magus_models`, activities/nats/registry)
 * cached in memory: a request looks a model up in a `Map`; the registry is re-read in the
 * background when the copy is older than `maxAgeMs`, and at once (rate-limited) when a request
 * names a model the copy does not know, so a model that just became ready is found immediately.
 *
 * OpenAI model ids are the registry `name`; `namespace/name` also resolves. When two namespaces
 * hold the same name, the bare name means the first in registry order (`namespace.name`).
 */
import type { ReadyModel } from '../../shared/model';

/** What the catalog needs from the registry (`ModelRegistry` has it). */
export interface ModelLister {
  list(): Promise<ReadyModel[]>;
}

export interface ModelCatalog {
  find(id: string): Promise<ReadyModel | undefined>;
  list(): Promise<readonly ReadyModel[]>;
  /** Re-reads the registry now (readiness checks use it). */
  refresh(): Promise<void>;
}

export interface ModelCatalogOptions {
  maxAgeMs?: number;
  now?: () => number;
  onError?: (err: unknown) => void;
}

export function createModelCatalog(registry: ModelLister, opts: ModelCatalogOptions = {}): ModelCatalog {
  const now = opts.now ?? Date.now;
  const maxAge = opts.maxAgeMs ?? 5_000;
  let models: readonly ReadyModel[] = [];
  let byId = new Map<string, ReadyModel>();
  let loadedAt = Number.NEGATIVE_INFINITY;
  /** Registry reads started so far: a miss is answered only from a read that began after it arrived. */
  let readsStarted = 0;
  let inflight: Promise<void> | undefined;

  const refresh = (): Promise<void> => {
    inflight ??= (async () => {
      readsStarted++;
      try {
        const list = await registry.list();
        const next = new Map<string, ReadyModel>();
        for (const m of list) {
          next.set(`${m.namespace}/${m.name}`, m);
          if (!next.has(m.name)) next.set(m.name, m);
        }
        models = list;
        byId = next;
        loadedAt = now();
      } finally {
        inflight = undefined;
      }
    })();
    return inflight;
  };

  const fresh = async (): Promise<void> => {
    if (loadedAt === Number.NEGATIVE_INFINITY) return refresh();
    if (now() - loadedAt > maxAge && !inflight) refresh().catch((err: unknown) => opts.onError?.(err));
  };

  return {
    refresh,
    async list() {
      await fresh();
      return models;
    },
    async find(id) {
      const readsBefore = readsStarted;
      await fresh();
      const m = byId.get(id);
      if (m) return m;
      // Unknown here: answer from a registry read that began after this request arrived (one
      // fresh() may just have started), so a model published a moment ago is never reported as
      // unknown. Concurrent misses share that read.
      if (readsStarted > readsBefore && inflight) await inflight;
      else if (readsStarted === readsBefore) await refresh();
      return byId.get(id);
    },
  };
}
