/**
 * The `Session` mirror: live conversations, read from the `magus_sessions` bucket (the hot
 * path's own record of conversation → instance, with expiry), shown as read-only `Session`
 * resources so that `kubectl get sessions -A` tells who is being served.
 *
 * Bounded so it can never flood etcd: at most `cap` Sessions exist at once (the ones renewed
 * last), changes are applied at most once per `intervalMs`, and a Session's status is rewritten
 * only when its instance or expiry changed. Bounded in memory too: of the bucket's entries it
 * holds only the 2 × `cap` renewed last (the shown ones, and those next in line when one ends),
 * however many conversations live. A Session is named after its model and the first
 * hex digits of the conversation key (an HMAC: it reveals nothing of the conversation).
 */
import { CustomObjectsApi, PatchStrategy, setHeaderOptions, type KubeConfig } from '@kubernetes/client-node';
import type { KV, KvEntry } from 'nats';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';
import { FieldManager, Kind, Plural } from '../shared/kube';
import { conversationOf, type SessionEntry } from '../shared/serving';

/** Label on every mirrored Session (the mirror lists and prunes by it). */
export const MIRROR_LABEL = 'magus.dev/mirror';
const applyHeaders = setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply);
const api = `${CRD_GROUP}/${CRD_VERSION}`;

export interface SessionMirrorOptions {
  kc: KubeConfig;
  /** The `magus_sessions` bucket. */
  kv: KV;
  /** Most Sessions mirrored at once. */
  cap: number;
  /** Only conversations of models in these namespaces (default or empty: all). */
  namespaces?: readonly string[];
  intervalMs?: number;
  log?: (line: string) => void;
}

export interface SessionMirror {
  /** `overCap`: live conversations not shown for the cap, among those held (at most `cap` more are held: a lower bound). */
  readonly stats: { mirrored: number; writes: number; deletes: number; overCap: number; held: number };
  /** Resolves after the next complete pass (tests wait on it). */
  settled(): Promise<void>;
  /** Resolves once the watch has read every entry the bucket held when it started (`bench:sessions` waits on it). */
  readonly replayed: Promise<void>;
  stop(): Promise<void>;
}

/** `<model>-<10 hex>`: a DNS label that names the model and not the conversation (the key's last token: keys carry their pool). */
export const sessionName = (entry: SessionEntry, key: string): string =>
  `${entry.pool.slice(0, 52).replace(/-+$/, '')}-${conversationOf(key).slice(0, 10).toLowerCase()}`;

interface Shown {
  namespace: string;
  name: string;
  status: string;
}

const code = (err: unknown): number | undefined => (err as { code?: number }).code;

export function startSessionMirror(opts: SessionMirrorOptions): SessionMirror {
  const custom = opts.kc.makeApiClient(CustomObjectsApi);
  const log = opts.log ?? (() => undefined);
  const intervalMs = opts.intervalMs ?? 1000;
  /** The candidates: the entries renewed last, at most {@link held} (a full bucket is never copied). */
  const entries = new Map<string, SessionEntry>();
  const held = Math.max(1, opts.cap * 2);
  const wantedNamespace = (e: SessionEntry) => !opts.namespaces?.length || opts.namespaces.includes(e.namespace ?? 'default');
  /** Keeps `v` if it is among the {@link held} renewed last, dropping the one renewed first to make room. */
  const consider = (key: string, v: SessionEntry) => {
    if (entries.has(key) || entries.size < held) return void entries.set(key, v);
    let first: [string, number] | undefined;
    for (const [k, e] of entries) if (!first || e.expiresAt < first[1]) first = [k, e.expiresAt];
    if (first && v.expiresAt > first[1]) {
      entries.delete(first[0]);
      entries.set(key, v);
    }
  };
  const shown = new Map<string, Shown>(); // key `<ns>/<name>` → what the API holds
  const stats = { mirrored: 0, writes: 0, deletes: 0, overCap: 0, held: 0 };
  let stopped = false;
  const waiters: (() => void)[] = [];
  const stopping: (() => void)[] = [];

  const decode = (e: KvEntry): SessionEntry | undefined => {
    try {
      const v = JSON.parse(new TextDecoder().decode(e.value)) as SessionEntry;
      return typeof v.pool === 'string' && typeof v.instance === 'string' && typeof v.expiresAt === 'number' ? v : undefined;
    } catch {
      return undefined;
    }
  };

  let replayedNow: () => void = () => undefined;
  const replayed = new Promise<void>((r) => (replayedNow = r));
  const watching = (async () => {
    const iter = await opts.kv.watch({ key: '>', initializedFn: () => replayedNow() });
    const stopWatch = () => iter.stop();
    stopping.push(stopWatch);
    for await (const e of iter) {
      const v = e.operation === 'PUT' ? decode(e) : undefined;
      if (v && wantedNamespace(v)) consider(e.key, v);
      else entries.delete(e.key);
      stats.held = entries.size;
    }
  })().catch((err: unknown) => log(`sessions: watch ended: ${(err as Error).message}`));

  async function listShown(): Promise<void> {
    const namespaces = opts.namespaces ?? [];
    const selector = { group: CRD_GROUP, version: CRD_VERSION, plural: Plural.session, labelSelector: `${MIRROR_LABEL}=true` };
    type Listed = { items: { metadata: { name: string; namespace: string }; status?: unknown }[] };
    const lists = (
      namespaces.length > 0
        ? await Promise.all(namespaces.map((namespace) => custom.listNamespacedCustomObject({ ...selector, namespace })))
        : [await custom.listClusterCustomObject(selector)]
    ) as Listed[];
    const list = { items: lists.flatMap((l) => l.items) };
    for (const o of list.items)
      shown.set(`${o.metadata.namespace}/${o.metadata.name}`, {
        namespace: o.metadata.namespace,
        name: o.metadata.name,
        status: JSON.stringify(o.status ?? {}),
      });
  }

  async function pass(): Promise<void> {
    const now = Date.now();
    const live = [...entries].filter(([, e]) => e.expiresAt > now).sort((a, b) => b[1].expiresAt - a[1].expiresAt);
    stats.overCap = Math.max(0, live.length - opts.cap);
    const wanted = new Map<string, { ns: string; name: string; entry: SessionEntry }>();
    for (const [key, entry] of live.slice(0, opts.cap)) {
      const ns = entry.namespace ?? 'default';
      const name = sessionName(entry, key);
      wanted.set(`${ns}/${name}`, { ns, name, entry });
    }
    for (const [id, s] of shown) {
      if (wanted.has(id)) continue;
      try {
        await custom.deleteNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: s.namespace, plural: Plural.session, name: s.name });
        stats.deletes++;
      } catch (err) {
        if (code(err) !== 404) throw err;
      }
      shown.delete(id);
    }
    for (const [id, w] of wanted) {
      const status = { instance: w.entry.instance, expiresAt: new Date(w.entry.expiresAt).toISOString().replace(/\.\d{3}Z$/, 'Z') };
      const text = JSON.stringify(status);
      const before = shown.get(id);
      if (before?.status === text) continue;
      const ref = {
        group: CRD_GROUP,
        version: CRD_VERSION,
        namespace: w.ns,
        plural: Plural.session,
        name: w.name,
        fieldManager: FieldManager.controller,
        force: true,
      };
      try {
        if (!before) {
          const body = {
            apiVersion: api,
            kind: Kind.session,
            metadata: { name: w.name, namespace: w.ns, labels: { [MIRROR_LABEL]: 'true' } },
            spec: { pool: w.entry.pool, model: w.entry.pool },
          };
          await custom.patchNamespacedCustomObject({ ...ref, body }, applyHeaders);
          stats.writes++;
        }
        await custom.patchNamespacedCustomObjectStatus(
          { ...ref, body: { apiVersion: api, kind: Kind.session, metadata: { name: w.name, namespace: w.ns }, status } },
          applyHeaders,
        );
        stats.writes++;
        shown.set(id, { namespace: w.ns, name: w.name, status: text });
      } catch (err) {
        // A namespace that does not exist (a model served outside any cluster namespace) is skipped.
        if (code(err) !== 404) throw err;
      }
    }
    stats.mirrored = shown.size;
  }

  const loop = (async () => {
    let listed = false;
    while (!stopped) {
      try {
        if (!listed) {
          await listShown();
          listed = true;
        }
        await pass();
      } catch (err) {
        log(`sessions: ${(err as Error).message}`);
        listed = false; // relist: what the API holds is uncertain after a failure
      }
      for (const w of waiters.splice(0)) w();
      await new Promise((r) => setTimeout(r, intervalMs));
    }
  })();

  return {
    stats,
    replayed,
    settled: () =>
      new Promise<void>((r) => {
        // Two passes: the one running may have started before the caller's change.
        let n = 0;
        const again = () => (++n >= 2 ? r() : waiters.push(again));
        waiters.push(again);
      }),
    async stop() {
      stopped = true;
      for (const s of stopping) s();
      for (const w of waiters.splice(0)) w();
      await Promise.all([loop, watching]);
    },
  };
}
