/**
 * The backlog pre-check (routes/inference.ts `runTurn`, before a conversation's entry or a key's
 * reservation is made): an instance whose request backlog refused a publish (the stream's
 * per-subject limit, `backlog_full`) is taken as full for {@link FULL_HOLD_MS} after it, and while
 * every instance a model's pool publishes is so, its turns are refused with 429 at once — rather
 * than each costing a `magus_sessions` create and delete (fanned out to every watcher) before its
 * publish is refused all the same.
 */
import type { ReadyModel } from '../../shared/model';
import type { SessionEntry } from '../../shared/serving';

/** How long an instance counts as full after its backlog refused a publish. */
export const FULL_HOLD_MS = 2_000;

export class FullBacklogs {
  /** `<namespace>/<pool>/<instance>` → when its backlog last refused a publish. */
  private readonly refusedAt = new Map<string, number>();

  constructor(
    /** The instances a model's pool publishes (none known: no pre-check). */
    private readonly instancesOf: (model: ReadyModel) => readonly string[] | undefined,
    private readonly now: () => number = Date.now,
  ) {}

  /** The backlog of `session`'s instance refused a publish. */
  refused(session: Pick<SessionEntry, 'namespace' | 'pool' | 'instance'>): void {
    const now = this.now();
    this.refusedAt.set(`${session.namespace ?? 'default'}/${session.pool}/${session.instance}`, now);
    // Kept small: marks past their hold go as new ones come.
    if (this.refusedAt.size > 1024) for (const [k, at] of this.refusedAt) if (now - at >= FULL_HOLD_MS) this.refusedAt.delete(k);
  }

  /** Whether every instance of `model`'s pool refused a publish within {@link FULL_HOLD_MS}. */
  full(model: ReadyModel): boolean {
    const instances = this.instancesOf(model);
    if (!instances || instances.length === 0) return false;
    const now = this.now();
    return instances.every((i) => {
      const at = this.refusedAt.get(`${model.namespace}/${model.name}/${i}`);
      return at !== undefined && now - at < FULL_HOLD_MS;
    });
  }
}
