/**
 * The `modelPipeline` workflow's state: what the handlers change and the `progress` query reads.
 * Deterministic: time comes from the workflow SDK's `Date`.
 */
import type { ModelPipelineInput, ModelSpec, ReadyModel, SourceFile } from '../../shared/model';
import type { ActivityProgress, ActivityRetry, CancelOptions, PipelinePhase, PipelineProgress, ResourceChange } from './definitions';

export class PipelineState {
  readonly namespace: string;
  readonly name: string;
  spec: ModelSpec;
  generation = 1;
  cancelled = false;
  /** What the cancel asked for beyond stopping (the controller, when its `Model` goes away). */
  cancelOptions: CancelOptions = {};
  sha: string | null = null;
  /** The `Model` resource this pipeline reports to, and the generation of it taken in. */
  resource: { uid: string; generation: number } | null;
  /** What the last completed plan published (its artifacts and memory plan go into the resource's status). */
  ready: ReadyModel | null = null;
  private phase: PipelinePhase = 'resolving';
  private failure: PipelineProgress['failure'] = null;
  private files: SourceFile[] = [];
  /** Paths of transferred files (a late progress signal for one of them is ignored). */
  private readonly doneFiles = new Set<string>();
  /** Bytes of finished files, and in-flight progress per activity key. */
  private bytesFinished = 0;
  private readonly inFlight = new Map<string, ActivityProgress>();
  private readonly converted = new Map<string, ActivityProgress>();
  /** Rate samples for the ETA: [time ms, bytes or tensors done] at phase start and now. */
  private phaseStart: { at: number; done: number } = { at: Date.now(), done: 0 };
  private cancelledDone = false;
  /** The step being retried after a failed attempt, if any (see `PipelineProgress.retrying`). */
  private retrying: ActivityRetry | null = null;
  /** Called after every change of state (the workflow keeps the UI's view in step). */
  onChange: () => void = () => undefined;

  constructor(input: ModelPipelineInput) {
    this.namespace = input.namespace;
    this.name = input.name;
    this.spec = input.spec;
    this.resource = input.resource ? { ...input.resource } : null;
  }

  /**
   * A generation of the `Model` resource. One already taken in is ignored (signal-with-start
   * sends each one once, but a restarted controller may send it again); a new uid is a new
   * resource under the same name, so the plan starts over even if the spec is the same.
   */
  applyResource(change: ResourceChange): void {
    const known = this.resource;
    if (known && known.uid === change.uid && change.generation <= known.generation) return;
    this.resource = { uid: change.uid, generation: change.generation };
    if (known && known.uid !== change.uid) {
      this.spec = change.spec;
      this.ready = null;
      this.generation++;
    } else {
      this.changeSpec(change.spec);
    }
    this.onChange();
  }

  /**
   * Takes a new spec (validated when the plan re-runs). The same spec again is ignored unless the
   * last run failed: re-sending it is how a user retries, e.g. after being granted access.
   */
  changeSpec(spec: ModelSpec): void {
    if (JSON.stringify(spec) === JSON.stringify(this.spec) && this.phase !== 'failed') return;
    this.spec = spec;
    this.generation++;
    this.onChange();
  }

  cancel(options: CancelOptions = {}): void {
    if (options.uid !== undefined && this.resource !== null && this.resource.uid !== options.uid) return;
    this.cancelled = true;
    this.cancelOptions = { ...this.cancelOptions, ...options };
    this.onChange();
  }

  markCancelled(): void {
    this.cancelledDone = true;
    this.phase = 'cancelled';
    this.onChange();
  }

  enter(phase: PipelinePhase): void {
    this.phase = phase;
    this.failure = null;
    this.retrying = null;
    this.phaseStart = { at: Date.now(), done: this.phaseDone() };
    if (phase === 'resolving') {
      this.ready = null;
      this.files = [];
      this.doneFiles.clear();
      this.bytesFinished = 0;
      this.inFlight.clear();
      this.converted.clear();
    }
    this.onChange();
  }

  planned(sha: string, files: SourceFile[]): void {
    this.sha = sha;
    this.files = files;
    this.onChange();
  }

  fileDone(file: SourceFile): void {
    if (this.doneFiles.has(file.path)) return;
    this.doneFiles.add(file.path);
    this.bytesFinished += file.size;
    this.inFlight.delete(`transfer:${file.path}`);
    if (this.retrying?.key === file.path) this.retrying = null;
    this.onChange();
  }

  /** A step completed: a retry of it is over (a transfer's end is {@link fileDone}). */
  stepDone(key: string): void {
    if (this.retrying?.key !== key) return;
    this.retrying = null;
    this.onChange();
  }

  /** An attempt failed and will be retried (ignored once the pipeline has stopped working). */
  onActivityFailed(f: ActivityRetry): void {
    if (this.phase === 'ready' || this.phase === 'failed' || this.cancelledDone) return;
    // Signals are asynchronous: an older attempt's report never replaces a newer one of the same step.
    const r = this.retrying;
    if (r && r.activity === f.activity && r.key === f.key && r.attempt > f.attempt) return;
    this.retrying = { ...f };
    this.onChange();
  }

  fail(type: string, message: string): void {
    this.failure = { type, message, during: this.phase };
    this.retrying = null;
    this.phase = 'failed';
    this.onChange();
  }

  onActivityProgress(p: ActivityProgress): void {
    // Signals are sent asynchronously: one may arrive after its file's activity completed.
    // (Such a late transfer report is dropped: it once fell through to the conversion's counts, so
    // the `progress` query showed bytes as tensors after a delayed signal.)
    if (p.kind === 'transfer') {
      if (!this.doneFiles.has(p.key)) this.inFlight.set(`transfer:${p.key}`, p);
    } else this.converted.set(p.key, p);
    this.onChange();
  }

  private phaseDone(): number {
    return this.phase === 'converting' ? this.tensors().done : this.bytes().done;
  }

  private bytes(): { done: number; total: number } {
    let done = this.bytesFinished;
    for (const p of this.inFlight.values()) done += p.done;
    return { done, total: this.files.reduce((n, f) => n + f.size, 0) };
  }

  private tensors(): { done: number; total: number } {
    let done = 0;
    let total = 0;
    for (const p of this.converted.values()) {
      done += p.done;
      total += p.total;
    }
    return { done, total };
  }

  /**
   * What the `progress` query answers: {@link progress} plus each artifact's conversion, so a
   * client can show per-artifact progress (the sum alone grows when the next artifact starts).
   * Kept out of {@link progress}, which also feeds the `Model` status.
   */
  query(): PipelineProgress {
    return { ...this.progress(), artifacts: [...this.converted.values()].map((p) => ({ key: p.key, done: p.done, total: p.total })) };
  }

  progress(): PipelineProgress {
    const bytes = this.bytes();
    const tensors = this.tensors();
    let etaSeconds: number | null = null;
    const active = this.phase === 'transferring' ? bytes : this.phase === 'converting' ? tensors : null;
    if (active && active.total > 0) {
      const elapsed = (Date.now() - this.phaseStart.at) / 1000;
      const rate = elapsed > 0 ? (active.done - this.phaseStart.done) / elapsed : 0;
      if (rate > 0) etaSeconds = Math.round((active.total - active.done) / rate);
    }
    return {
      phase: this.cancelledDone ? 'cancelled' : this.phase,
      generation: this.generation,
      repo: this.spec.source.repo,
      sha: this.sha,
      files: { done: this.doneFiles.size, total: this.files.length },
      bytes,
      tensors,
      etaSeconds,
      failure: this.failure,
      ...(this.retrying ? { retrying: this.retrying } : {}),
      ...(this.resource ? { observedGeneration: this.resource.generation } : {}),
    };
  }
}
