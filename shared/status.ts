/**
 * What the workflows report: the model pipeline's `progress` and the pool's `status` queries,
 * which activities mirror into the `Model` and `Dllama` resources' status and `magus model pull`
 * draws. Declared here, below both rooms, so that activities need nothing of workflows/ (the
 * workflows' definitions.ts re-export them). Workflow-safe: no imports, no I/O.
 */

export type PipelinePhase = 'resolving' | 'transferring' | 'converting' | 'sizing' | 'publishing' | 'ready' | 'failed' | 'cancelled';

/** What the `progress` query returns (and `magus model pull` draws). */
export interface PipelineProgress {
  phase: PipelinePhase;
  /** Bumped by every accepted spec change; the CR's `observedGeneration` maps onto it. */
  generation: number;
  repo: string;
  /** Commit the revision resolved to, once known. */
  sha: string | null;
  files: { done: number; total: number };
  /** Source bytes transferred (including bytes found already in S3). */
  bytes: { done: number; total: number };
  /** Tensors converted over the artifacts whose conversion started. */
  tensors: { done: number; total: number };
  /** The same per artifact (`format:weights`), in the order they started (the query only). */
  artifacts?: { key: string; done: number; total: number }[];
  /** Seconds to the end of the current phase at the recent rate, when it can be estimated. */
  etaSeconds: number | null;
  /** Set in phase `failed`: the typed reason (an ErrorType) and message. */
  failure: { type: string; message: string; /** The phase it failed in. */ during?: PipelinePhase } | null;
  /** The `Model` resource's generation the pipeline has taken in (absent without a resource). */
  observedGeneration?: number;
  /**
   * A step of the current phase whose last attempt failed and is being retried (transient errors
   * retry forever, with backoff): which one, how many attempts failed, and the last error. Cleared
   * when the step completes or the phase changes. Absent in answers of older workers.
   */
  retrying?: ActivityRetry;
}

/** Sent by a pipeline activity whose attempt failed with an error that will be retried. */
export interface ActivityRetry {
  /** The activity, e.g. `resolveSource`. */
  activity: string;
  /** Which one of its kind (a file's path, an artifact's `format:weights`), when several run. */
  key?: string;
  /** The attempt that failed (1 = the first). */
  attempt: number;
  /** Its error, as Temporal records it (never a secret: errors carry references only). */
  message: string;
  /** When it failed (ISO-8601, the worker's clock). */
  at: string;
}

/** Sent by long activities, throttled, so the `progress` query can show bytes and tensors. */
export interface ActivityProgress {
  /** Distinguishes concurrent activities (e.g. the file path or artifact). */
  key: string;
  kind: 'transfer' | 'convert';
  done: number;
  total: number;
}

/**
 * An instance's restarts in place (the local runtime starts a stopped engine or distributed-llama
 * topology again where it was, as a whole): how often it stopped by itself, how it last did, and
 * whether it is being started again now.
 */
export interface RestartReport {
  stops: number;
  last?: string;
  recovering: boolean;
}

/** `watchInstance`'s input: the instance, and (pools that take restart reports) its restarts as the pool knows them. */
export interface WatchInstanceInput {
  pool: string;
  instance: string;
  intervalMs: number;
  /** Absent (pools started before restarts were reported): only a loss ends the watch. */
  known?: RestartReport;
}

/**
 * How a watch of an instance ended: `restart` set — it was restarted in place, or finished being
 * (the pool records it and watches again); otherwise the instance is lost and `reason` says why.
 */
export interface WatchInstanceResult {
  reason: string;
  restart?: RestartReport;
}

/** What a watch reports when an instance's restarts differ from what the pool knows: a new stop, or the end of a restart; null: nothing new. */
export function restartChange(known: RestartReport, now: RestartReport): WatchInstanceResult | null {
  if (now.stops > known.stops || (known.recovering && !now.recovering)) return { reason: now.last ?? 'it stopped by itself', restart: now };
  return null;
}

export interface InstanceView {
  id: string;
  /**
   * `draining`: unpublished, and stopped once nothing is in flight on it — an idle instance after
   * the drain grace (unless conversations reach it again), one being replaced (`retiring`) once
   * its answers in flight have ended, or at the drain deadline.
   */
  phase: 'starting' | 'ready' | 'draining' | 'stopping';
  /** The model revision it serves (absent: not said by its runtime). */
  revision?: string;
  /** Why it is being replaced (a newer model revision), while it drains. */
  retiring?: string;
  /** Requests queued or being answered on it, as last reported, while it drains. */
  inFlight?: number;
  subject: string | null;
  leases: number;
  /** False while the pool's reconciler has not reported on it yet (a new instance is not idle before). */
  reported?: boolean;
  /** Set while it is being restarted in place: how it stopped (it serves nothing meanwhile). */
  restarting?: string;
  /** Times it stopped by itself and was restarted in place, and how it last did (absent: never). */
  restarts?: number;
  lastRestart?: string;
}

/** The pool as a whole, as the `MagusPhase` search attribute shows it. */
export type PoolPhase = 'idle' | 'starting' | 'serving' | 'failing';

export interface PoolStatus {
  instances: InstanceView[];
  /** First turns gateways hold for want of an instance with room (their `demand`, e.g. during a cold start). */
  waiting: number;
  /** Set when the runtime cannot start an instance (e.g. no capacity); cleared on success. */
  lastError: string | null;
  /** Instance starts that failed in a row, and when the next may be tried (epoch ms; 0: now). */
  startFailures?: number;
  nextStartAt?: number;
  /**
   * The pool's live conversations, counted by the server for the pool as a whole (with the
   * deletes of the last seconds): its instances' `leases` are then 0, not counted. Absent: the
   * instances' leases are the count.
   */
  live?: number;
}
