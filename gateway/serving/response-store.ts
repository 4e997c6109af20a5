/**
 * Stored responses (`POST /v1/responses` with `store` not false): each is one entry of a KV
 * bucket (`magus_responses`, keyed by the response id, its max age the store's TTL), and a chain
 * of them linked by `previous_response_id` is a conversation: a turn walks its chain back to the
 * first response to rebuild the history it sends the engine, and every turn of the chain uses the
 * first response's id as its session id, so all reach the same session and instance (whose KV
 * cache holds the conversation's prefix).
 *
 * A store is one of the gateway's injected services: the KV one (server.ts) and an in-memory one
 * (app tests).
 */
import { randomBytes } from 'node:crypto';
import type { KV } from 'nats';
import { isRevisionConflict } from '../../dataplane';
import { DEFAULT_MAX_PAYLOAD } from '../../dataplane/frames';
import type { ChatMessage } from '../../shared/chat';
import type { ResponseObject } from '../../shared/responses';
import type { ChatInference } from '../../shared/serving';

/** What a response id looks like (`resp_` and a nuid): a KV key, checked before any KV read. */
export const RESPONSE_ID = /^resp_[A-Za-z0-9]{1,64}$/;

/**
 * Most bytes a stored response may keep of its request (input, instructions, tools, metadata,
 * format): every later turn of its chain reads it back, one read per response. Checked before the
 * request is served, so an answer is never generated and then lost. (The answer has no such
 * bound: a record larger than a NATS message is kept in parts, {@link kvResponseStore}.)
 */
export const MAX_STORED_REQUEST_BYTES = 512 * 1024;
/** Most responses one chain may hold: a turn walks it all, one read per response. */
export const MAX_CHAIN_DEPTH = 1_000;

/** One stored response: its answer and what of the conversation it adds. */
export interface StoredResponse {
  /** The owner of the key that created it (plugins/auth.ts `Principal.owner`): no other may read, continue or delete it. A record of an older magus (a `tokenId`, no `owner`) is nobody's. */
  owner: string;
  /** The model it was served by, `namespace/name`. */
  model: string;
  /** The id of its chain's first response: the chain's session id. */
  root: string;
  previous: string | null;
  /** Responses before it in its chain (0 for a first one). */
  depth: number;
  /** This turn's input as chat messages (its instructions not among them: they are not inherited). */
  input: ChatMessage[];
  /** The assistant's answer as chat messages. */
  output: ChatMessage[];
  /** What `GET /v1/responses/{id}` answers. */
  response: ResponseObject;
  /** A background response's run (routes/background.ts): where its answer's frames are while it is `queued` or `in_progress`. */
  run?: BackgroundRun;
}

/** Where a background response's answer is: enough for any gateway replica to read and follow its frames. */
export interface BackgroundRun {
  /** The inference request's id. */
  request: string;
  /** Epoch ms by which it must have been published, or it never will be (its gateway stopped first). */
  publishBy: number;
  /** Whether its text parts carry log-probabilities (the request's `include`). */
  logprobs: boolean;
  /** Set once published: the accepting replica (its reply subject), the instance's pool and the instance, and the request's deadline (epoch ms). */
  replica?: string;
  pool?: string;
  instance?: string;
  deadline?: number;
  /**
   * The engine's request body as the accepting replica sent it (the chat request the response
   * became, streamed): what another replica sends on should the answer have to move with that
   * replica gone (routes/responses.ts, adopting a run). Absent in records of an older magus.
   */
  body?: ChatInference['body'];
}

/** A record's size and age, as a key's storage quota counts it. */
export interface StoredSize {
  /** Bytes of the record as stored. */
  bytes: number;
  /** Epoch ms it was stored at (it expires the store's TTL later). */
  storedAtMs: number;
}

export interface ResponseStore {
  get(id: string): Promise<StoredResponse | undefined>;
  /** The record with its revision, for {@link ResponseStore.replace}. */
  read(id: string): Promise<{ record: StoredResponse; revision: number } | undefined>;
  /** Stores `record` if `id` is still at `revision`: its size, or undefined when another write came first. */
  replace(id: string, record: StoredResponse, revision: number): Promise<StoredSize | undefined>;
  /** Stores `record`; its size as stored. */
  put(id: string, record: StoredResponse): Promise<StoredSize>;
  /** What was deleted; undefined when there was nothing to delete. */
  delete(id: string): Promise<StoredSize | undefined>;
}

/** For tests and a gateway without NATS: kept in this process only, never expiring. */
export function memoryResponseStore(): ResponseStore & { records: Map<string, StoredResponse> } {
  const records = new Map<string, StoredResponse>();
  const sizes = new Map<string, StoredSize>();
  const revisions = new Map<string, number>();
  let revision = 0;
  const put = (id: string, record: StoredResponse): StoredSize => {
    records.set(id, structuredClone(record));
    revisions.set(id, ++revision);
    const size = { bytes: Buffer.byteLength(JSON.stringify(record)), storedAtMs: Date.now() };
    sizes.set(id, size);
    return size;
  };
  return {
    records,
    get: (id) => Promise.resolve(structuredClone(records.get(id))),
    read: (id) => {
      const record = records.get(id);
      return Promise.resolve(record && { record: structuredClone(record), revision: revisions.get(id)! });
    },
    put: (id, record) => Promise.resolve(put(id, record)),
    replace: (id, record, at) => Promise.resolve(revisions.get(id) === at ? put(id, record) : undefined),
    delete: (id) => {
      const size = records.delete(id) ? (sizes.get(id) ?? { bytes: 0, storedAtMs: Date.now() }) : undefined;
      sizes.delete(id);
      return Promise.resolve(size);
    },
  };
}

/** A record as read back, or undefined when it is not one (a store never holds such, but KV is shared). */
function decodeRecord(bytes: Uint8Array): StoredResponse | undefined {
  try {
    const r = JSON.parse(new TextDecoder().decode(bytes)) as Partial<StoredResponse>;
    const ok =
      typeof r.owner === 'string' &&
      typeof r.root === 'string' &&
      typeof r.depth === 'number' &&
      Array.isArray(r.input) &&
      Array.isArray(r.output) &&
      typeof r.response === 'object';
    return ok ? (r as StoredResponse) : undefined;
  } catch {
    return undefined;
  }
}

/** Bytes of a KV value kept back from `max_payload` for the message's headers (a KV put's are small). */
const VALUE_MARGIN_BYTES = 1024;

/**
 * The value stored under a response's id when its record is larger than one KV value may be: the
 * record is in `parts` entries `<prefix>.0` … (`<id>.<nonce>`), `bytes` bytes in all, written
 * before this head. A new head names new parts, so a compare-and-swap of the head replaces the
 * whole record at once, and the old parts are purged after it.
 */
interface SplitHead {
  split: { prefix: string; parts: number; bytes: number };
}

function splitHeadOf(v: unknown): SplitHead['split'] | undefined {
  const split = (v as Partial<SplitHead> | null)?.split;
  return split && typeof split.prefix === 'string' && Number.isSafeInteger(split.parts) && Number.isSafeInteger(split.bytes) ? split : undefined;
}

export interface KvResponseStoreOptions {
  /** The NATS servers' `max_payload` now (the connection's; default 1 MiB): a record larger than a value may be is kept in parts. */
  maxPayload?: () => number | undefined;
}

/**
 * The store on a KV bucket (dataplane/declare.ts `ensureResponsesBucket` gives it its max age). A
 * record is one value; one larger than a NATS message may be (a long answer with its
 * log-probabilities) is kept in parts under a small head ({@link SplitHead}), read back whole.
 */
export function kvResponseStore(kv: KV, opts: KvResponseStoreOptions = {}): ResponseStore {
  /** The value to store under the id for `data`: itself, or a head once its parts are written. */
  const valueOf = async (id: string, data: Uint8Array): Promise<Uint8Array> => {
    const maxValue = (opts.maxPayload?.() ?? DEFAULT_MAX_PAYLOAD) - VALUE_MARGIN_BYTES;
    if (data.length <= maxValue) return data;
    const prefix = `${id}.${randomBytes(8).toString('hex')}`;
    const parts = Math.ceil(data.length / maxValue);
    for (let k = 0; k < parts; k++) await kv.put(`${prefix}.${k}`, data.subarray(k * maxValue, (k + 1) * maxValue));
    const head: SplitHead = { split: { prefix, parts, bytes: data.length } };
    return new TextEncoder().encode(JSON.stringify(head));
  };
  /** Purges the parts a stored value names, if it is a head (best effort: they expire with the bucket's max age anyway). */
  const purgeParts = async (value: Uint8Array | undefined): Promise<void> => {
    const split = value && splitHeadOf(parsed(value));
    if (!split) return;
    for (let k = 0; k < split.parts; k++) await kv.purge(`${split.prefix}.${k}`).catch(() => undefined);
  };
  /** The record a stored value holds (read from its parts when it is a head), and its size as stored. */
  const recordIn = async (value: Uint8Array): Promise<{ record: StoredResponse; bytes: number } | undefined> => {
    const split = splitHeadOf(parsed(value));
    if (!split) {
      const record = decodeRecord(value);
      return record && { record, bytes: value.length };
    }
    const pieces: Uint8Array[] = [];
    for (let k = 0; k < split.parts; k++) {
      const part = await kv.get(`${split.prefix}.${k}`);
      if (!part || part.operation !== 'PUT') return undefined; // expired before its head, or purged by a replace meanwhile
      pieces.push(part.value);
    }
    const whole = Buffer.concat(pieces);
    const record = whole.length === split.bytes ? decodeRecord(whole) : undefined;
    return record && { record, bytes: whole.length };
  };
  const read = async (id: string): Promise<{ record: StoredResponse; revision: number } | undefined> => {
    if (!RESPONSE_ID.test(id)) return undefined;
    const entry = await kv.get(id);
    if (!entry || entry.operation !== 'PUT') return undefined;
    const found = await recordIn(entry.value);
    return found && { record: found.record, revision: entry.revision };
  };
  return {
    get: async (id) => (await read(id))?.record,
    read,
    async put(id, record) {
      const data = new TextEncoder().encode(JSON.stringify(record));
      const storedAtMs = Date.now();
      const before = await kv.get(id);
      await kv.put(id, await valueOf(id, data));
      if (before?.operation === 'PUT') await purgeParts(before.value);
      return { bytes: data.length, storedAtMs };
    },
    async replace(id, record, revision) {
      const data = new TextEncoder().encode(JSON.stringify(record));
      const storedAtMs = Date.now();
      const before = await kv.get(id);
      const value = await valueOf(id, data);
      try {
        await kv.update(id, value, revision);
      } catch (err) {
        if (isRevisionConflict(err)) {
          await purgeParts(value); // this write's own parts: no head names them
          return undefined;
        }
        throw err;
      }
      if (before?.operation === 'PUT' && before.revision === revision) await purgeParts(before.value);
      return { bytes: data.length, storedAtMs };
    },
    async delete(id) {
      if (!RESPONSE_ID.test(id)) return undefined;
      const entry = await kv.get(id);
      if (!entry || entry.operation !== 'PUT') return undefined;
      const split = splitHeadOf(parsed(entry.value));
      // Purged: its value leaves the stream at once (only a marker stays, until the bucket's max age).
      await kv.purge(id);
      await purgeParts(entry.value);
      return { bytes: split ? split.bytes : entry.value.length, storedAtMs: entry.created.getTime() };
    },
  };
}

/** A stored value as JSON, or undefined when it is not JSON. */
function parsed(value: Uint8Array): unknown {
  try {
    return JSON.parse(new TextDecoder().decode(value));
  } catch {
    return undefined;
  }
}

/** Why a chain cannot be continued: its `id` (or an earlier response of it) is gone or not the caller's, or it is too long. */
export type ChainProblem = { problem: 'not_found'; id: string } | { problem: 'too_long' };

/** A chain's conversation: its first response's id, its length, and its messages, oldest first. */
export interface Chain {
  root: string;
  depth: number;
  messages: ChatMessage[];
}

/**
 * The conversation that ends with response `id`, as the key of `owner` may read it: every response
 * of the chain, from the first, must still be stored and be the token's (one read each, at most
 * {@link MAX_CHAIN_DEPTH}).
 */
export async function chainOf(store: ResponseStore, id: string, owner: string): Promise<Chain | ChainProblem> {
  const records: StoredResponse[] = [];
  for (let at: string | null = id; at !== null;) {
    if (records.length >= MAX_CHAIN_DEPTH) return { problem: 'too_long' };
    const record = await store.get(at);
    if (record === undefined || record.owner !== owner) return { problem: 'not_found', id: at };
    if (records.length === 0 && record.depth + 1 >= MAX_CHAIN_DEPTH) return { problem: 'too_long' };
    records.push(record);
    at = record.previous;
  }
  const last = records[0]!;
  return { root: last.root, depth: last.depth + 1, messages: records.reverse().flatMap((r) => [...r.input, ...r.output]) };
}
