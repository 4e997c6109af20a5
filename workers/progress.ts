/**
 * Terminal progress for long operations: a redrawn bar with bytes, items, rate and ETA on a TTY;
 * plain lines (at most one every few seconds, plus the last) when output is a file or a pipe.
 */
export interface ProgressState {
  bytesDone: number;
  bytesTotal: number;
  /** e.g. tensors or files */
  itemsDone: number;
  itemsTotal: number;
  itemLabel: string;
  /** What is being worked on now. */
  current?: string;
}

const UNITS = ['B', 'KB', 'MB', 'GB', 'TB'];
export function formatBytes(n: number): string {
  let i = 0;
  while (n >= 1000 && i < UNITS.length - 1) {
    n /= 1000;
    i++;
  }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${UNITS[i]}`;
}

export function formatDuration(sec: number): string {
  if (!Number.isFinite(sec) || sec < 0) return '--:--';
  const s = Math.round(sec);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const r = String(s % 60).padStart(2, '0');
  return h > 0 ? `${h}:${String(m).padStart(2, '0')}:${r}` : `${m}:${r}`;
}

export class TerminalProgress {
  private readonly started = Date.now();
  private lastDraw = 0;
  private lastLine = '';

  constructor(
    private readonly out: NodeJS.WriteStream = process.stderr,
    private readonly plainEveryMs = 5000,
  ) {}

  private get tty(): boolean {
    return Boolean(this.out.isTTY);
  }

  /** Renders one line of text for `s` (exported for tests through {@link render}). */
  render(s: ProgressState, now = Date.now()): string {
    const elapsed = (now - this.started) / 1000;
    const frac = s.bytesTotal > 0 ? Math.min(1, s.bytesDone / s.bytesTotal) : 0;
    const rate = elapsed > 0 ? s.bytesDone / elapsed : 0;
    const eta = rate > 0 ? (s.bytesTotal - s.bytesDone) / rate : Number.NaN;
    const pct = `${(frac * 100).toFixed(1).padStart(5)}%`;
    const parts = [
      pct,
      `${formatBytes(s.bytesDone)}/${formatBytes(s.bytesTotal)}`,
      `${s.itemsDone}/${s.itemsTotal} ${s.itemLabel}`,
      `${formatBytes(rate)}/s`,
      `ETA ${formatDuration(eta)}`,
    ];
    if (this.tty) {
      const width = 24;
      const filled = Math.round(frac * width);
      return `[${'#'.repeat(filled)}${'-'.repeat(width - filled)}] ${parts.join('  ')}${s.current ? `  ${s.current}` : ''}`;
    }
    return parts.join('  ');
  }

  update(s: ProgressState): void {
    const now = Date.now();
    const done = s.bytesDone >= s.bytesTotal && s.itemsDone >= s.itemsTotal;
    if (this.tty) {
      if (now - this.lastDraw < 100 && !done) return;
      const line = this.render(s, now);
      const cols = this.out.columns ?? 120;
      this.out.write(`\r${line.slice(0, cols - 1).padEnd(Math.min(cols - 1, this.lastLine.length))}`);
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

  /** Ends the bar's line on a TTY. */
  finish(): void {
    if (this.tty && this.lastLine) this.out.write('\n');
  }
}
