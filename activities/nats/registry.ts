/**
 * The model registry: ready models in the JetStream KV bucket `magus_models`, keyed
 * `<namespace>.<name>`. The pipeline writes it; the gateway lists models from it.
 */
import { type KV, type NatsConnection } from 'nats';
import { Nats } from '../../shared/constants';
import type { ReadyModel } from '../../shared/model';

const codec = { encode: (m: ReadyModel) => new TextEncoder().encode(JSON.stringify(m)), decode: (b: Uint8Array) => JSON.parse(new TextDecoder().decode(b)) as ReadyModel };

/** KV keys allow `[-/_=.a-zA-Z0-9]`; namespaces and names are DNS labels, so `.` separates them. */
export const registryKey = (namespace: string, name: string): string => `${namespace}.${name}`;

export interface ModelRegistry {
  put(model: ReadyModel): Promise<void>;
  get(namespace: string, name: string): Promise<ReadyModel | null>;
  list(): Promise<ReadyModel[]>;
  remove(namespace: string, name: string): Promise<void>;
}

/** Opens (creating if needed) the registry bucket. `bucket` is overridable for test isolation. */
export async function openModelRegistry(nc: NatsConnection, bucket: string = Nats.modelsBucket): Promise<ModelRegistry> {
  const kv: KV = await nc.jetstream().views.kv(bucket, { history: 5 });
  return {
    async put(model) {
      await kv.put(registryKey(model.namespace, model.name), codec.encode(model));
    },
    async get(namespace, name) {
      const e = await kv.get(registryKey(namespace, name));
      return e && e.operation === 'PUT' && e.value.length > 0 ? codec.decode(e.value) : null;
    },
    async list() {
      // Keys first, then values: awaiting a get inside the keys() iterator makes nats.js drop
      // the keys still queued, and the list would stop at the first model.
      const keys: string[] = [];
      for await (const key of await kv.keys()) keys.push(key);
      const out: ReadyModel[] = [];
      for (const key of keys) {
        const e = await kv.get(key);
        if (e && e.operation === 'PUT' && e.value.length > 0) out.push(codec.decode(e.value));
      }
      return out.sort((a, b) => registryKey(a.namespace, a.name).localeCompare(registryKey(b.namespace, b.name)));
    },
    async remove(namespace, name) {
      await kv.delete(registryKey(namespace, name));
    },
  };
}
