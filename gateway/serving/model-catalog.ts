/**
 * The models the gateway serves, from the model registry (`magus_models`, dataplane/registry)
 * cached in memory: a request looks a model up in a `Map`; the registry is re-read in the
 * background when the copy is older than `maxAgeMs`, and at once (rate-limited) when a request
 * names a model the copy does not know, so a model that just became ready is found immediately.
 *
 * `list()` and `lookup()` (`GET /v1/models[/:model]`) always answer from a registry read that began
 * after they were called, so the list and the item agree at all times (a list served from the
 * copy missed a model published within the last `maxAgeMs` that the item already found);
 * `find()` (the chat path) answers from the copy.
 *
 * The same read brings the workers' runtime adverts (shared/runtimes.ts): `unservable(model)`
 * says, from memory, why no live runtime can serve a model.
 *
 * OpenAI model ids are the registry `name`; `namespace/name` also resolves. When two namespaces
 * hold the same name, the bare name means the first in registry order (`namespace.name`) that the
 * caller may use (`find` and `lookup` take the caller's check), so a key confined to its own
 * namespace reaches its namespace's model, never a 404 for another namespace's.
 */
import type { ReadyModel } from '../../shared/model';
import type { EngineKind } from '../../shared/engines';
import { modelEngines, unservableReason, type RuntimeAdvert } from '../../shared/runtimes';

/** What the catalog needs from the registry (`ModelRegistry` has it; `read` adds the runtime adverts). */
export interface ModelLister {
  list(): Promise<ReadyModel[]>;
  read?(): Promise<{ models: ReadyModel[]; runtimes: RuntimeAdvert[] }>;
}

/** Whether the caller may use a model (plugins/auth.ts `mayUse` for one principal). */
export type ModelAccess = (namespace: string, name: string) => boolean;

export interface ModelCatalog {
  /** From the copy (the chat path): re-reads only when the id is unknown (to `may`). */
  find(id: string, may?: ModelAccess): Promise<ReadyModel | undefined>;
  /** From a registry read that began after the call. */
  lookup(id: string, may?: ModelAccess): Promise<ReadyModel | undefined>;
  /** From a registry read that began after the call. */
  list(): Promise<readonly ReadyModel[]>;
  /** Why no live runtime can serve `model` (from the copy), or undefined when one can or nothing is known. */
  unservable(model: ReadyModel): string | undefined;
  /** The engines `model`'s instances may run on (from the copy; shared/runtimes.ts `modelEngines`). */
  engines(model: ReadyModel): EngineKind[];
  /** Re-reads the registry now (readiness checks use it). */
  refresh(): Promise<void>;
  /**
   * Stops waiting for the read in flight: the next caller starts a new one. After a reconnect,
   * since a read sent while the connection was down waits out its whole timeout (5 s) for an
   * answer the new server will never send. Callers of the old read still get its outcome.
   */
  forgetInflight(): void;
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
  /** `namespace/name` → the model, and a bare `name` → every namespace's, in registry order. */
  let byId = new Map<string, ReadyModel[]>();
  let runtimes: readonly RuntimeAdvert[] = [];
  let loadedAt = Number.NEGATIVE_INFINITY;
  /** Registry reads started so far: a miss is answered only from a read that began after it arrived. */
  let readsStarted = 0;
  let inflight: Promise<void> | undefined;
  /** The read whose list is in `models`. */
  let appliedRead = 0;

  const refresh = (): Promise<void> => {
    if (inflight) return inflight;
    const seq = ++readsStarted;
    const read = (async () => {
      const { models: list, runtimes: adverts } = registry.read ? await registry.read() : { models: await registry.list(), runtimes: [] };
      if (seq < appliedRead) return; // a forgotten read that ended after a newer one
      appliedRead = seq;
      runtimes = adverts;
      const next = new Map<string, ReadyModel[]>();
      for (const m of list) {
        next.set(`${m.namespace}/${m.name}`, [m]);
        const same = next.get(m.name);
        if (same) same.push(m);
        else next.set(m.name, [m]);
      }
      models = list;
      byId = next;
      loadedAt = now();
    })();
    inflight = read;
    const settled = () => {
      if (inflight === read) inflight = undefined;
    };
    read.then(settled, settled);
    return read;
  };

  const fresh = async (): Promise<void> => {
    if (loadedAt === Number.NEGATIVE_INFINITY) return refresh();
    if (now() - loadedAt > maxAge && !inflight) refresh().catch((err: unknown) => opts.onError?.(err));
  };

  /** Waits for a registry read that began after the call; concurrent callers share one. */
  const current = async (): Promise<void> => {
    const arrived = readsStarted;
    for (;;) {
      if (!inflight) return refresh();
      if (readsStarted > arrived) return inflight;
      await inflight.catch(() => undefined); // began before the call: wait it out, then read anew
    }
  };

  const pick = (id: string, may: ModelAccess | undefined): ReadyModel | undefined => {
    const candidates = byId.get(id);
    return may ? candidates?.find((m) => may(m.namespace, m.name)) : candidates?.[0];
  };

  return {
    refresh,
    forgetInflight: () => void (inflight = undefined),
    async list() {
      await current();
      return models;
    },
    async lookup(id, may) {
      await current();
      return pick(id, may);
    },
    // Adverts judged as of the read that brought them: a copy read a while ago (no request since)
    // would otherwise hold only stale adverts, and a model nothing can run pass as servable.
    unservable: (model) => unservableReason(model, runtimes, loadedAt) ?? undefined,
    engines: (model) => modelEngines(model, runtimes, loadedAt),
    async find(id, may) {
      const readsBefore = readsStarted;
      await fresh();
      const m = pick(id, may);
      if (m) return m;
      // Unknown here: answer from a registry read that began after this request arrived (one
      // fresh() may just have started), so a model published a moment ago is never reported as
      // unknown. Concurrent misses share that read.
      if (readsStarted > readsBefore && inflight) await inflight;
      else if (readsStarted === readsBefore) await refresh();
      return pick(id, may);
    },
  };
}
