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
  /** At most one extra registry read per this interval for unknown model ids. */
  missRefreshMs?: number;
  now?: () => number;
  onError?: (err: unknown) => void;
}

export function createModelCatalog(registry: ModelLister, opts: ModelCatalogOptions = {}): ModelCatalog {
  const now = opts.now ?? Date.now;
  const maxAge = opts.maxAgeMs ?? 5_000;
  const missInterval = opts.missRefreshMs ?? 1_000;
  let models: readonly ReadyModel[] = [];
  let byId = new Map<string, ReadyModel>();
  let loadedAt = Number.NEGATIVE_INFINITY;
  let attemptedAt = Number.NEGATIVE_INFINITY;
  let inflight: Promise<void> | undefined;

  const refresh = (): Promise<void> => {
    inflight ??= (async () => {
      attemptedAt = now();
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
      await fresh();
      const m = byId.get(id);
      if (m) return m;
      // A miss waits for a refresh already under way (fresh() may just have started one for a
      // stale catalog): a model published a moment ago must not be reported as unknown.
      if (inflight) {
        await inflight;
        const again = byId.get(id);
        if (again) return again;
      }
      if (now() - attemptedAt < missInterval) return undefined;
      await refresh();
      return byId.get(id);
    },
  };
}
