/**
 * `magus controller`'s core: it watches `Model` and `Dllama` resources and API keys and turns what
 * it sees into the entity workflows' inputs. It does no work itself: downloads, conversions,
 * pools and status writes happen in workflows and their activities.
 *
 * {@link ResourceController} owns the watches, one work queue of keys (`<kind>/<ns>/<name>`,
 * queue.ts) and the lifetimes of its collaborators, and hands each key to its kind's reconciler:
 * - {@link ModelReconciler} (model-reconciler.ts): a Model → its `modelPipeline`;
 * - {@link DllamaReconciler} (dllama-reconciler.ts): a Dllama → its model's `dllamaPool`, one
 *   Dllama per model;
 * both through {@link WorkflowSignals} (signals.ts: signal-with-start with the request id
 * `<uid>/<generation>`, so a restarted controller, or a second replica, starts nothing twice) and
 * {@link Finalizers} (finalizers.ts: deletion waits for the workflow's cleanup, bounded by
 * `cleanupTimeoutMs`). API keys (`ApiKey` resources, and Secrets labelled
 * `magus.dev/api-token=true` until the next release) become `magus_tokens` entries (keys.ts);
 * live conversations are mirrored as `Session`s (sessions.ts).
 */
import type { MeterVerifier } from '../dataplane/meter';
import { CoreV1Api, CustomObjectsApi, type KubeConfig } from '@kubernetes/client-node';
import type { Client } from '@temporalio/client';
import type { JetStreamClient, KV } from 'nats';
import type { LimitStore } from '../dataplane/limits';
import { watchNamespaces, type ResourceWatch } from '../kube/watch';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';
import { Kind, Plural, type ApiKeyResource, type DllamaResource, type ModelResource } from '../shared/kube';
import { DllamaReconciler } from './dllama-reconciler';
import { Finalizers } from './finalizers';
import { startKeys, type Keys } from './keys';
import { ModelReconciler } from './model-reconciler';
import { WorkQueue, type Requeue } from './queue';
import { startSessionMirror, type SessionMirror } from './sessions';
import { startUsageStatus, type UsageStatus } from './usage-status';
import { WorkflowSignals } from './signals';

export interface ControllerOptions {
  kc: KubeConfig;
  temporal: { client: Client; namespace: string; taskQueue: string };
  /** The `magus_tokens` bucket; without it ApiKeys and token Secrets are not watched. */
  tokens?: KV;
  /** Namespaces whose models an ApiKey of any namespace may name (default: none). */
  sharedModelNamespaces?: readonly string[];
  /**
   * The usage ledger's bucket (and the gateways' limit counts): with a tokens bucket too, each
   * ApiKey's `status.usage` is written from it (usage-status.ts).
   */
  usage?: { js: JetStreamClient; bucket: string; sumsBucket?: string; limits?: LimitStore; verifier?: MeterVerifier; intervalMs?: number };
  /** The `magus_sessions` bucket and how many Sessions to mirror at most (0: none). */
  sessions?: { kv: KV; cap: number };
  /** Only these namespaces, one watch each (default or empty: all namespaces, one watch). */
  namespaces?: readonly string[];
  /** Reconciles at once (default 64). */
  concurrency?: number;
  /** How long after a deletion its cleanup may take before it is cut short (default 2 min). */
  cleanupTimeoutMs?: number;
  log?: (line: string) => void;
}

export interface ControllerMetrics {
  signals: number;
  reconciles: number;
  failures: number;
  finalizersRemoved: number;
  cleanupsTimedOut: number;
  tokensWritten: number;
  tokensRemoved: number;
  /** Keys refused because another key holds their token id. */
  tokenConflicts: number;
  watches: Record<string, ResourceWatch<unknown>['stats']>;
  sessions?: SessionMirror['stats'];
}

export interface Controller {
  /** Resolves once every watch has delivered its first list. */
  readonly synced: Promise<void>;
  metrics(): ControllerMetrics;
  /** Nothing queued or running (tests and the bench wait on it). */
  idle(): Promise<void>;
  /** The Session mirror has made a complete pass after this call. */
  sessionsSettled(): Promise<void>;
  stop(): Promise<void>;
}

// An API server restart takes seconds: come back within a few seconds of it, not half a minute.
const WATCH_BACKOFF = { initialMs: 250, maxMs: 5000 };

const keyOf = (kind: string, o: { metadata?: { namespace?: string; name?: string } }) => `${kind}/${o.metadata?.namespace}/${o.metadata?.name}`;

/** Starts watching and reconciling; {@link Controller.stop} ends it. */
export function startController(opts: ControllerOptions): Controller {
  return new ResourceController(opts);
}

export class ResourceController implements Controller {
  readonly synced: Promise<void>;
  private readonly counters = { reconciles: 0, failures: 0 };
  private readonly queue: WorkQueue;
  private readonly workflows: WorkflowSignals;
  private readonly finalizers: Finalizers;
  private readonly models: ResourceWatch<ModelResource>;
  private readonly dllamas: ResourceWatch<DllamaResource>;
  private readonly modelReconciler: ModelReconciler;
  private readonly dllamaReconciler: DllamaReconciler;
  private readonly watches: Record<string, ResourceWatch<unknown>>;
  /** Absent without a tokens bucket. */
  private readonly keys: Keys | undefined;
  /** Absent without a sessions bucket, or with a cap of 0. */
  private readonly sessionMirror: SessionMirror | undefined;
  /** ApiKeys' usage; absent without the ledger or a tokens bucket (undefined inside: it could not start). */
  private readonly usageStatus: Promise<UsageStatus | undefined> | undefined;

  constructor(opts: ControllerOptions) {
    const log = opts.log ?? (() => undefined);
    const custom = opts.kc.makeApiClient(CustomObjectsApi);
    const core = opts.kc.makeApiClient(CoreV1Api);
    this.workflows = new WorkflowSignals(opts.temporal.client, opts.temporal.namespace, opts.temporal.taskQueue);
    this.finalizers = new Finalizers(custom);
    this.modelReconciler = new ModelReconciler({
      workflows: this.workflows,
      finalizers: this.finalizers,
      core,
      cleanupTimeoutMs: opts.cleanupTimeoutMs ?? 120_000,
    });
    this.dllamaReconciler = new DllamaReconciler({
      workflows: this.workflows,
      finalizers: this.finalizers,
      core,
      custom,
      dllamas: () => this.dllamas.list(),
      model: (namespace, name) => this.models.get(namespace, name),
    });
    this.queue = new WorkQueue((key) => this.reconcile(key), {
      concurrency: opts.concurrency ?? 64,
      onError: (key, err, attempt) => {
        this.counters.failures++;
        log(`${key}: ${(err as Error).message} (attempt ${attempt}; retrying with backoff)`);
      },
    });

    const namespaces = opts.namespaces ?? [];
    this.models = watchNamespaces<ModelResource>(opts.kc, namespaces, {
      path: (scope) => `/apis/${CRD_GROUP}/${CRD_VERSION}${scope}/${Plural.model}`,
      onEvent: (type, o) => {
        if (type === 'DELETED') this.modelReconciler.deleted(o);
        else this.queue.add(keyOf(Kind.model, o));
        // Their Splittable condition follows the Model's status.
        for (const d of this.dllamaReconciler.servingModel(o)) this.queue.add(keyOf(Kind.dllama, d));
      },
      log: (l) => log(`watch models: ${l}`),
      backoff: WATCH_BACKOFF,
    });
    this.dllamas = watchNamespaces<DllamaResource>(opts.kc, namespaces, {
      path: (scope) => `/apis/${CRD_GROUP}/${CRD_VERSION}${scope}/${Plural.dllama}`,
      onEvent: (type, o) => {
        if (type === 'DELETED') this.dllamaReconciler.deleted(o);
        else this.queue.add(keyOf(Kind.dllama, o));
        for (const x of this.dllamaReconciler.rivalsFreedBy(type, o)) this.queue.add(keyOf(Kind.dllama, x));
      },
      log: (l) => log(`watch dllamas: ${l}`),
      backoff: WATCH_BACKOFF,
    });
    this.watches = { models: this.models, dllamas: this.dllamas };

    this.keys = opts.tokens
      ? startKeys({
          kc: opts.kc,
          core,
          custom,
          kv: opts.tokens,
          namespaces,
          sharedModelNamespaces: opts.sharedModelNamespaces,
          backoff: WATCH_BACKOFF,
          log,
        })
      : undefined;
    if (this.keys) Object.assign(this.watches, this.keys.watches);
    const apikeys = this.keys?.watches.apikeys as ResourceWatch<ApiKeyResource> | undefined;
    this.usageStatus =
      opts.usage && apikeys
        ? startUsageStatus({ ...opts.usage, custom, apikeys: () => apikeys.list(), log }).catch((err: unknown) => {
            log(`ApiKeys' usage is not written: the usage ledger cannot be read (${(err as Error).message})`);
            return undefined;
          })
        : undefined;
    this.sessionMirror =
      opts.sessions && opts.sessions.cap > 0 ? startSessionMirror({ kc: opts.kc, kv: opts.sessions.kv, cap: opts.sessions.cap, namespaces, log }) : undefined;
    this.synced = Promise.all(Object.values(this.watches).map((w) => w.synced)).then(() => undefined);
  }

  metrics(): ControllerMetrics {
    const keys = this.keys?.metrics;
    return {
      signals: this.workflows.sent,
      reconciles: this.counters.reconciles,
      failures: this.counters.failures,
      finalizersRemoved: this.finalizers.removed,
      cleanupsTimedOut: this.modelReconciler.cleanupsTimedOut,
      tokensWritten: keys?.tokensWritten ?? 0,
      tokensRemoved: keys?.tokensRemoved ?? 0,
      tokenConflicts: keys?.tokenConflicts ?? 0,
      watches: Object.fromEntries(Object.entries(this.watches).map(([k, w]) => [k, w.stats])),
      ...(this.sessionMirror ? { sessions: { ...this.sessionMirror.stats } } : {}),
    };
  }

  sessionsSettled(): Promise<void> {
    return this.sessionMirror?.settled() ?? Promise.resolve();
  }

  async idle(): Promise<void> {
    await this.synced;
    await this.queue.drained();
    await this.keys?.drained();
  }

  async stop(): Promise<void> {
    this.queue.stop();
    await (await this.usageStatus)?.stop();
    await this.sessionMirror?.stop();
    await this.keys?.stop();
    await Promise.all(Object.values(this.watches).map((w) => w.stop()));
  }

  /** One key of the queue, handed to its kind's reconciler with the object as the watch holds it now (gone: nothing to do). */
  private async reconcile(key: string): Promise<Requeue | void> {
    this.counters.reconciles++;
    const [kind, namespace, name] = key.split('/') as [string, string, string];
    if (kind === Kind.model) {
      const o = this.models.get(namespace, name);
      return o ? this.modelReconciler.reconcile(o) : undefined;
    }
    const o = this.dllamas.get(namespace, name);
    return o ? this.dllamaReconciler.reconcile(o) : undefined;
  }
}
