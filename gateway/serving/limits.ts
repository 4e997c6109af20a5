/**
 * A key's limits at the gateway (shared/limits.ts says what they are; dataplane/limits.ts holds
 * them in `magus_limits`, exact across replicas by compare-and-swap). Each request of a limited
 * key is admitted before anything is queued: its worst case is reserved — its prompt's tokens,
 * bounded from its size ({@link promptTokenBound}), plus its `max_tokens`, or, without one, as
 * much as the key has room for, which then becomes the request's `max_tokens` — and settled to
 * what the engine reports it used once the answer ends, fails or is abandoned (the store holds a
 * settle briefly to write it with the key's next admission: one write per request, not two). Its lease is
 * renewed while it runs, so the reservation of a gateway that died is released (charged in full)
 * within a lease. Far from its limits a key's requests are admitted from a slice the store leased
 * (dataplane/limits.ts: no write per request). A refusal is OpenAI's 429 (`rate_limit_exceeded` with a Retry-After computed
 * from the window, or `insufficient_quota`); every admitted answer carries the `x-ratelimit-*`
 * headers.
 */
import type { KeyLimits, RateLimitHeaders } from '../../shared/limits';
import type { ReadyModel } from '../../shared/model';
import { LimitRenewer, type LimitStore } from '../../dataplane/limits';
import { errors, retryAfter, type GatewayError } from '../plugins/errors';

/**
 * Tokens a rendered prompt may hold beyond its request's JSON bytes: a template's fixed text
 * (a default system prompt, a generation prompt) around the messages.
 */
export const PROMPT_BOUND_SLACK = 32;

/**
 * An upper bound of the tokens the engine counts for a request whose engine body is `body`,
 * known before any tokenizer runs: its JSON's UTF-8 bytes plus {@link PROMPT_BOUND_SLACK}. A token
 * of text is at least one byte of it, and each message's JSON syntax (`{"role":"user","content":""}`,
 * 28 bytes) outweighs the special tokens a chat template puts around it.
 */
export const promptTokenBound = (body: unknown): number => Buffer.byteLength(JSON.stringify(body) ?? '') + PROMPT_BOUND_SLACK;

/** The longest context any artifact of `model` is planned for (an answer's prompt and output together never exceed it). */
export function contextLengthOf(model: ReadyModel): number | undefined {
  const lengths = model.memory.map((m) => m.contextLength).filter((n) => Number.isInteger(n) && n > 0);
  return lengths.length > 0 ? Math.max(...lengths) : undefined;
}

/** An admitted request: its headers, what it may generate, and its settlement. */
export interface LimitGrant {
  headers: RateLimitHeaders;
  /** Tokens reserved (prompt bound + output). */
  tokens: number;
  /** Settles it to `used` tokens, or — unknown (the answer failed or was abandoned mid-way) — to all it reserved. Once; never throws. */
  settle(used: number | undefined): void;
}

export interface KeyLimiterOptions {
  /** This gateway replica (whose renewals keep its reservations). */
  replica: string;
  /** A reservation's lease: released this long after its gateway stopped renewing it. */
  leaseMs: number;
  log: { warn: (obj: object, msg: string) => void };
  /** The Retry-After of a 503 when the limits cannot be checked. */
  retryAfterSec: number;
  onRefused?: (code: string) => void;
  /** How long a stored response lives (the responses bucket's max age): its bytes count against a storage quota as long. */
  storedResponsesTtlMs: number;
}

export class KeyLimiter {
  private readonly renewer: LimitRenewer;

  constructor(
    private readonly store: LimitStore,
    private readonly opts: KeyLimiterOptions,
  ) {
    this.renewer = new LimitRenewer(store, opts.replica, opts.leaseMs, {
      onLost: (scope, id) => opts.log.warn({ key: scope, inferenceId: id }, 'a limit reservation lapsed before it was settled (charged in full)'),
      onError: (err) => opts.log.warn({ err }, 'could not renew the limit reservations'),
    });
    this.renewer.start();
  }

  /**
   * Reserves request `id` of the key `scope` (its identity) under its `limits`: `tokens` its worst case, `upTo` the
   * most its output may take when it has no bound of its own. Throws the 429 of a refusal.
   */
  async admit(scope: string, limits: KeyLimits, id: string, want: { tokens: number; upTo?: number; model?: string; storeBytes?: number }): Promise<LimitGrant> {
    const a = await this.store
      .admit(scope, limits, {
        id,
        tokens: want.tokens,
        replica: this.opts.replica,
        leaseMs: this.opts.leaseMs,
        ...(want.upTo !== undefined ? { upTo: want.upTo } : {}),
        ...(want.model !== undefined ? { model: want.model } : {}),
        ...(want.storeBytes !== undefined ? { storeBytes: want.storeBytes } : {}),
      })
      .catch((err: unknown) => {
        // NATS away, or the key's entry contended past the store's attempts: never served unchecked.
        this.opts.log.warn({ err, key: scope, inferenceId: id }, "could not check the key's limits");
        throw errors.unavailable(this.opts.retryAfterSec, "The key's limits cannot be checked now; retry later.");
      });
    if (!a.ok) {
      this.opts.onRefused?.(a.code);
      throw refusal(a.code, a.message, a.retryAfterMs, a.headers);
    }
    this.renewer.track(scope, id);
    let settled = false;
    return {
      headers: a.headers,
      tokens: a.tokens,
      settle: (used) => {
        if (settled) return;
        settled = true;
        void this.store
          .settle(scope, limits, id, used ?? a.tokens)
          .catch((err: unknown) =>
            this.opts.log.warn({ err, key: scope, inferenceId: id }, 'could not settle a limit reservation (it lapses, charged in full)'),
          )
          .finally(() => this.renewer.untrack(scope, id));
      },
    };
  }

  /**
   * Counts `bytes` of a response of `scope` stored at `storedAtMs` against the key's storage quota
   * until it expires — or, `deleted`, no longer. Nothing when the key has no quota. Never throws:
   * a charge that cannot be written is logged (the response stays stored).
   */
  async stored(scope: string, limits: KeyLimits, bytes: number, storedAtMs: number, deleted = false): Promise<void> {
    if (limits.storageBytes === undefined) return;
    await this.store
      .storage(scope, limits, { bytes, expiresAtMs: storedAtMs + this.opts.storedResponsesTtlMs, release: deleted })
      .catch((err: unknown) => this.opts.log.warn({ err, key: scope, bytes, deleted }, "could not count a stored response against the key's storage quota"));
  }

  /**
   * Stops renewing and writes the settles the store holds (dataplane/limits.ts holds each for the
   * key's next write, briefly), then closes the store: reservations not settled by then lapse
   * after their lease. Settles after it are written at once.
   */
  async stop(): Promise<void> {
    await this.renewer.stop();
    await this.store.close();
  }
}

/** OpenAI's 429 for a refusal: its Retry-After (none when waiting cannot help) and `x-should-retry: false` when a retry could not succeed soon. */
function refusal(code: 'rate_limit_exceeded' | 'insufficient_quota', message: string, retryAfterMs: number | null, headers: RateLimitHeaders): GatewayError {
  const soon = retryAfterMs !== null && retryAfterMs <= 60_000;
  return errors.limited(code, message, {
    ...headers,
    ...(retryAfterMs !== null ? { ...retryAfter(retryAfterMs / 1000), 'retry-after-ms': String(Math.ceil(retryAfterMs)) } : {}),
    ...(soon ? {} : { 'x-should-retry': 'false' }),
  });
}
