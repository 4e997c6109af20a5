/**
 * The one place that watches the Kubernetes API (house style: reconcilers never touch a raw
 * watch). {@link watchResource} keeps a typed cache of one collection in step with the API
 * server and hands its owner ordered ADDED / MODIFIED / DELETED events:
 *
 *   list (paginated) → diff against the cache → watch from the list's resourceVersion
 *     → server-side timeout: watch again from the last resourceVersion seen
 *     → 410 Gone (HTTP status or an ERROR event): list again, and diff
 *     → any other failure: back off (exponential, jittered), watch again from the last
 *       resourceVersion (or list again when there is none)
 *
 * until {@link ResourceWatch.stop}. It never gives up on its own.
 *
 * Why not client-node's informer: in 1.3 it stops for good on any error but a 410 (a refused
 * connection ends it silently), never asks for bookmarks and sets no watch timeout. Its `Watch`
 * class is used for the stream itself, with these properties of 1.3 (read in `dist/watch.js`)
 * taken into account:
 * - `watch()` resolves to its AbortController only once response headers arrived (or the
 *   request failed), so a request that is still connecting cannot be aborted yet;
 * - `done` may run before that promise resolves (a non-200 status), and runs once (1.3 guards
 *   it), with `null` when the stream ends, including when the server closes it after an ERROR
 *   event, and with an AbortError after our own `abort()`;
 * - `watch()` itself rejects, without calling `done`, when building the request fails (say, an
 *   exec credential plugin fails);
 * - a non-200 response becomes `Error(statusText)` with `statusCode`; the Status body (the
 *   reason) is not read;
 * - an exception thrown by the event callback is swallowed as if it were a JSON parse error;
 * - its 30 s request timeout covers only the response headers: an established watch on a
 *   connection that silently died would wait forever, hence the watchdog below;
 * - objects are raw JSON (dates are strings, whatever the generated types say).
 *
 * Bookmarks: every watch asks for them (`allowWatchBookmarks=true`), and their resourceVersion
 * is kept, so a re-watch after a quiet period starts near the present instead of at an old
 * revision that etcd may have compacted (a 410 and a full list). The API server only sends them
 * when its watch cache is on.
 */
import { request as httpRequest, type IncomingMessage } from 'node:http';
import { request as httpsRequest, type RequestOptions } from 'node:https';
import { Watch, type KubeConfig } from '@kubernetes/client-node';

export type WatchEventType = 'ADDED' | 'MODIFIED' | 'DELETED';

/**
 * What the watch needs to know of an object: its identity and version. Both client-node's
 * `KubernetesObject` types and our own kinds in `shared/kube.ts` fit (client-node's
 * `KubernetesObject` does not fit ours: it types `creationTimestamp` as a `Date`).
 */
export interface WatchedObject {
  apiVersion?: string;
  kind?: string;
  metadata?: { name?: string; namespace?: string; uid?: string; resourceVersion?: string };
}

export interface WatchOptions<T extends WatchedObject> {
  /**
   * Collection path, e.g. `/apis/magus.dev/v1alpha1/models` (all namespaces) or
   * `/api/v1/namespaces/x/secrets`.
   */
  path: string;
  labelSelector?: string;
  fieldSelector?: string;
  /**
   * Called in order, one call at a time, with the cache already updated. A DELETED from a
   * relist carries the last state the watch knew. An object deleted and re-created under the
   * same name is a DELETED then an ADDED (its uid changed). Must not throw: an exception is
   * logged and the watch carries on.
   */
  onEvent(type: WatchEventType, object: T): void;
  /** After each complete (re)list has been delivered through {@link onEvent}. */
  onSynced?(): void;
  /** Failures, 410s and recoveries, one line each (default: dropped; `stats` counts them). */
  log?(line: string): void;
  /**
   * Server-side timeout of each watch request, in seconds. Default: random in 240–300 s, so
   * that many watchers do not all reconnect at once.
   */
  timeoutSeconds?: number;
  /** Delay before retrying after a failure; doubles per failure, with jitter. Default 500 ms → 30 s. */
  backoff?: { initialMs: number; maxMs: number };
  /** Objects per list page (`limit` / `continue`). Default 500. */
  pageSize?: number;
}

export interface WatchStats {
  /** Complete (re)lists delivered. */
  lists: number;
  /** Watch requests made. */
  watches: number;
  /** Failed list or watch requests (each one followed by a backoff). */
  errors: number;
  /** Relists forced by 410 Gone (the watch's resourceVersion was compacted away). */
  relistsOn410: number;
  /** ADDED / MODIFIED / DELETED received on watch streams (not the ones a relist synthesises). */
  events: number;
  /** BOOKMARK events received. */
  bookmarks: number;
}

export interface ResourceWatch<T> {
  /**
   * Resolves when the first list has been delivered. Rejects only when {@link stop} comes
   * first; an unreachable API server keeps it pending (bound the wait yourself).
   */
  readonly synced: Promise<void>;
  /** The cached object; `namespace` is `undefined` for cluster-scoped kinds. */
  get(namespace: string | undefined, name: string): T | undefined;
  /** Every cached object. */
  list(): T[];
  /** A snapshot of the counters. */
  readonly stats: WatchStats;
  /**
   * Stops for good: aborts the list or watch in flight and cancels a pending retry. No callback
   * runs once it resolves. A watch request still connecting is aborted as soon as client-node
   * hands over its AbortController (it has no other way to cancel it).
   */
  stop(): Promise<void>;
}

/**
 * Starts watching a collection; see the module comment for the protocol. The returned handle's
 * cache and events cover the objects that match the selectors.
 */
export function watchResource<T extends WatchedObject>(kc: KubeConfig, opts: WatchOptions<T>): ResourceWatch<T> {
  return new ResourceWatcher<T>(kc, opts);
}

/** How long a watch may outlive its own `timeoutSeconds` before we call the connection dead. */
const WATCHDOG_GRACE_MS = 30_000;
/** A watch that ends normally sooner than this, having delivered nothing, counts as a failure. */
const MIN_HEALTHY_WATCH_MS = 1_000;
/** Socket idle timeout of a list request. */
const LIST_IDLE_TIMEOUT_MS = 60_000;

type WatchEnd =
  | { kind: 'closed' } // the server ended the stream (its timeoutSeconds)
  | { kind: 'gone'; why: string } // 410: the resourceVersion is compacted away
  | { kind: 'failed'; why: string }
  | { kind: 'stopped' };

/** A Kubernetes `Status` object, as in an ERROR event or an error response body. */
interface Status {
  code?: number;
  reason?: string;
  message?: string;
}

interface ObjectList {
  apiVersion?: string;
  kind?: string;
  metadata?: { resourceVersion?: string; continue?: string };
  items?: WatchedObject[];
}

class HttpStatusError extends Error {
  override readonly name = 'KubernetesHttpStatusError';
  constructor(
    readonly statusCode: number,
    message: string,
  ) {
    super(message);
  }
}

class ResourceWatcher<T extends WatchedObject> implements ResourceWatch<T> {
  readonly synced: Promise<void>;
  private readonly cache = new Map<string, T>();
  private readonly counters: WatchStats = { lists: 0, watches: 0, errors: 0, relistsOn410: 0, events: 0, bookmarks: 0 };
  private readonly watcher: Watch;
  private readonly describe: string;
  private readonly timeoutSeconds: number;
  private readonly backoff: { initialMs: number; maxMs: number };
  private readonly log: (line: string) => void;
  /** Latest resourceVersion seen (list, event or bookmark); undefined = list before watching. */
  private resourceVersion: string | undefined;
  private stopped = false;
  /** Ends whatever the loop is waiting on (list request, watch, backoff sleep). */
  private interrupt: (() => void) | undefined;
  private readonly loop: Promise<void>;
  private readonly settleSynced: { resolve: () => void; reject: (err: Error) => void; done: boolean };

  constructor(
    private readonly kc: KubeConfig,
    private readonly opts: WatchOptions<T>,
  ) {
    this.watcher = new Watch(kc);
    const selectors = [opts.labelSelector && `labels ${opts.labelSelector}`, opts.fieldSelector && `fields ${opts.fieldSelector}`].filter(Boolean);
    this.describe = `watch ${opts.path}${selectors.length ? ` (${selectors.join(', ')})` : ''}`;
    this.timeoutSeconds = opts.timeoutSeconds ?? 240 + Math.floor(Math.random() * 61);
    this.backoff = opts.backoff ?? { initialMs: 500, maxMs: 30_000 };
    this.log = (line) => opts.log?.(`${this.describe}: ${line}`);

    let settle!: ResourceWatcher<T>['settleSynced'];
    this.synced = new Promise<void>((resolve, reject) => {
      settle = { resolve, reject, done: false };
    });
    this.settleSynced = settle;
    // Rejected only by stop(); nobody has to be listening then, so that is not "unhandled".
    this.synced.catch(() => undefined);

    this.loop = this.run().catch((err: unknown) => this.log(`stopped by a bug: ${describeError(err)}`));
  }

  get(namespace: string | undefined, name: string): T | undefined {
    return this.cache.get(`${namespace ?? ''}/${name}`);
  }

  list(): T[] {
    return [...this.cache.values()];
  }

  get stats(): WatchStats {
    return { ...this.counters };
  }

  async stop(): Promise<void> {
    if (!this.stopped) {
      this.stopped = true;
      this.interrupt?.();
      if (!this.settleSynced.done) {
        this.settleSynced.done = true;
        this.settleSynced.reject(new Error(`${this.describe}: stopped before the first list`));
      }
    }
    await this.loop;
  }

  private async run(): Promise<void> {
    let failures = 0; // consecutive; sets the backoff
    let gonesInARow = 0; // 410s with nothing delivered in between
    const failed = async (why: string): Promise<void> => {
      this.counters.errors++;
      failures++;
      const delay = backoffDelay(this.backoff, failures);
      this.log(`${why}; retrying in ${delay} ms (failure ${failures} in a row)`);
      await this.sleep(delay);
    };

    while (!this.stopped) {
      if (this.resourceVersion === undefined) {
        try {
          await this.relist();
          failures = 0;
        } catch (err) {
          if (!this.stopped) await failed(`list failed: ${describeError(err)}`);
        }
        continue;
      }

      const started = Date.now();
      const { end, received } = await this.watchOnce(this.resourceVersion);
      if (received > 0) {
        failures = 0;
        gonesInARow = 0;
      }
      switch (end.kind) {
        case 'stopped':
          return;
        case 'closed':
          // Normally the server's timeoutSeconds. An immediate empty end is something else (a
          // proxy closing streams, say): retrying at once would spin.
          if (received === 0 && Date.now() - started < MIN_HEALTHY_WATCH_MS) await failed('watch ended as soon as it started');
          break;
        case 'gone':
          this.counters.relistsOn410++;
          this.resourceVersion = undefined;
          this.log(`${end.why}; listing again`);
          // A relist that is at once too old again is not progress: do not spin on it.
          if (++gonesInARow > 1) await this.sleep(backoffDelay(this.backoff, ++failures));
          break;
        case 'failed':
          await failed(`watch failed: ${end.why}`);
          break;
      }
    }
  }

  /** Lists every page, then brings the cache and the owner up to date with the result. */
  private async relist(): Promise<void> {
    const pageSize = this.opts.pageSize ?? 500;
    let items: T[] = [];
    let resourceVersion: string | undefined;
    let continueToken: string | undefined;
    for (;;) {
      const url = new URL(this.opts.path, 'http://placeholder');
      if (this.opts.labelSelector) url.searchParams.set('labelSelector', this.opts.labelSelector);
      if (this.opts.fieldSelector) url.searchParams.set('fieldSelector', this.opts.fieldSelector);
      url.searchParams.set('limit', String(pageSize));
      if (continueToken) url.searchParams.set('continue', continueToken);
      let page: ObjectList;
      try {
        page = (await this.getJson(`${url.pathname}${url.search}`)) as ObjectList;
      } catch (err) {
        // The snapshot behind a continue token was compacted: start over from a fresh one.
        if (continueToken && err instanceof HttpStatusError && err.statusCode === 410) {
          this.log('list continue token expired; listing from the start');
          items = [];
          continueToken = undefined;
          continue;
        }
        throw err;
      }
      // Items of a typed list carry no apiVersion/kind; fill them in so that listed and watched
      // objects look alike.
      const itemKind = page.kind?.replace(/List$/, '');
      for (const item of page.items ?? []) {
        items.push({ apiVersion: page.apiVersion, kind: itemKind, ...item } as T);
      }
      resourceVersion = page.metadata?.resourceVersion;
      continueToken = page.metadata?.continue || undefined;
      if (!continueToken) break;
    }
    if (this.stopped) return;
    if (!resourceVersion) throw new Error('the list carries no resourceVersion');

    // Deletions first, so a name that was deleted and re-created reads DELETED then ADDED.
    const listed = new Map(items.map((item) => [keyOf(item), item]));
    for (const [key, cached] of [...this.cache]) {
      if (listed.has(key)) continue;
      this.cache.delete(key);
      this.deliver('DELETED', cached);
    }
    for (const [key, item] of listed) {
      const cached = this.cache.get(key);
      if (cached && cached.metadata?.uid !== item.metadata?.uid) {
        this.cache.delete(key);
        this.deliver('DELETED', cached);
      }
      const current = this.cache.get(key);
      if (current && current.metadata?.resourceVersion === item.metadata?.resourceVersion) continue;
      this.cache.set(key, item);
      this.deliver(current ? 'MODIFIED' : 'ADDED', item);
    }
    this.resourceVersion = resourceVersion;
    this.counters.lists++;
    if (!this.settleSynced.done) {
      this.settleSynced.done = true;
      this.settleSynced.resolve();
    }
    if (this.opts.onSynced && !this.stopped) {
      try {
        this.opts.onSynced();
      } catch (err) {
        this.log(`onSynced threw: ${describeError(err)}`);
      }
    }
  }

  /**
   * One watch request from `resourceVersion`, until it ends for one of the reasons in
   * {@link WatchEnd}. `received` counts the events and bookmarks it delivered.
   */
  private watchOnce(resourceVersion: string): Promise<{ end: WatchEnd; received: number }> {
    this.counters.watches++;
    let received = 0;
    return new Promise((resolve) => {
      let ended = false;
      let controller: AbortController | undefined;
      const finish = (end: WatchEnd): void => {
        if (ended) return;
        ended = true;
        clearTimeout(watchdog);
        this.interrupt = undefined;
        controller?.abort();
        resolve({ end, received });
      };
      this.interrupt = () => finish({ kind: 'stopped' });
      // The server ends the watch after timeoutSeconds; if it has not, the connection is dead
      // without either side noticing (no bytes flow on a quiet watch without bookmarks).
      const watchdog = setTimeout(
        () => finish({ kind: 'failed', why: `no end ${WATCHDOG_GRACE_MS / 1000} s past its ${this.timeoutSeconds} s timeout (dead connection?)` }),
        this.timeoutSeconds * 1000 + WATCHDOG_GRACE_MS,
      );

      const onLine = (type: string, object: unknown): void => {
        // Lines still buffered after we gave up on this request are dropped: the next request
        // starts from the last resourceVersion we did process, so nothing is lost.
        if (ended) return;
        switch (type) {
          case 'ADDED':
          case 'MODIFIED':
          case 'DELETED':
            received++;
            this.counters.events++;
            this.apply(type, object as T);
            break;
          case 'BOOKMARK':
            received++;
            this.counters.bookmarks++;
            this.resourceVersion = (object as WatchedObject).metadata?.resourceVersion ?? this.resourceVersion;
            break;
          case 'ERROR': {
            const status = object as Status;
            const why = `ERROR event ${status.code ?? '?'} ${status.reason ?? ''}: ${status.message ?? ''}`;
            finish(status.code === 410 ? { kind: 'gone', why } : { kind: 'failed', why });
            break;
          }
          default:
            this.log(`ignoring a watch event of type ${type}`);
        }
      };
      const onDone = (err: unknown): void => {
        if (!err) return finish({ kind: 'closed' });
        const statusCode = (err as { statusCode?: unknown }).statusCode;
        const why = describeError(err);
        finish(statusCode === 410 ? { kind: 'gone', why: `watch request: ${why}` } : { kind: 'failed', why });
      };

      const query = {
        resourceVersion,
        allowWatchBookmarks: true,
        timeoutSeconds: this.timeoutSeconds,
        labelSelector: this.opts.labelSelector,
        fieldSelector: this.opts.fieldSelector,
      };
      this.watcher.watch(this.opts.path, query, onLine, onDone).then(
        (c) => {
          controller = c;
          // Stopped (or failed) while connecting: the request can only be aborted now.
          if (ended) c.abort();
        },
        (err: unknown) => finish({ kind: 'failed', why: `could not start: ${describeError(err)}` }),
      );
    });
  }

  /** A watch event: update the cache, then tell the owner (by what the cache held). */
  private apply(type: WatchEventType, object: T): void {
    const key = keyOf(object);
    this.resourceVersion = object.metadata?.resourceVersion ?? this.resourceVersion;
    const cached = this.cache.get(key);
    if (type === 'DELETED') {
      // A deletion of something never seen (already dropped by a relist) is not news.
      if (!cached) return;
      this.cache.delete(key);
      this.deliver('DELETED', object);
      return;
    }
    if (cached && cached.metadata?.uid !== object.metadata?.uid) {
      this.cache.delete(key);
      this.deliver('DELETED', cached);
    }
    const existed = this.cache.has(key);
    this.cache.set(key, object);
    this.deliver(existed ? 'MODIFIED' : 'ADDED', object);
  }

  private deliver(type: WatchEventType, object: T): void {
    if (this.stopped) return;
    try {
      this.opts.onEvent(type, object);
    } catch (err) {
      this.log(`onEvent(${type} ${keyOf(object)}) threw: ${describeError(err)}`);
    }
  }

  /** Waits `ms`, or less if stopped. */
  private sleep(ms: number): Promise<void> {
    if (this.stopped) return Promise.resolve();
    return new Promise((resolve) => {
      const timer = setTimeout(done, ms);
      function done(): void {
        clearTimeout(timer);
        resolve();
      }
      this.interrupt = () => {
        this.interrupt = undefined;
        done();
      };
    });
  }

  /** GET `pathAndQuery` from the API server as JSON, abortable by {@link stop}. */
  private async getJson(pathAndQuery: string): Promise<unknown> {
    const cluster = this.kc.getCurrentCluster();
    if (!cluster) throw new Error('the KubeConfig has no current cluster');
    const url = new URL(cluster.server.replace(/\/$/, '') + pathAndQuery);
    const abort = new AbortController();
    const options: RequestOptions = { method: 'GET', headers: { Accept: 'application/json' }, signal: abort.signal, timeout: LIST_IDLE_TIMEOUT_MS };
    // The same TLS, proxy and credential handling as client-node's own requests.
    await this.kc.applyToHTTPSOptions(options);
    if (this.stopped) throw new Error('stopped');
    const body = await new Promise<{ status: number; text: string }>((resolve, reject) => {
      this.interrupt = () => abort.abort();
      const req = (url.protocol === 'http:' ? httpRequest : httpsRequest)(url, options, (res: IncomingMessage) => {
        const chunks: Buffer[] = [];
        res.on('data', (chunk: Buffer) => chunks.push(chunk));
        res.on('error', reject);
        res.on('close', () => {
          if (!res.complete) reject(new Error('connection closed mid-response'));
          else resolve({ status: res.statusCode ?? 0, text: Buffer.concat(chunks).toString('utf8') });
        });
      });
      req.on('timeout', () => req.destroy(new Error(`no data for ${LIST_IDLE_TIMEOUT_MS / 1000} s`)));
      req.on('error', reject);
      req.end();
    }).finally(() => {
      this.interrupt = undefined;
    });
    if (body.status !== 200) {
      let status: Status = {};
      try {
        status = JSON.parse(body.text) as Status;
      } catch {
        // not a Status: the HTTP code alone says enough
      }
      throw new HttpStatusError(body.status, `HTTP ${body.status} ${status.reason ?? ''}: ${status.message ?? body.text.slice(0, 200)}`);
    }
    return JSON.parse(body.text) as unknown;
  }
}

function keyOf(object: WatchedObject): string {
  return `${object.metadata?.namespace ?? ''}/${object.metadata?.name ?? ''}`;
}

/**
 * Delay before retry number `failures` (1-based): `initialMs · 2^(failures−1)` capped at `maxMs`,
 * then drawn from its upper half, so that clients cut off together do not return together.
 */
export function backoffDelay(backoff: { initialMs: number; maxMs: number }, failures: number): number {
  const ceiling = Math.min(backoff.maxMs, backoff.initialMs * 2 ** Math.min(failures - 1, 30));
  return Math.round(ceiling / 2 + Math.random() * (ceiling / 2));
}

function describeError(err: unknown): string {
  if (!(err instanceof Error)) return String(err);
  const e = err as Error & { statusCode?: unknown; code?: unknown };
  const parts = [typeof e.statusCode === 'number' ? `HTTP ${e.statusCode}` : '', typeof e.code === 'string' ? e.code : '', e.message];
  return parts.filter(Boolean).join(' ');
}

/**
 * One watch per namespace (or one over all namespaces when `namespaces` is empty), seen as one:
 * `path(scope)` builds each collection path from `''` (all) or `/namespaces/<ns>`. Each namespace's
 * watch lists, watches, relists on 410 and backs off on its own; the handle's cache is their
 * union, its counters their sums. `synced` resolves and `onSynced` first runs once every
 * namespace has delivered its first list; after that `onSynced` runs after each relist of any.
 */
export function watchNamespaces<T extends WatchedObject>(
  kc: KubeConfig,
  namespaces: readonly string[],
  opts: Omit<WatchOptions<T>, 'path'> & { path: (scope: string) => string },
): ResourceWatch<T> {
  if (namespaces.length === 0) return watchResource(kc, { ...opts, path: opts.path('') });
  const pending = new Set(namespaces);
  const watches = new Map(
    namespaces.map((ns) => [
      ns,
      watchResource<T>(kc, {
        ...opts,
        path: opts.path(`/namespaces/${ns}`),
        onSynced: () => {
          pending.delete(ns);
          if (pending.size === 0) opts.onSynced?.();
        },
      }),
    ]),
  );
  const all = [...watches.values()];
  return {
    synced: Promise.all(all.map((w) => w.synced)).then(() => undefined),
    get: (namespace, name) => (namespace === undefined ? undefined : watches.get(namespace)?.get(namespace, name)),
    list: () => all.flatMap((w) => w.list()),
    get stats(): WatchStats {
      const sum: WatchStats = { lists: 0, watches: 0, errors: 0, relistsOn410: 0, events: 0, bookmarks: 0 };
      for (const w of all) for (const k of Object.keys(sum) as (keyof WatchStats)[]) sum[k] += w.stats[k];
      return sum;
    },
    stop: async () => void (await Promise.all(all.map((w) => w.stop()))),
  };
}
