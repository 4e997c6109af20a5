/**
 * Terminal progress for long operations: a redrawn bar with counts, rate and ETA on a TTY, fitted
 * to the terminal's width by dropping whole fields (never cutting one); plain lines (at most one
 * every few seconds, plus the last) when output is a file or a pipe.
 */
import { formatBytes } from '../shared/format';

export interface ProgressState {
  /** Bytes, when the work is measured in bytes (a transfer, a conversion's input). */
  bytesDone?: number;
  bytesTotal?: number;
  /** e.g. tensors or files: counts, never shown as bytes. */
  itemsDone: number;
  itemsTotal: number;
  itemLabel: string;
  /**
   * Of the whole operation, 0–1, when it is more than these counters (e.g. one artifact of
   * several); default bytes, else items. The bar never goes back within one bar (until `finish`).
   */
  fraction?: number;
  /** Which step this is, e.g. `gguf:q80 (2/2)`. */
  label?: string;
  /** What is being worked on now. */
  current?: string;
}

export { formatBytes };

export function formatDuration(sec: number): string {
  if (!Number.isFinite(sec) || sec < 0) return '--:--';
  const s = Math.round(sec);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const r = String(s % 60).padStart(2, '0');
  return h > 0 ? `${h}:${String(m).padStart(2, '0')}:${r}` : `${m}:${r}`;
}

/** A field of the line; the lowest `keep` goes first when the line is too wide. */
interface Field {
  text: string;
  keep: number;
}

const BAR_MAX = 30;
const BAR_MIN = 10;
/** The bar's rank among the fields: it goes before the counts, after `current`. */
const BAR_KEEP = 2;

/**
 * Lays out fields in their order within `width` columns: drops whole fields, lowest `keep`
 * first, and gives the bar what is left (up to {@link BAR_MAX}), or drops it below {@link BAR_MIN}.
 */
export function fitLine(fields: Field[], width: number, frac: number | undefined): string {
  let kept = [...fields];
  let bar = frac !== undefined;
  for (;;) {
    const text = kept.map((f) => f.text).join('  ');
    if (bar) {
      const barWidth = Math.min(BAR_MAX, width - text.length - 3);
      if (barWidth >= BAR_MIN) {
        const filled = Math.round(frac! * barWidth);
        return `[${'#'.repeat(filled)}${'-'.repeat(barWidth - filled)}] ${text}`;
      }
    }
    if (!bar && text.length <= width) return text;
    const lowest = kept.reduce<Field | undefined>((low, f) => (low === undefined || f.keep < low.keep ? f : low), undefined);
    if (bar && (lowest === undefined || lowest.keep > BAR_KEEP)) bar = false;
    else if (lowest === undefined || kept.length === 1) return text;
    else kept = kept.filter((f) => f !== lowest);
  }
}

export class TerminalProgress {
  private started = Date.now();
  private lastDraw = 0;
  private lastLine = '';
  /** The highest fraction drawn in this bar: what it shows never goes back. */
  private shown = 0;
  /** Where the rate is measured from; again when the counter (or its label) starts over. */
  private rateBase: { at: number; done: number; label: string | undefined } | undefined;

  constructor(
    private readonly out: NodeJS.WriteStream = process.stderr,
    private readonly plainEveryMs = 5000,
  ) {}

  private get tty(): boolean {
    return Boolean(this.out.isTTY);
  }

  /** The terminal's width: the stream's own, else stdout's (same terminal), else 80. */
  private columns(): number {
    return this.out.columns || process.stdout.columns || 80;
  }

  /**
   * One line for `s`: on a TTY within `columns` − 1 (the last column would wrap), else every
   * field. Exported for tests; it also advances the bar's "never back" mark.
   */
  render(s: ProgressState, now = Date.now(), columns = this.tty ? this.columns() : Number.POSITIVE_INFINITY): string {
    const bytes = s.bytesTotal !== undefined;
    const own = bytes ? (s.bytesTotal! > 0 ? s.bytesDone! / s.bytesTotal! : 0) : s.itemsTotal > 0 ? s.itemsDone / s.itemsTotal : 0;
    const frac = Math.max(this.shown, Math.min(1, Math.max(0, s.fraction ?? own)));
    this.shown = frac;

    const counted = bytes ? s.bytesDone! : s.itemsDone;
    const base = this.rateBase;
    if (!base || base.label !== s.label || counted < base.done) this.rateBase = { at: now, done: counted, label: s.label };
    const since = (now - this.rateBase!.at) / 1000;
    const rate = since > 0 ? (counted - this.rateBase!.done) / since : 0;
    const elapsed = (now - this.started) / 1000;
    // From the overall fraction, so it covers the steps still to come, not just this counter.
    const eta = frac > 0 && elapsed > 0 ? (elapsed / frac) * (1 - frac) : Number.NaN;

    const fields: (Field | undefined)[] = [
      { text: `${(frac * 100).toFixed(1).padStart(5)}%`, keep: 9 },
      s.label ? { text: s.label, keep: 8 } : undefined,
      { text: `${s.itemsDone}/${s.itemsTotal} ${s.itemLabel}`, keep: 7 },
      bytes ? { text: `${formatBytes(s.bytesDone!)}/${formatBytes(s.bytesTotal!)}`, keep: 5 } : undefined,
      { text: bytes ? `${formatBytes(rate)}/s` : `${rate.toFixed(rate < 10 ? 1 : 0)} ${s.itemLabel}/s`, keep: 3 },
      { text: `ETA ${formatDuration(eta)}`, keep: 6 },
      s.current ? { text: s.current, keep: 1 } : undefined,
    ];
    return fitLine(
      fields.filter((f): f is Field => f !== undefined),
      Number.isFinite(columns) ? columns - 1 : Number.POSITIVE_INFINITY,
      this.tty ? frac : undefined,
    );
  }

  update(s: ProgressState): void {
    const now = Date.now();
    const done = (s.fraction ?? 0) >= 1 || ((s.bytesTotal === undefined || s.bytesDone! >= s.bytesTotal) && s.itemsDone >= s.itemsTotal);
    if (this.tty) {
      if (now - this.lastDraw < 100 && !done) return;
      const line = this.render(s, now);
      // Clear what a longer line before left (ESC [ K: to the end of the line).
      this.out.write(`\r${line}\x1b[K`);
      this.lastLine = line;
    } else {
      if (now - this.lastDraw < this.plainEveryMs && !done) return;
      const line = this.render(s, now);
      if (line === this.lastLine) return;
      this.out.write(`${line}\n`);
      this.lastLine = line;
    }
    this.lastDraw = now;
  }

  /** Ends the bar's line on a TTY; the next update starts a new bar (from 0, its own ETA). */
  finish(): void {
    if (this.tty && this.lastLine) this.out.write('\n');
    this.lastLine = '';
    this.shown = 0;
    this.rateBase = undefined;
    this.started = Date.now();
  }
}
