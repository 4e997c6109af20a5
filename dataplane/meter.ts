/**
 * Signed meters: what proves a usage record (shared/usage.ts) stands for a request a gateway took
 * in for its key. A bridge writes the ledger — it is where an answer ends — and its NATS user may
 * write a record for any key (it serves whoever its instance is sent); without a proof, a bridge
 * could charge another tenant for requests that never were.
 *
 * So each gateway signs the meter of every request it sends — HMAC-SHA256 over the request's id,
 * kind, key, model and start ({@link meterSignature}) — with the data plane's *meter key*, and the
 * bridge copies the signature into the record. Readers that charge (the controller's sums and
 * `ApiKey` status, `magus usage`) leave out a record whose signature is missing or wrong, and say
 * how many. A bridge never sees the key: it is an entry of KV `magus_limits` (`meter.key`; no
 * limit scope's key has a dot), which gateways read and write and the controller reads, and a
 * bridge's user cannot read (roles.ts).
 *
 * What it does not prove: the tokens. The bridge reports what its engine counted, for requests
 * it was really sent; a hostile bridge can overstate those, not invent requests or move them to
 * another key.
 *
 * The key is made once, by the first gateway that finds none (`create`: concurrent gateways agree
 * on the first one written), 32 random bytes with an id; a signature names its key's id
 * (`<id>.<base64url HMAC>`), so a key can be replaced later without voiding old records.
 */
import { createHmac, createSecretKey, randomBytes, timingSafeEqual, type KeyObject } from 'node:crypto';
import type { KV } from 'nats';
import type { UsageRecord } from '../shared/usage';
import { isRevisionConflict } from './errors';

/** The meter key's entry in `magus_limits`. */
export const METER_KEY_ENTRY = 'meter.key';

export interface MeterKey {
  /** Named in each signature (`[a-z0-9]+`). */
  id: string;
  secret: Buffer;
  /** `secret` as a key object, made at the first signature: an HMAC from raw bytes costs ~5× one from a key object (24 against 5 µs here). */
  hmacKey?: KeyObject;
}

/** What a signature covers: the record's fields that a gateway knows when it sends the request. */
export type Metered = Pick<UsageRecord, 'id' | 'kind' | 'key' | 'model' | 'start'>;

const encoder = new TextEncoder();
const decoder = new TextDecoder();

function parseKey(value: Uint8Array): MeterKey | undefined {
  try {
    const v = JSON.parse(decoder.decode(value)) as { id?: unknown; secret?: unknown };
    if (typeof v.id !== 'string' || !/^[a-z0-9]{1,32}$/.test(v.id) || typeof v.secret !== 'string') return undefined;
    const secret = Buffer.from(v.secret, 'base64url');
    return secret.length >= 32 ? { id: v.id, secret } : undefined;
  } catch {
    return undefined;
  }
}

/**
 * The data plane's meter key from `limits` (the `magus_limits` bucket); with `create`, made when
 * there is none (a gateway). Undefined: none yet (no gateway has run) — then no record is signed.
 * Throws when the entry is there but is no key (fails closed: nothing is signed or counted with a
 * key nobody can read).
 */
export async function meterKeyOf(limits: KV, opts: { create: boolean }): Promise<MeterKey | undefined> {
  for (let attempt = 0; attempt < 3; attempt += 1) {
    const e = await limits.get(METER_KEY_ENTRY);
    if (e && e.operation === 'PUT') {
      const key = parseKey(e.value);
      if (!key) throw new Error(`the meter key (KV ${METER_KEY_ENTRY} of the limits bucket) is not a key; delete the entry to make a new one`);
      return key;
    }
    if (!opts.create) return undefined;
    const key: MeterKey = { id: randomBytes(4).toString('hex'), secret: randomBytes(32) };
    try {
      await limits.create(METER_KEY_ENTRY, encoder.encode(JSON.stringify({ id: key.id, secret: key.secret.toString('base64url'), created: Date.now() })));
      return key;
    } catch (err) {
      // Another gateway made it first: read theirs.
      if (!isRevisionConflict(err)) throw err;
    }
  }
  throw new Error('the meter key could not be made or read');
}

const mac = (key: MeterKey, m: Metered): Buffer =>
  createHmac('sha256', (key.hmacKey ??= createSecretKey(key.secret)))
    .update(JSON.stringify([m.id, m.kind, m.key, m.model, m.start]))
    .digest();

/** The signature of `m` under `key`: `<key id>.<base64url HMAC-SHA256>`. */
export const meterSignature = (key: MeterKey, m: Metered): string => `${key.id}.${mac(key, m).toString('base64url')}`;

/** The id of the key a signature names (`<id>.<mac>`); '' when it names none. */
const keyIdOf = (sig: string): string => sig.slice(0, Math.max(0, sig.indexOf('.')));

/** Whether `r` carries a valid signature by `key` (none known: nothing is). */
export function signedBy(key: MeterKey | undefined, r: Metered & { sig?: string }): boolean {
  if (!key || typeof r.sig !== 'string') return false;
  const dot = r.sig.indexOf('.');
  if (dot < 0 || keyIdOf(r.sig) !== key.id) return false;
  const given = Buffer.from(r.sig.slice(dot + 1), 'base64url');
  const expected = mac(key, r);
  return given.length === expected.length && timingSafeEqual(given, expected);
}

/**
 * Checks records' signatures against the data plane's meter key, read from `limits` when first
 * needed and again (at most once a second) when a signature names a key it does not hold — the
 * first gateway may make the key after the reader started.
 */
export class MeterVerifier {
  private key: MeterKey | undefined;
  private readAt = Number.NEGATIVE_INFINITY;

  constructor(
    private readonly limits: KV,
    private readonly clock: () => number = Date.now,
  ) {}

  /** Whether `r` carries a valid signature of a gateway's. */
  async verify(r: Metered & { sig?: string }): Promise<boolean> {
    if (typeof r.sig !== 'string') return false;
    if ((!this.key || this.key.id !== keyIdOf(r.sig)) && this.clock() - this.readAt >= 1000) {
      this.readAt = this.clock();
      this.key = (await meterKeyOf(this.limits, { create: false })) ?? this.key;
    }
    return signedBy(this.key, r);
  }
}
