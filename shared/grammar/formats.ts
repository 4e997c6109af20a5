/**
 * String formats as whole-string regexes (in the dialect of ./regex.ts), each generating only
 * strings that ajv-formats (full mode) accepts — written here from the RFCs, and checked against
 * ajv-formats by the tests. Where ajv-formats is more lenient than the RFC the grammar keeps to
 * the RFC (the answer then also passes stricter validators), and unbounded runs are bounded so a
 * small model cannot loop:
 * - `date` (RFC 3339 full-date): real month lengths, 29 February only in leap years.
 * - `time`: `hh:mm:ss`, an optional fraction of 1–9 digits, a required offset `Z`/`z` or
 *   `±hh:mm` (ajv-formats also takes `+hhmm` and `+hh`; RFC 3339 does not). No leap second `:60`.
 * - `date-time`: a `date`, `T` or `t`, a `time` (not ajv-formats' space separator).
 * - `duration` (RFC 3339 appendix A): `P` with date and/or time parts or weeks, never empty,
 *   a `T` always followed by a part; each number 1–9 digits.
 * - `email`: ajv-formats' full-mode shape; a dot-atom local part of at most 8 atoms of 1–64
 *   characters, a domain of 2–8 labels of 1–63.
 * - `hostname`: labels of letters, digits and inner hyphens, an optional final dot. The total of
 *   253 characters is kept without counting: n labels (1–8) of at most min(63, ⌊(254 − n)/n⌋)
 *   characters each.
 * - `ipv4`: dotted decimal without leading zeros. `ipv6`: RFC 4291 text forms (RFC 3986's
 *   IPv6address), hex in either case, `::` compression, an IPv4 tail.
 * - `uuid`: 8-4-4-4-12 hex digits, either case (not ajv-formats' optional `urn:uuid:` prefix).
 */
import { parseRegex, type Regex } from './regex';

const OCTET = '(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])';
const IPV4 = `${OCTET}(?:\\.${OCTET}){3}`;
const H16 = '[0-9A-Fa-f]{1,4}';
const LS32 = `(?:${H16}:${H16}|${IPV4})`;
/** RFC 3986 IPv6address: at most 8 groups, one `::` standing for one or more zero groups. */
const IPV6 = [
  `(?:${H16}:){6}${LS32}`,
  `::(?:${H16}:){5}${LS32}`,
  `(?:${H16})?::(?:${H16}:){4}${LS32}`,
  `(?:(?:${H16}:){0,1}${H16})?::(?:${H16}:){3}${LS32}`,
  `(?:(?:${H16}:){0,2}${H16})?::(?:${H16}:){2}${LS32}`,
  `(?:(?:${H16}:){0,3}${H16})?::${H16}:${LS32}`,
  `(?:(?:${H16}:){0,4}${H16})?::${LS32}`,
  `(?:(?:${H16}:){0,5}${H16})?::${H16}`,
  `(?:(?:${H16}:){0,6}${H16})?::`,
].join('|');

/** Years divisible by 4, but by 100 only if by 400 (0000 included). */
const BY_FOUR = '(?:0[48]|[2468][048]|[13579][26])';
const LEAP_YEAR = `(?:[0-9]{2}${BY_FOUR}|(?:0[048]|[2468][048]|[13579][26])00)`;
const DATE = [
  '[0-9]{4}-(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])',
  '[0-9]{4}-(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)',
  '[0-9]{4}-02-(?:0[1-9]|1[0-9]|2[0-8])',
  `${LEAP_YEAR}-02-29`,
]
  .map((d) => `(?:${d})`)
  .join('|');
const TIME = '(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])';

const N = '[0-9]{1,9}';
const DURATION_DATE = `(?:${N}Y(?:${N}M)?(?:${N}D)?|${N}M(?:${N}D)?|${N}D)`;
const DURATION_TIME = `(?:${N}H(?:${N}M)?(?:${N}S)?|${N}M(?:${N}S)?|${N}S)`;
const DURATION = `P(?:${DURATION_DATE}(?:T${DURATION_TIME})?|T${DURATION_TIME}|${N}W)`;

const ATEXT = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]";
const DOMAIN_LABEL = '[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?';
const EMAIL = `${ATEXT}{1,64}(?:\\.${ATEXT}{1,64}){0,7}@(?:${DOMAIN_LABEL}\\.){1,7}${DOMAIN_LABEL}`;

/** n labels of at most `max` characters each. */
const labels = (n: number, max: number): string => {
  const label = `[A-Za-z0-9](?:[A-Za-z0-9-]{0,${max - 2}}[A-Za-z0-9])?`;
  return n === 1 ? label : `${label}(?:\\.${label}){${n - 1}}`;
};
const HOSTNAME = `(?:${Array.from({ length: 8 }, (_, i) => labels(i + 1, Math.min(63, Math.floor((254 - (i + 1)) / (i + 1))))).join('|')})\\.?`;

const UUID = '[0-9A-Fa-f]{8}-(?:[0-9A-Fa-f]{4}-){3}[0-9A-Fa-f]{12}';

const SOURCES: Readonly<Record<string, string>> = {
  'date-time': `(?:${DATE})[Tt]${TIME}`,
  date: DATE,
  time: TIME,
  duration: DURATION,
  email: EMAIL,
  hostname: HOSTNAME,
  ipv4: IPV4,
  ipv6: IPV6,
  uuid: UUID,
};

/** The formats the grammar generates. */
export const FORMATS: readonly string[] = Object.keys(SOURCES);

const parsed = new Map<string, Regex>();

/** The whole-string regex of `format` (one of {@link FORMATS}). */
export function formatRegex(format: string): Regex {
  let re = parsed.get(format);
  if (!re) {
    re = parseRegex(SOURCES[format]!, 'format');
    parsed.set(format, re);
  }
  return re;
}
