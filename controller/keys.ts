/**
 * API keys, from the cluster into `magus_tokens` (dataplane/keys.ts: an id is registered once).
 *
 * - An `ApiKey` (crds/apikey.yaml) is a key of identity `<namespace>/<name>`: its Secret's token
 *   is registered under the token's id with the key's uid, its models resolved (a bare name and
 *   `*` mean its own namespace; another namespace only where that namespace is among
 *   `sharedModelNamespaces`), its `spec.limits` copied into the entry (checked against
 *   `KeyLimits`: limits it cannot hold are refused with reason `LimitsInvalid`, nothing
 *   registered), its status written (Ready, the reason, the registered `tokenId`).
 *   A token id another key holds is refused — condition Ready=False, reason `IdConflict`, naming
 *   the holder when it is in the same namespace and "a key in another namespace" otherwise — and
 *   nothing is written over. A key's earlier id (a rotated token) is deleted after the new one is
 *   registered and before the status says so: a restart in between finds it in the status.
 * - A Secret labelled `magus.dev/api-token=true` (how keys were declared before `ApiKey`; kept
 *   until the next release) is a key of identity `<namespace>/<secret name>`, confined to its
 *   namespace's models like an ApiKey, with no limits; one that an ApiKey names is that ApiKey's.
 * - After every (re)list, entries of keys that are gone (an ApiKey or Secret no longer there, or
 *   a Secret whose token changed while no controller ran) are deleted — only in the namespaces
 *   this controller watches, and only the controller's own (origin `apikey/` or `secret/`).
 *
 * Every write is by compare-and-swap on the owner, so what a second controller replica or a
 * `magus keys` CLI does at the same time never overwrites a key.
 */
import type { CoreV1Api, CustomObjectsApi, KubeConfig } from '@kubernetes/client-node';
import { PatchStrategy, setHeaderOptions } from '@kubernetes/client-node';
import type { KV } from 'nats';
import { mergeConditions } from '../kube/status';
import { watchNamespaces, type ResourceWatch } from '../kube/watch';
import {
  conflictMessage,
  describeKeyLimits,
  entryLimits,
  listKeys,
  registerKey,
  TOKEN_PATTERN,
  tokenDigest,
  unregisterKey,
  type KeyOwnerRef,
} from '../dataplane/keys';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';
import {
  API_KEY_SECRET_LABEL,
  ApiKeyCondition,
  ApiKeyReason,
  FieldManager,
  Kind,
  Plural,
  TOKEN_SECRET_LABEL,
  type ApiKeyResource,
  type ApiKeyResourceStatus,
  type Condition,
} from '../shared/kube';
import type { TokenEntry } from '../shared/serving';
import { WorkQueue, type Requeue } from './queue';

/** How often every ApiKey is looked at again (a rotated Secret without the label is seen then). */
export const KEY_RESYNC_MS = 5 * 60_000;
const APIKEY_ORIGIN = 'apikey/';
const SECRET_ORIGIN = 'secret/';
const applyHeaders = setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply);

interface SecretObject {
  metadata?: { name?: string; namespace?: string; uid?: string; labels?: Record<string, string> };
  data?: Record<string, string>;
}

export interface KeysOptions {
  kc: KubeConfig;
  core: CoreV1Api;
  custom: CustomObjectsApi;
  kv: KV;
  /** Only these namespaces, one watch each (default or empty: all). */
  namespaces?: readonly string[];
  /** Namespaces whose models keys of any namespace may name (`ns/name`, `ns/*`). */
  sharedModelNamespaces?: readonly string[];
  backoff?: { initialMs: number; maxMs: number };
  log: (line: string) => void;
}

export interface KeysMetrics {
  tokensWritten: number;
  tokensRemoved: number;
  tokenConflicts: number;
}

export interface Keys {
  watches: Record<string, ResourceWatch<unknown>>;
  metrics: KeysMetrics;
  /** Nothing queued or running. */
  drained(): Promise<void>;
  stop(): Promise<void>;
}

/** Model `m` as `namespace/name`: a bare name is one of namespace `ns`. */
const qualifiedModel = (ns: string, m: string): string => (m.includes('/') ? m : `${ns}/${m}`);

/**
 * The models a key of namespace `ns` may use, as the gateway applies them (`ns/name`, `ns/*`),
 * and those it named in another namespace that does not share them (`refused`). Absent or empty:
 * every model of `ns`.
 */
export function resolveKeyModels(ns: string, models: readonly string[] | undefined, shared: readonly string[]): { models: string[]; refused: string[] } {
  if (!models || models.length === 0) return { models: [`${ns}/*`], refused: [] };
  const out: string[] = [];
  const refused: string[] = [];
  for (const m of models) {
    const full = qualifiedModel(ns, m);
    const where = full.slice(0, full.indexOf('/'));
    if (where !== ns && !shared.includes(where)) refused.push(m);
    else if (!out.includes(full)) out.push(full);
  }
  return { models: out, refused };
}

/**
 * `spec.limits` with the models of `limits.models` named as the gateway serves them: a bare name
 * is a Model of `ns`. Anything else is left for `entryLimits` to judge; a model named twice (`llama`
 * and `<ns>/llama`) is an error.
 */
export function resolveLimitModels(ns: string, limits: unknown): { limits: unknown } | { error: string } {
  const models = (limits as { models?: unknown } | null | undefined)?.models;
  if (typeof models !== 'object' || models === null || Array.isArray(models)) return { limits };
  const out: Record<string, unknown> = {};
  for (const [m, l] of Object.entries(models)) {
    const full = qualifiedModel(ns, m);
    if (Object.prototype.hasOwnProperty.call(out, full)) return { error: `spec.limits.models names ${full} twice` };
    out[full] = l;
  }
  return { limits: { ...(limits as object), models: out } };
}

/** Why `refused` models cannot be a key's. */
function notShared(refused: readonly string[], shared: readonly string[]): string {
  const sharing =
    shared.length > 0
      ? `the namespaces that share their models are ${shared.join(', ')}`
      : 'no namespace shares its models (magus controller --shared-model-namespaces)';
  return `models ${refused.join(', ')} are in another namespace, and ${sharing}`;
}

const decodeField = (s: SecretObject, k: string): string | undefined => {
  const v = s.data?.[k];
  return v !== undefined ? Buffer.from(v, 'base64').toString('utf8').trim() : undefined;
};

/** The token in `key` of a Secret: its id and digest, or why it has none. */
export function tokenOf(s: SecretObject, key: string): { id: string; digest: string } | { error: string } {
  const where = `${s.metadata?.namespace}/${s.metadata?.name}`;
  const token = decodeField(s, key);
  if (!token) return { error: `Secret ${where} has no '${key}' key` };
  const m = TOKEN_PATTERN.exec(token);
  if (!m)
    return {
      error: `Secret ${where}: '${key}' is not of the form mgs_<id>_<secret> (<id>: 1-64 letters, digits or '-'; <secret>: letters, digits, '_' or '-')`,
    };
  return { id: m[1]!, digest: tokenDigest(token) };
}

const inNamespace = (ns: string) => (key: string) => key.startsWith(`${ns}/`);
const errCode = (err: unknown): number | undefined => (err as { code?: number }).code;

/**
 * Applies `status` to ApiKey `o`'s status as `fieldManager` (server-side apply: the fields other
 * managers own stay). Deleted meanwhile, or re-created (the uid does not match): nothing, its
 * events take over.
 */
export async function applyApiKeyStatus(custom: CustomObjectsApi, o: ApiKeyResource, status: ApiKeyResourceStatus, fieldManager: string): Promise<void> {
  try {
    await custom.patchNamespacedCustomObjectStatus(
      {
        group: CRD_GROUP,
        version: CRD_VERSION,
        namespace: o.metadata.namespace,
        plural: Plural.apiKey,
        name: o.metadata.name,
        fieldManager,
        force: true,
        body: {
          apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
          kind: Kind.apiKey,
          metadata: { name: o.metadata.name, namespace: o.metadata.namespace, uid: o.metadata.uid },
          status,
        },
      },
      applyHeaders,
    );
  } catch (err) {
    if (errCode(err) !== 404 && errCode(err) !== 409) throw err;
  }
}

export function startKeys(opts: KeysOptions): Keys {
  const { kv, core, custom, log } = opts;
  const shared = opts.sharedModelNamespaces ?? [];
  const namespaces = opts.namespaces ?? [];
  const metrics: KeysMetrics = { tokensWritten: 0, tokensRemoved: 0, tokenConflicts: 0 };
  /** uid of an ApiKey → the token id this process registered for it last. */
  const registered = new Map<string, string>();
  /** One-off removals (a deleted ApiKey's ids), run through the queue like everything else. */
  const removals = new Map<string, () => Promise<void>>();
  let removalSeq = 0;

  const queue = new WorkQueue((key) => handle(key), {
    concurrency: 16,
    onError: (key, err, attempt) => log(`${key}: ${(err as Error).message} (attempt ${attempt}; retrying with backoff)`),
  });
  let listed = 0;
  const prune = () => {
    if (++listed >= 2) queue.add('prune');
  };
  const remove = (op: () => Promise<void>) => {
    const k = `remove/${++removalSeq}`;
    removals.set(k, op);
    queue.add(k);
  };

  const apikeys = watchNamespaces<ApiKeyResource>(opts.kc, namespaces, {
    path: (scope) => `/apis/${CRD_GROUP}/${CRD_VERSION}${scope}/${Plural.apiKey}`,
    onEvent: (type, o) => {
      const ns = o.metadata.namespace;
      // A labelled Secret it names is its own now (or, once it is gone, a labelled key again).
      if (legacy.get(ns, o.spec.secretRef.name)) queue.add(`secret/${ns}/${o.spec.secretRef.name}`);
      if (type !== 'DELETED') return queue.add(`apikey/${ns}/${o.metadata.name}`);
      const owner = { key: `${ns}/${o.metadata.name}`, uid: o.metadata.uid };
      const ids = new Set([o.status?.tokenId, registered.get(o.metadata.uid)].filter((x): x is string => !!x));
      registered.delete(o.metadata.uid);
      remove(async () => {
        for (const id of ids) if (await unregisterKey(kv, id, owner)) metrics.tokensRemoved++;
        // An id it held is free now: a key refused for it may take it.
        for (const k of apikeys.list())
          if (k.status?.conditions?.some((c) => c.reason === ApiKeyReason.idConflict)) queue.add(`apikey/${k.metadata.namespace}/${k.metadata.name}`);
      });
    },
    onSynced: prune,
    log: (l) => log(`watch apikeys: ${l}`),
    ...(opts.backoff ? { backoff: opts.backoff } : {}),
  });
  // The Secrets ApiKeys name, when labelled: a rotated token is applied at once.
  const keySecrets = watchNamespaces<SecretObject>(opts.kc, namespaces, {
    path: (scope) => `/api/v1${scope}/secrets`,
    labelSelector: API_KEY_SECRET_LABEL,
    onEvent: (_type, s) => {
      for (const k of apikeys.list())
        if (k.metadata.namespace === s.metadata?.namespace && k.spec.secretRef.name === s.metadata?.name)
          queue.add(`apikey/${k.metadata.namespace}/${k.metadata.name}`);
    },
    log: (l) => log(`watch apikey secrets: ${l}`),
    ...(opts.backoff ? { backoff: opts.backoff } : {}),
  });
  const legacy = watchNamespaces<SecretObject>(opts.kc, namespaces, {
    path: (scope) => `/api/v1${scope}/secrets`,
    labelSelector: `${TOKEN_SECRET_LABEL}=true`,
    onEvent: (_type, s) => queue.add(`secret/${s.metadata?.namespace}/${s.metadata?.name}`),
    onSynced: prune,
    log: (l) => log(`watch secrets: ${l}`),
    ...(opts.backoff ? { backoff: opts.backoff } : {}),
  });
  /** `<ns>/<name>` of a labelled Secret → what this process registered for it. */
  const legacyRegistered = new Map<string, { id: string; owner: KeyOwnerRef }>();

  async function handle(key: string): Promise<Requeue | void> {
    if (key === 'prune') return pruneGone();
    const removal = removals.get(key);
    if (removal) {
      await removal();
      removals.delete(key);
      return;
    }
    const [kind, ns, name] = key.split('/') as [string, string, string];
    if (kind === 'apikey') return reconcileApiKey(ns, name);
    return reconcileLegacy(ns, name);
  }

  async function reconcileApiKey(ns: string, name: string): Promise<Requeue | void> {
    const o = apikeys.get(ns, name);
    if (!o) return;
    const owner = { key: `${ns}/${name}`, uid: o.metadata.uid };
    const earlier = new Set([o.status?.tokenId, registered.get(owner.uid)].filter((x): x is string => !!x));
    const withdraw = async (keep?: string) => {
      for (const id of earlier) if (id !== keep && (await unregisterKey(kv, id, owner))) metrics.tokensRemoved++;
    };
    const refuse = async (reason: string, message: string, models?: string[]): Promise<Requeue> => {
      await withdraw();
      registered.delete(owner.uid);
      await writeStatus(o, { models, ready: { status: 'False', reason, message } });
      return { afterMs: KEY_RESYNC_MS };
    };

    const resolved = resolveKeyModels(ns, o.spec.models, shared);
    if (resolved.refused.length > 0) return refuse(ApiKeyReason.modelNotShared, notShared(resolved.refused, shared));
    // The CRD's schema refuses what KeyLimits does; an older CRD may not. A key whose limits
    // cannot be enforced is not registered (unlimited would be the wrong way to fail).
    const named = resolveLimitModels(ns, o.spec.limits);
    if ('error' in named) return refuse(ApiKeyReason.limitsInvalid, `${named.error}; the key is not registered until it names each once`, resolved.models);
    const limits = entryLimits(named.limits, 'spec.limits');
    if ('error' in limits)
      return refuse(
        ApiKeyReason.limitsInvalid,
        `${limits.error}; the key is not registered until they are valid (this magus's ApiKey CRD refuses such limits at admission: is an older one installed?)`,
        resolved.models,
      );
    const ref = { name: o.spec.secretRef.name, key: o.spec.secretRef.key ?? 'token' };
    let secret: SecretObject;
    try {
      secret = await core.readNamespacedSecret({ name: ref.name, namespace: ns });
    } catch (err) {
      if (errCode(err) !== 404) throw err;
      return refuse(
        ApiKeyReason.secretMissing,
        `Secret ${ref.name} does not exist in namespace ${ns}; create it with a token mgs_<random id>_<random secret> under '${ref.key}'`,
        resolved.models,
      );
    }
    const token = tokenOf(secret, ref.key);
    if ('error' in token) return refuse(ApiKeyReason.secretInvalid, token.error, resolved.models);

    const entry: TokenEntry & KeyOwnerRef = {
      digest: token.digest,
      name: owner.key,
      key: owner.key,
      uid: owner.uid,
      models: resolved.models,
      ...(o.spec.suspended ? { suspended: true } : {}),
      ...(limits.limits ? { limits: limits.limits } : {}),
      origin: `${APIKEY_ORIGIN}${owner.key}`,
    };
    const legacyOrigin = `${SECRET_ORIGIN}${ns}/${ref.name}`;
    let result = await registerKey(kv, token.id, entry, (e) => e.origin === legacyOrigin);
    if (!result.ok && result.holder.origin === legacyOrigin && secret.metadata?.uid) {
      // The same Secret, registered as a labelled key before this ApiKey named it: the ApiKey's now.
      await unregisterKey(kv, token.id, { key: `${ns}/${ref.name}`, uid: secret.metadata.uid });
      result = await registerKey(kv, token.id, entry);
    }
    if (!result.ok) {
      metrics.tokenConflicts++;
      return refuse(ApiKeyReason.idConflict, conflictMessage(token.id, result.holder, inNamespace(ns)), resolved.models);
    }
    if (result.written) metrics.tokensWritten++;
    registered.set(owner.uid, token.id);
    await withdraw(token.id);
    const suspended = o.spec.suspended === true;
    await writeStatus(o, {
      tokenId: token.id,
      models: resolved.models,
      ready: suspended
        ? { status: 'False', reason: ApiKeyReason.suspended, message: `token id ${token.id} is registered and refused while spec.suspended is true` }
        : {
            status: 'True',
            reason: ApiKeyReason.registered,
            message: `token id ${token.id} is registered; the key may use ${resolved.models.join(', ')}${limits.limits ? `; limits: ${describeKeyLimits(limits.limits)}` : ''}`,
          },
    });
    return { afterMs: KEY_RESYNC_MS };
  }

  async function writeStatus(
    o: ApiKeyResource,
    s: { tokenId?: string; models?: string[]; ready: Pick<Condition, 'status' | 'reason' | 'message'> },
  ): Promise<void> {
    const ready = { type: ApiKeyCondition.ready, ...s.ready, observedGeneration: o.metadata.generation };
    const status: ApiKeyResourceStatus = {
      observedGeneration: o.metadata.generation,
      ...(s.tokenId ? { tokenId: s.tokenId } : {}),
      ...(s.models ? { models: s.models, modelsSummary: s.models.join(',').slice(0, 1024) } : {}),
      conditions: mergeConditions([ready], o.status?.conditions ?? [], new Date().toISOString().replace(/\.\d{3}Z$/, 'Z')),
    };
    // `usage` is usage-status.ts's (another field manager): not this writer's to compare.
    const { observedGeneration: _a, usage: _u, ...was } = o.status ?? {};
    const { observedGeneration: _b, ...now } = status;
    if (o.status?.observedGeneration === o.metadata.generation && JSON.stringify(was) === JSON.stringify(now)) return;
    await applyApiKeyStatus(custom, o, status, FieldManager.controller);
  }

  async function reconcileLegacy(ns: string, name: string): Promise<void> {
    const where = `${ns}/${name}`;
    const s = legacy.get(ns, name);
    const uid = s?.metadata?.uid;
    const before = legacyRegistered.get(where);
    const drop = async () => {
      if (before && (await unregisterKey(kv, before.id, before.owner))) metrics.tokensRemoved++;
      legacyRegistered.delete(where);
    };
    const namedByApiKey = apikeys.list().some((k) => k.metadata.namespace === ns && k.spec.secretRef.name === name);
    if (!s || !uid || namedByApiKey) return drop();
    const token = tokenOf(s, 'token');
    if ('error' in token) {
      log(token.error);
      return drop();
    }
    // Confined to its namespace: models of a namespace that does not share them are dropped, said once per change.
    const wanted = decodeField(s, 'models')
      ?.split(',')
      .map((m) => m.trim())
      .filter(Boolean);
    const resolved = resolveKeyModels(ns, wanted, shared);
    if (resolved.refused.length > 0 && before?.id !== token.id) log(`Secret ${where}: ${notShared(resolved.refused, shared)}: dropped (declare an ApiKey)`);
    if (before && (before.id !== token.id || before.owner.uid !== uid)) await drop();
    const owner = { key: where, uid };
    const entry: TokenEntry & KeyOwnerRef = {
      digest: token.digest,
      name: decodeField(s, 'name') || where,
      key: where,
      uid,
      models: resolved.models,
      origin: `${SECRET_ORIGIN}${where}`,
    };
    const result = await registerKey(kv, token.id, entry, (e) => e.origin === entry.origin);
    if (!result.ok) {
      metrics.tokenConflicts++;
      log(`Secret ${where}: ${conflictMessage(token.id, result.holder, inNamespace(ns))}`);
      return;
    }
    if (result.written) metrics.tokensWritten++;
    legacyRegistered.set(where, { id: token.id, owner });
  }

  /** Entries of keys no longer declared (in this controller's namespaces, of its own origins). */
  async function pruneGone(): Promise<void> {
    const liveKeys = new Map(apikeys.list().map((k) => [k.metadata.uid, k]));
    const liveSecrets = new Map(legacy.list().flatMap((s) => (s.metadata?.uid ? [[s.metadata.uid, s] as const] : [])));
    for (const { id, entry } of await listKeys(kv)) {
      const origin = entry.origin ?? '';
      const fromKey = origin.startsWith(APIKEY_ORIGIN);
      if (!fromKey && !origin.startsWith(SECRET_ORIGIN)) continue;
      const where = origin.slice((fromKey ? APIKEY_ORIGIN : SECRET_ORIGIN).length);
      if (namespaces.length > 0 && !namespaces.includes(where.slice(0, where.indexOf('/')))) continue;
      let live: boolean;
      if (entry.uid === undefined)
        live = false; // an older magus's entry: its Secret, if still there, registers again
      else if (fromKey) live = liveKeys.has(entry.uid);
      else {
        const s = liveSecrets.get(entry.uid);
        const t = s ? tokenOf(s, 'token') : undefined;
        live = t !== undefined && 'id' in t && t.id === id; // a token changed while no controller ran
      }
      if (live) continue;
      if (await unregisterKey(kv, id, entry.uid === undefined ? null : { key: entry.key ?? '', uid: entry.uid })) metrics.tokensRemoved++;
    }
    // Labelled Secrets whose entry was an older magus's are registered again now.
    for (const s of legacy.list()) queue.add(`secret/${s.metadata?.namespace}/${s.metadata?.name}`);
  }

  return {
    watches: { apikeys, apikeySecrets: keySecrets, secrets: legacy },
    metrics,
    drained: () => queue.drained(),
    async stop() {
      queue.stop();
      await Promise.all([apikeys.stop(), keySecrets.stop(), legacy.stop()]);
    },
  };
}
