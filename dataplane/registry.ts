/**
 * The model registry: ready models in the JetStream KV bucket `magus_models`, keyed
 * `<namespace>.<name>`. The pipeline writes it; the gateway lists models from it. Beside the
 * models, each worker advertises what its runtime can serve under `_runtime.<worker>`
 * (shared/runtimes.ts; `_` starts no namespace, a DNS label), so the gateway learns it with the
 * same read.
 */
import { type KV, type NatsConnection } from 'nats';
import { Nats } from '../shared/constants';
import type { ReadyModel } from '../shared/model';
import type { RuntimeAdvert } from '../shared/runtimes';

const codec = {
  encode: (m: ReadyModel) => new TextEncoder().encode(JSON.stringify(m)),
  decode: (b: Uint8Array) => JSON.parse(new TextDecoder().decode(b)) as ReadyModel,
};

/** KV keys allow `[-/_=.a-zA-Z0-9]`; namespaces and names are DNS labels, so `.` separates them. */
export const registryKey = (namespace: string, name: string): string => `${namespace}.${name}`;

const RUNTIME_KEY_PREFIX = '_runtime.';
/** KV keys allow `[-/_=.a-zA-Z0-9]`: anything else in a worker id becomes `_`. */
const runtimeKey = (worker: string): string => `${RUNTIME_KEY_PREFIX}${worker.replace(/[^-/_=.a-zA-Z0-9]/g, '_')}`;

export interface ModelRegistry {
  put(model: ReadyModel): Promise<void>;
  get(namespace: string, name: string): Promise<ReadyModel | null>;
  list(): Promise<ReadyModel[]>;
  remove(namespace: string, name: string): Promise<void>;
  /** Writes (or refreshes) a worker's runtime advert. */
  advertiseRuntime(advert: RuntimeAdvert): Promise<void>;
  /** Deletes a worker's runtime advert (a worker that stops). */
  withdrawRuntime(worker: string): Promise<void>;
  /** One worker's runtime advert; null when it has none (never written, or withdrawn). */
  runtimeAdvert(worker: string): Promise<RuntimeAdvert | null>;
  /** The ready models and the runtime adverts, in one pass over the bucket. */
  read(): Promise<{ models: ReadyModel[]; runtimes: RuntimeAdvert[] }>;
}

/** Revisions the registry bucket keeps of each key (also how declare.ts declares it). */
export const REGISTRY_HISTORY = 5;

/**
 * Opens (creating if needed, with one replica) the registry bucket. `bucket` is overridable for
 * test isolation. `ensureDataPlane` declares it too, with the data plane's replicas: on a cluster
 * it brings a bucket created here to them.
 */
export async function openModelRegistry(nc: NatsConnection, bucket: string = Nats.modelsBucket): Promise<ModelRegistry> {
  const kv: KV = await nc.jetstream().views.kv(bucket, { history: REGISTRY_HISTORY });
  const read = async (): Promise<{ models: ReadyModel[]; runtimes: RuntimeAdvert[] }> => {
    // Keys first, then values: awaiting a get inside the keys() iterator makes nats.js drop
    // the keys still queued, and the list would stop at the first model.
    const keys: string[] = [];
    for await (const key of await kv.keys()) keys.push(key);
    const models: ReadyModel[] = [];
    const runtimes: RuntimeAdvert[] = [];
    for (const key of keys) {
      const e = await kv.get(key);
      if (!e || e.operation !== 'PUT' || e.value.length === 0) continue;
      if (key.startsWith(RUNTIME_KEY_PREFIX)) runtimes.push(JSON.parse(new TextDecoder().decode(e.value)) as RuntimeAdvert);
      else models.push(codec.decode(e.value));
    }
    return { models: models.sort((a, b) => registryKey(a.namespace, a.name).localeCompare(registryKey(b.namespace, b.name))), runtimes };
  };
  return {
    async put(model) {
      await kv.put(registryKey(model.namespace, model.name), codec.encode(model));
    },
    async get(namespace, name) {
      const e = await kv.get(registryKey(namespace, name));
      return e && e.operation === 'PUT' && e.value.length > 0 ? codec.decode(e.value) : null;
    },
    async list() {
      return (await read()).models;
    },
    read,
    async advertiseRuntime(advert) {
      await kv.put(runtimeKey(advert.worker), new TextEncoder().encode(JSON.stringify(advert)));
    },
    async withdrawRuntime(worker) {
      await kv.delete(runtimeKey(worker));
    },
    async runtimeAdvert(worker) {
      const e = await kv.get(runtimeKey(worker));
      return e && e.operation === 'PUT' && e.value.length > 0 ? (JSON.parse(new TextDecoder().decode(e.value)) as RuntimeAdvert) : null;
    },
    async remove(namespace, name) {
      await kv.delete(registryKey(namespace, name));
    },
  };
}
