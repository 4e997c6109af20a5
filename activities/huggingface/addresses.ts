/**
 * Which addresses a hub may live at: the kinds of address a worker refuses to connect to for a
 * Model's source (loopback, private, link-local, cloud metadata, …), and the operator's list of
 * networks it allows anyway (`MAGUS_HUB_ALLOW_NETWORKS`). Pure: no I/O; network.ts applies it to
 * every connection the hub client makes.
 */
import { BlockList, isIP } from 'node:net';

/** The kinds of address refused unless allowed, each also a keyword of the allow list. */
export const ADDRESS_KINDS = ['loopback', 'private', 'link-local', 'metadata', 'shared', 'unspecified', 'reserved'] as const;
export type AddressKind = (typeof ADDRESS_KINDS)[number];

/** The environment variable an operator allows networks with (named in refusals). */
export const ALLOW_NETWORKS_ENV = 'MAGUS_HUB_ALLOW_NETWORKS';

const DESCRIPTIONS: Record<AddressKind, string> = {
  loopback: 'a loopback address',
  private: 'a private address',
  'link-local': 'a link-local address',
  metadata: 'a cloud metadata address',
  shared: 'a carrier-grade NAT (shared) address',
  unspecified: 'an unspecified address',
  reserved: 'a reserved (multicast, broadcast, documentation or unassigned) address',
};

/** "a link-local address" … for messages. */
export function describeKind(kind: AddressKind): string {
  return DESCRIPTIONS[kind];
}

/**
 * The ranges of each kind, checked in this order (the first match names the kind: metadata
 * addresses sit inside link-local and shared ranges). IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`)
 * match the IPv4 ranges (BlockList maps them); NAT64 and 6to4 addresses are judged by the IPv4
 * address they carry ({@link embeddedIpv4}).
 */
const RANGES: readonly [AddressKind, readonly string[]][] = [
  // AWS, GCP, Azure, Oracle … (169.254.169.254), Azure's wire server, Alibaba, AWS over IPv6.
  ['metadata', ['169.254.169.254/32', '168.63.129.16/32', '100.100.100.200/32', 'fd00:ec2::254/128']],
  ['unspecified', ['0.0.0.0/8', '::/128']],
  ['loopback', ['127.0.0.0/8', '::1/128']],
  ['link-local', ['169.254.0.0/16', 'fe80::/10']],
  // RFC 1918, unique local (fc00::/7), the deprecated site-local (fec0::/10), local-use NAT64.
  ['private', ['10.0.0.0/8', '172.16.0.0/12', '192.168.0.0/16', 'fc00::/7', 'fec0::/10', '64:ff9b:1::/48']],
  ['shared', ['100.64.0.0/10']],
  [
    'reserved',
    [
      '192.0.0.0/24',
      '192.0.2.0/24',
      '198.18.0.0/15',
      '198.51.100.0/24',
      '203.0.113.0/24',
      '224.0.0.0/4',
      '240.0.0.0/4',
      // IPv4-compatible (deprecated), discard-only, documentation, multicast.
      '::/96',
      '100::/64',
      '2001:db8::/32',
      'ff00::/8',
    ],
  ],
];

type Family = 'ipv4' | 'ipv6';

function parseCidr(cidr: string): { address: string; prefix: number; family: Family } | null {
  const slash = cidr.indexOf('/');
  const address = slash < 0 ? cidr : cidr.slice(0, slash);
  const version = isIP(address);
  if (version === 0) return null;
  const max = version === 4 ? 32 : 128;
  const prefixText = slash < 0 ? String(max) : cidr.slice(slash + 1);
  if (!/^\d{1,3}$/.test(prefixText)) return null;
  const prefix = Number(prefixText);
  if (prefix > max) return null;
  return { address, prefix, family: version === 4 ? 'ipv4' : 'ipv6' };
}

function blockList(cidrs: readonly string[]): BlockList {
  const list = new BlockList();
  for (const cidr of cidrs) {
    const c = parseCidr(cidr);
    if (!c) throw new Error(`bad built-in range ${cidr}`);
    list.addSubnet(c.address, c.prefix, c.family);
  }
  return list;
}

const KIND_LISTS: readonly [AddressKind, BlockList][] = RANGES.map(([kind, cidrs]) => [kind, blockList(cidrs)]);

/** An IPv6 address as its eight 16-bit groups (zone id dropped, a trailing dotted quad folded in); null if not IPv6. */
function ipv6Groups(address: string): number[] | null {
  let a = address.replace(/%.*$/, '');
  if (isIP(a) !== 6) return null;
  const quad = /(\d+)\.(\d+)\.(\d+)\.(\d+)$/.exec(a);
  if (quad) {
    const [b0, b1, b2, b3] = quad.slice(1).map(Number) as [number, number, number, number];
    a = `${a.slice(0, quad.index)}${((b0 << 8) | b1).toString(16)}:${((b2 << 8) | b3).toString(16)}`;
  }
  const [head, tail] = a.includes('::') ? (a.split('::') as [string, string]) : [a, null];
  const parse = (s: string): number[] => (s === '' ? [] : s.split(':').map((g) => parseInt(g, 16)));
  const h = parse(head);
  const t = tail === null ? [] : parse(tail);
  return [...h, ...new Array<number>(8 - h.length - t.length).fill(0), ...t];
}

/** The IPv4 address a NAT64 (64:ff9b::/96) or 6to4 (2002::/16) address carries, or null. */
export function embeddedIpv4(address: string): string | null {
  const g = ipv6Groups(address);
  if (!g) return null;
  const quad = (hi: number, lo: number): string => `${hi >> 8}.${hi & 0xff}.${lo >> 8}.${lo & 0xff}`;
  if (g[0] === 0x64 && g[1] === 0xff9b && g[2] === 0 && g[3] === 0 && g[4] === 0 && g[5] === 0) return quad(g[6]!, g[7]!);
  if (g[0] === 0x2002) return quad(g[1]!, g[2]!);
  return null;
}

/** The kind of `address` (an IP literal) that is refused unless allowed, or null for a public address. */
export function addressKind(address: string): AddressKind | null {
  const version = isIP(address.replace(/%.*$/, ''));
  if (version === 0) return 'reserved'; // not an address at all: never connect to it
  const family: Family = version === 4 ? 'ipv4' : 'ipv6';
  for (const [kind, list] of KIND_LISTS) if (list.check(address, family)) return kind;
  const v4 = family === 'ipv6' ? embeddedIpv4(address) : null;
  return v4 === null ? null : addressKind(v4);
}

/**
 * The networks an operator allows despite their kind: kind keywords ({@link ADDRESS_KINDS}) and
 * CIDRs (a bare address is one host). A CIDR allows every address in it, metadata ones included;
 * the keyword `link-local` does not allow `metadata`.
 */
export interface AllowedNetworks {
  /** The entries as given (for messages and logs). */
  readonly entries: readonly string[];
  readonly kinds: ReadonlySet<AddressKind>;
  readonly list: BlockList;
}

/** Nothing allowed: every address of {@link ADDRESS_KINDS} is refused. */
export const NO_ALLOWED_NETWORKS: AllowedNetworks = { entries: [], kinds: new Set(), list: new BlockList() };

/** Parses allow-list entries (trimmed, empty ones skipped); `problems` names each bad entry. */
export function parseAllowedNetworks(entries: readonly string[]): { allowed: AllowedNetworks; problems: string[] } {
  const kinds = new Set<AddressKind>();
  const list = new BlockList();
  const kept: string[] = [];
  const problems: string[] = [];
  for (const raw of entries) {
    const entry = raw.trim();
    if (!entry) continue;
    if ((ADDRESS_KINDS as readonly string[]).includes(entry.toLowerCase())) {
      kinds.add(entry.toLowerCase() as AddressKind);
      kept.push(entry.toLowerCase());
      continue;
    }
    const c = parseCidr(entry);
    if (!c) {
      problems.push(`${JSON.stringify(entry)} is neither a CIDR (10.1.0.0/16, fd00:1::/64, 10.1.2.3) nor one of ${ADDRESS_KINDS.join(', ')}`);
      continue;
    }
    list.addSubnet(c.address, c.prefix, c.family);
    kept.push(entry);
  }
  return { allowed: { entries: kept, kinds, list }, problems };
}

/** Like {@link parseAllowedNetworks}, for a comma-separated value; throws naming the bad entries. */
export function allowedNetworks(spec: string | readonly string[]): AllowedNetworks {
  const { allowed, problems } = parseAllowedNetworks(typeof spec === 'string' ? spec.split(',') : spec);
  if (problems.length > 0) throw new Error(`invalid allowed networks: ${problems.join('; ')}`);
  return allowed;
}

/** Why `address` is refused under `allowed`: its kind, or null when it may be connected to. */
export function refusedKind(address: string, allowed: AllowedNetworks): AddressKind | null {
  const kind = addressKind(address);
  if (kind === null || allowed.kinds.has(kind)) return null;
  const bare = address.replace(/%.*$/, '');
  const family: Family = isIP(bare) === 4 ? 'ipv4' : 'ipv6';
  if (isIP(bare) !== 0 && allowed.list.check(bare, family)) return null;
  const v4 = family === 'ipv6' ? embeddedIpv4(bare) : null;
  if (v4 !== null && allowed.list.check(v4, 'ipv4')) return null;
  return kind;
}
