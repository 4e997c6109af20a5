/**
 * Snapshots of the slots' KV caches in a directory (`magus engine --snapshots DIR`), so that the
 * engine that follows one killed mid-answer (its standby, or the same pod's container restarted)
 * loads what the dead one had evaluated instead of evaluating it again: the prompt and the answer
 * so far of every answer it was generating. Evaluating them again was what a client still waited
 * for after its engine's death — four answers of ~100 tokens on a standby sharing two cores: 2.3–5
 * s (bench/README.md, session 61).
 *
 * A generating slot's sequence is saved (llama.cpp's sequence state file: its tokens, then their
 * KV) whenever it has evaluated {@link EVERY} tokens — or a tenth of what it holds, when that is
 * more: a save copies all of it — since its last save, while it holds no more than its share of
 * `--snapshot-bytes` (a slot past it keeps its last snapshot), between two of its steps, under the
 * context lock (taken as an erasure takes it: decode.ts `Erasures`, the other slots hold one
 * batch). A file is written under a temporary name and renamed, one per slot, in a directory of
 * the process's own under one of the model's (a snapshot is loaded only into the model that made
 * it). A request whose tokens share at least {@link MIN_GAIN} more tokens with a snapshot than
 * with what its slot holds ({@link RESUME_MIN_GAIN} for an answer resumed) loads the one sharing
 * most into its slot (under the context lock) and evaluates only the rest. The loaded KV is the
 * one the dead engine computed, token by token, so the answer goes on exactly as it would have
 * (engine/snapshots.test.ts).
 *
 * An answer cut short by its client (a bridge handing it back at its drain deadline) is saved as
 * it stops, when it has {@link STOP_MIN} tokens unsaved. Other processes' snapshots in the same
 * directory are read at the first request and again for every request that resumes an answer:
 * a dead engine's (its standby serves only once it is dead), and on one machine, where the local
 * runtime gives all its engines one directory, a live one's — an answer handed back by a draining
 * instance goes on on another from the draining engine's snapshot. Directories of processes that
 * are gone are removed {@link INHERITED_MS} after they were found; the process's own stays when
 * it stops (an answer handed back as it drained may be on its way to another engine), for those
 * that follow to remove.
 */
import { createHash } from 'node:crypto';
import { mkdirSync } from 'node:fs';
import { link, mkdir, open, readdir, rename, rm, stat } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import type { LlamaContextSequence, Token } from 'node-llama-cpp' with { 'resolution-mode': 'import' };
import type { Erasures } from './decode';

/** Tokens evaluated since a slot's last save before it is saved again (at least: see the file comment). */
export const EVERY = 32;
/** A save waits until a tenth of what the slot holds is new: a save copies all of it. */
const SHARE = 10;
/**
 * A snapshot is loaded only when it spares this many more tokens than the slot's own cache: a load
 * pauses every slot until the batch under way ends (35–130 ms under bench:chaos), evaluating a
 * few tokens costs one step of a batch.
 */
export const MIN_GAIN = 32;
/**
 * What a resumed answer's load asks instead: its client waits mid-answer for it, and a few
 * resumed at once on an engine (the ones a dead engine's standby takes) evaluate in each other's
 * batches — four answers 1–10 tokens in, their ~30-token prompts below {@link MIN_GAIN}, waited
 * 1.2–1.8 s for their first piece on a standby under bench:chaos, where those that loaded a
 * snapshot waited 0.1–0.5 s. A standby's slots hold nothing, and no batch is under way there for
 * a load to wait for.
 */
export const RESUME_MIN_GAIN = 8;
/** An answer stopped by its client is saved as it stops when this many of its tokens are unsaved. */
export const STOP_MIN = 8;
/** How long another process's snapshots are kept once read: its answers' resumes come within seconds. */
const INHERITED_MS = 60_000;
/** llama.cpp's sequence state file: magic `ggsq`, version (llama.cpp checks it at a load), token count, tokens, then the state. */
const SEQ_MAGIC = 0x67677371;

interface Snapshot {
  file: string;
  tokens: readonly Token[];
}

/** How many leading tokens `a` and `b` share. */
export function sharedPrefix(a: readonly Token[], b: readonly Token[]): number {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i] === b[i]) i++;
  return i;
}

/** The tokens a sequence state file holds (its header), or undefined when it is not one. */
async function tokensOf(file: string): Promise<Token[] | undefined> {
  const handle = await open(file, 'r');
  try {
    const head = Buffer.alloc(12);
    if ((await handle.read(head, 0, 12, 0)).bytesRead < 12) return undefined;
    if (head.readUInt32LE(0) !== SEQ_MAGIC) return undefined;
    const count = head.readUInt32LE(8);
    const body = Buffer.alloc(count * 4);
    if ((await handle.read(body, 0, body.length, 12)).bytesRead < body.length) return undefined;
    return Array.from({ length: count }, (_, i) => body.readUInt32LE(i * 4) as Token);
  } finally {
    await handle.close();
  }
}

export interface SnapshotStats {
  saves: number;
  savedBytes: number;
  /** Requests that loaded a snapshot, and the tokens it spared them. */
  loads: number;
  loadedTokens: number;
  failures: number;
  /** Seconds loads took, from asking for the context to the KV in place. */
  loadSeconds: number;
  /** Seconds saves took, from asking for the context to the file's rename (the slot waits as long; the others a batch). */
  saveSeconds: number;
}

export class KvSnapshots {
  /** This process's directory: `<dir>/<model>/<pid>-<random>`. */
  private readonly own: string;
  private readonly modelDir: string;
  /** Per sequence: its file, and the tokens of its last save. */
  private readonly slots = new Map<LlamaContextSequence, { file: string; saved: readonly Token[] }>();
  /** Other processes' snapshots, as last read (at the first request, and for each resume). */
  private inherited: Promise<Snapshot[]> | undefined;
  /** Directories of processes that are gone, to be removed (once each). */
  private readonly removing = new Set<string>();
  readonly stats: SnapshotStats = { saves: 0, savedBytes: 0, loads: 0, loadedTokens: 0, failures: 0, loadSeconds: 0, saveSeconds: 0 };
  /** A save's bytes per token it holds (learned from the first save: the model's KV per token, and the header). */
  private bytesPerToken: number | undefined;

  /**
   * @param dir the directory shared by an engine and those that follow it
   * @param model identifies the weights (see {@link modelKey}): snapshots of other weights are never read
   * @param maxBytes what the files may take together: a slot holding more than its share is not saved again (its last snapshot stays)
   */
  constructor(
    dir: string,
    model: string,
    private readonly maxBytes: number,
    sequences: readonly LlamaContextSequence[],
    private readonly erasures: Erasures,
    private readonly log: (message: string) => void,
  ) {
    this.modelDir = join(dir, model);
    this.own = join(this.modelDir, `${process.pid}-${createHash('sha256').update(`${Math.random()}${Date.now()}`).digest('hex').slice(0, 8)}`);
    // Only this user reads them: they hold conversations' tokens and their KV.
    mkdirSync(this.own, { recursive: true, mode: 0o700 });
    sequences.forEach((s, i) => this.slots.set(s, { file: join(this.own, `${i}.kv`), saved: [] }));
  }

  /** Whether `sequence` has evaluated enough since its last save to be saved before its next step. */
  due(sequence: LlamaContextSequence): boolean {
    const slot = this.slots.get(sequence);
    if (!slot) return false;
    const held = sequence.contextTokens;
    if (this.bytesPerToken !== undefined && held.length * this.bytesPerToken > this.maxBytes / this.slots.size) return false;
    return held.length - sharedPrefix(slot.saved, held) >= Math.max(EVERY, Math.floor(held.length / SHARE));
  }

  /** Whether `sequence`, stopping, holds enough unsaved to be saved now (an answer handed back: see the file comment). */
  worthSaving(sequence: LlamaContextSequence): boolean {
    const slot = this.slots.get(sequence);
    if (!slot) return false;
    const held = sequence.contextTokens;
    if (this.bytesPerToken !== undefined && held.length * this.bytesPerToken > this.maxBytes / this.slots.size) return false;
    return held.length - sharedPrefix(slot.saved, held) >= STOP_MIN;
  }

  /** Its directory again, should an engine that followed one before it have removed it (see others()). */
  private ownDir(): Promise<unknown> {
    return mkdir(this.own, { recursive: true, mode: 0o700 });
  }

  /** Saves what `sequence` holds (a failure is logged: the answer goes on unsaved). */
  async save(sequence: LlamaContextSequence): Promise<void> {
    const slot = this.slots.get(sequence);
    if (!slot) return;
    const partial = `${slot.file}.partial`;
    const started = performance.now();
    try {
      await this.ownDir();
      const { fileSize, tokens } = await this.erasures.run(async () => {
        const saved = await sequence.saveStateToFile(partial);
        return { ...saved, tokens: [...sequence.contextTokens] };
      });
      await rename(partial, slot.file);
      slot.saved = tokens;
      this.bytesPerToken ??= fileSize / Math.max(1, tokens.length);
      this.stats.saves++;
      this.stats.savedBytes += fileSize;
      this.stats.saveSeconds += (performance.now() - started) / 1000;
    } catch (err) {
      this.stats.failures++;
      slot.saved = [];
      this.log(`KV snapshot of ${basename(slot.file)} not saved: ${(err as Error).message}`);
    }
  }

  /**
   * Loads into `sequence` the snapshot sharing the most leading tokens with `tokens` (what the
   * sequence is to hold before its next evaluation), when it shares at least {@link MIN_GAIN} more
   * than `held` (what the sequence shares with them now) — {@link RESUME_MIN_GAIN} when
   * `resuming`. Returns whether it loaded one: the caller then finds what the sequence shares and
   * erases the rest.
   */
  async restore(sequence: LlamaContextSequence, tokens: readonly Token[], held: number, resuming: boolean): Promise<boolean> {
    const own = [...this.slots.values()].filter((s) => s.saved.length > 0).map((s) => ({ file: s.file, tokens: s.saved, inherited: false }));
    const gain = resuming ? RESUME_MIN_GAIN : MIN_GAIN;
    let best: { file: string; shared: number; inherited: boolean } | undefined;
    /** The most any snapshot shares, worth loading or not (for the line below). */
    let most = 0;
    const all = [...(await this.others(resuming)).map((o) => ({ ...o, inherited: true })), ...own];
    for (const s of all) {
      const shared = sharedPrefix(s.tokens, tokens);
      most = Math.max(most, shared);
      if (shared >= held + gain && shared > (best?.shared ?? 0)) best = { file: s.file, shared, inherited: s.inherited };
    }
    // A resumed answer evaluates its prompt and its tokens said again: rare (an engine's death, a drain), and worth knowing why.
    if (!best && resuming && tokens.length >= held + gain)
      this.log(
        `no KV snapshot for a resumed answer of ${tokens.length} tokens (its slot holds ${held}; of ${all.length} snapshots the closest shares ${most}): evaluated again`,
      );
    if (!best) return false;
    // A name of its own for the file while it loads: the file may be replaced by its next save, or
    // removed with its directory by an engine that found its process gone, after it was listed.
    const loading = join(this.own, `${basename(best.file)}.${process.hrtime.bigint()}.loading`);
    try {
      await this.ownDir();
      await link(best.file, loading);
    } catch (err) {
      this.log(`KV snapshot ${best.file} gone before its load: ${(err as Error).message}`);
      return false;
    }
    const slot = this.slots.get(sequence);
    // Whatever it loads, its own file is not what it holds now: the next save replaces it.
    if (slot) slot.saved = [];
    const started = performance.now();
    /** When the erasure had the context (the wait before it is the batch under way's). */
    let erased = started;
    try {
      await this.erasures.run(async () => {
        // Emptied first: a load that fails before it reads the state (a file llama.cpp does not
        // take) leaves the KV as it was while node-llama-cpp counts the sequence empty, and its next
        // evaluation fails — with it the batch, every slot's answer. A failure after that empties it.
        await sequence.eraseContextTokenRanges([{ start: 0, end: sequence.nextTokenIndex }]);
        erased = performance.now();
        await sequence.loadStateFromFile(loading, { acceptRisk: true });
      });
    } catch (err) {
      this.stats.failures++;
      this.log(`KV snapshot ${best.file} not loaded: ${(err as Error).message}`);
      return true;
    } finally {
      await rm(loading, { force: true });
    }
    const ms = performance.now() - started;
    const shared = sharedPrefix(sequence.contextTokens, tokens);
    this.stats.loads++;
    this.stats.loadedTokens += shared;
    this.stats.loadSeconds += ms / 1000;
    // Rare (after an engine's death or a drain), and what it spared is worth a line; a slot's own, as often as conversations move between slots, is counted only.
    if (best.inherited)
      this.log(
        `loaded the KV snapshot of ${shared} tokens another engine saved (${Math.round(ms)} ms: ${Math.round(erased - started)} waiting for the context, ${Math.round(performance.now() - erased)} loading)`,
      );
    return true;
  }

  /**
   * The other processes' snapshots of this model: read at the first request, and again when
   * `fresh` (a resume: its answer's engine may have saved it since). Directories of processes that
   * are gone — whose pid runs nothing, or is this process's own (a container's restart numbers
   * its processes alike) — are removed {@link INHERITED_MS} after they were found.
   */
  private others(fresh: boolean): Promise<Snapshot[]> {
    if (this.inherited && !fresh) return this.inherited;
    const first = this.inherited === undefined;
    return (this.inherited = (async () => {
      const dirs = (await readdir(this.modelDir).catch(() => [] as string[])).filter((d) => join(this.modelDir, d) !== this.own);
      const found: Snapshot[] = [];
      for (const name of dirs) {
        const d = join(this.modelDir, name);
        for (const file of (await readdir(d).catch(() => [] as string[])).filter((n) => n.endsWith('.kv'))) {
          const tokens = await tokensOf(join(d, file)).catch(() => undefined);
          if (tokens && tokens.length > 0) found.push({ file: join(d, file), tokens });
        }
        const pid = Number(name.split('-')[0]);
        if (!this.removing.has(d) && (pid === process.pid || !running(pid))) {
          this.removing.add(d);
          setTimeout(() => void rm(d, { recursive: true, force: true }), INHERITED_MS).unref();
        }
      }
      if (first && found.length > 0) this.log(`KV snapshots of other engines: ${found.length} (of ${found.reduce((n, s) => n + s.tokens.length, 0)} tokens)`);
      return found;
    })());
  }
}

/** Whether process `pid` runs (one of another user's counts). */
function running(pid: number): boolean {
  if (!Number.isSafeInteger(pid) || pid <= 0) return false;
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/** Identifies a model's weights for {@link KvSnapshots}: its file's name, size and modification time. */
export async function modelKey(path: string): Promise<string> {
  const s = await stat(path);
  return createHash('sha256')
    .update(`${basename(path)}\0${s.size}\0${s.mtimeMs}`)
    .digest('hex')
    .slice(0, 16);
}
