/**
 * NATS users per role: what each magus process may publish and subscribe to in one data plane,
 * as nats-server permissions, and the credentials it connects with (a user JWT signed by the
 * data plane's account, and the user's nkey seed: the server holds neither, it trusts the
 * account). A role gets the subjects of its own work and nothing else, so that — whatever else
 * reaches NATS — prompts, answers, tokens and stored responses are read only by the processes
 * that serve them. Bridges run in tenants' namespaces: each instance's bridge is a user of its
 * own, made when the instance is ({@link bridgeCredentialsText}), that reads only its instance's
 * requests:
 *
 * | role | may | may not |
 * |---|---|---|
 * | `gateway` | publish requests and cancels; read frames of its replicas and bridges' beats; KV sessions, responses (declares it), limits, usage (records what it gave up on), claims (ends those of requests it moved away from a silent bridge); read tokens, models, pools | consume the request stream; write tokens, the registry, pools |
 * | `bridge` (one user per instance) | consume its instance's requests and cancels; publish its instance's frames (and read them back) and beats; KV its instance's claims; write usage records | read other instances' requests, frames or claims; read usage, tokens, responses, sessions, limits; write the registry |
 * | `controller` | KV tokens, sessions (mirror), usage sums; read usage, limits, models | publish or consume requests and frames |
 * | `worker` | everything: it declares the data plane, runs pipelines and instances | |
 *
 * Every role's replies come to an inbox of its own (`_INBOX_<role>.…`, a bridge's
 * `_INBOX_bridge_<pool>_<instance>.…`; nats.js `inboxPrefix`): no user can subscribe to
 * another's, where KV reads, JetStream acknowledgements and pulled requests arrive.
 *
 * A bridge publishes and reads back only its own instance's frames (the request asks for them on
 * `magus.res.<replica>.<pool>.<instance>.<id>`, InferenceRequest `instanceFrames`) and claims
 * (`<pool>.<instance>.<id>`), and writes the ledger without reading it. It may write a usage
 * record for any key (it records the usage of whoever its instance served), but only a record
 * carrying the signature of a gateway's request counts (meter.ts: the key is in `magus_limits`,
 * which a bridge cannot read).
 *
 * The JetStream API is granted per stream (`$JS.API.<verb>.<stream>…`), never as `$JS.API.>`,
 * so a role that may read one bucket cannot create a consumer on another.
 */
import { readFileSync } from 'node:fs';
import { decode, encodeAccount, encodeOperator, encodeUser, fmtCreds } from '@nats-io/jwt';
import { createAccount, createOperator, createUser, fromSeed } from '@nats-io/nkeys';
import { createInbox, jwtAuthenticator, type Authenticator, type ConnectionOptions, type NatsConnection } from 'nats';
import type { DataPlaneNames } from './names';
import { claimKeyOf } from './claims';
import {
  beatSubjectOf,
  cancelSubjectOf,
  consumerNameOf,
  instanceResponseSubjectOf,
  laneConsumerNameOf,
  laneSubjectOf,
  LANES,
  requestSubjectOf,
  scopedSubject,
} from './names';
import { Nats } from '../shared/constants';

export const NATS_ROLES = ['gateway', 'bridge', 'controller', 'worker'] as const;
export type NatsRole = (typeof NATS_ROLES)[number];

/** nats-server permissions of one user: the subjects it may publish to and subscribe to. */
export interface NatsPermissions {
  publish: { allow: string[] };
  subscribe: { allow: string[] };
}

/** The inbox prefix of `role`'s connections (nats.js `inboxPrefix`): its replies, and no one else's. */
export const inboxPrefixOf = (role: NatsRole): string => `_INBOX_${role}`;

const api = (s: string): string => `$JS.API.${s}`;

/** Reading stream `stream`: its info, direct and stored gets, and consumers of its own (ordered ones, watches) with their flow control and acks. */
function streamRead(stream: string): string[] {
  return [
    api(`STREAM.INFO.${stream}`),
    api(`STREAM.MSG.GET.${stream}`),
    api(`DIRECT.GET.${stream}`),
    api(`DIRECT.GET.${stream}.>`),
    api(`CONSUMER.CREATE.${stream}`),
    api(`CONSUMER.CREATE.${stream}.>`),
    api(`CONSUMER.INFO.${stream}.>`),
    api(`CONSUMER.DELETE.${stream}.>`),
    api(`CONSUMER.MSG.NEXT.${stream}.>`),
    `$JS.ACK.${stream}.>`,
    `$JS.FC.${stream}.>`,
  ];
}

/** Declaring stream `stream` (create, or bring its configuration up to date). */
const streamDeclare = (stream: string): string[] => [api(`STREAM.CREATE.${stream}`), api(`STREAM.UPDATE.${stream}`)];

/** Reading KV bucket `bucket`: gets, keys, watches. */
const kvRead = (bucket: string): string[] => streamRead(`KV_${bucket}`);
/** Reading and writing KV bucket `bucket` (put, create, update, delete, purge: publishes to `$KV.<bucket>.<key>`). */
const kvWrite = (bucket: string): string[] => [...kvRead(bucket), `$KV.${bucket}.>`];

/** The permissions of `role` in the data plane `names`. */
export function rolePermissions(role: Exclude<NatsRole, 'bridge'>, names: DataPlaneNames): NatsPermissions {
  const inbox = `${inboxPrefixOf(role)}.>`;
  const req = scopedSubject(names, `${Nats.requestSubjectPrefix}.>`);
  const res = scopedSubject(names, `${Nats.responseSubjectPrefix}.>`);
  const cancel = scopedSubject(names, `${Nats.cancelSubjectPrefix}.>`);
  const beats = scopedSubject(names, `${Nats.beatSubjectPrefix}.>`);
  const replicas = scopedSubject(names, `${Nats.gatewayReplicaSubjectPrefix}.>`);
  const common = [api('INFO')];
  switch (role) {
    case 'gateway':
      return {
        publish: {
          allow: [
            ...common,
            req,
            cancel,
            ...kvWrite(names.sessionsBucket),
            ...kvWrite(names.responsesBucket),
            ...streamDeclare(`KV_${names.responsesBucket}`),
            ...kvWrite(names.limitsBucket),
            ...kvWrite(names.usageBucket),
            // Ends the claims of requests whose answers it moved away from a silent bridge (claims.ts `endClaim`).
            ...kvWrite(names.claimsBucket),
            ...kvRead(names.tokensBucket),
            ...kvRead(names.modelsBucket),
            ...kvRead(names.poolsBucket),
            // Frames it missed are read back from the response stream; its consumer is its own.
            ...streamRead(names.responseStream),
            api(`STREAM.INFO.${names.requestStream}`),
            // Whether another replica is gone (gateway/serving/replicas.ts).
            replicas,
          ],
        },
        // Bridges' beats: an answer whose bridge stops beating is continued elsewhere. Its own replica subject, held while it runs.
        subscribe: { allow: [inbox, res, beats, replicas] },
      };
    case 'controller':
      return {
        publish: {
          allow: [
            ...common,
            ...kvWrite(names.tokensBucket),
            ...kvWrite(names.sessionsBucket),
            ...kvWrite(names.usageSumsBucket),
            ...kvRead(names.usageBucket),
            ...kvRead(names.limitsBucket),
            ...kvRead(names.modelsBucket),
          ],
        },
        subscribe: { allow: [inbox] },
      };
    case 'worker':
      return { publish: { allow: ['>'] }, subscribe: { allow: ['>'] } };
  }
}

/** The inbox prefix of the bridge of instance `instance` of pool `pool`: its replies (its pulled requests among them), and no other bridge's. */
export const bridgeInboxPrefixOf = (pool: string, instance: string): string => `${inboxPrefixOf('bridge')}_${consumerNameOf(pool, instance)}`;

/**
 * The permissions of the bridge of instance `instance` of pool `pool`: its own requests and
 * nothing else of the request stream. It pulls from its instance's durable consumers only
 * (its requests', and its lanes': the answers moved to it, the requests handed back to it; the
 * creation subject names the consumer *and* its filter, so it cannot widen it), acknowledges its deliveries, hears its instance's cancels and
 * its consumers' leader elections, and gets its
 * replies on an inbox of its own (a pulled request arrives there). It publishes frames, reads
 * frames back for a redelivered request (the response stream), and writes claims and usage.
 */
export function bridgePermissions(names: DataPlaneNames, pool: string, instance: string): NatsPermissions {
  const durable = consumerNameOf(pool, instance);
  const stream = names.requestStream;
  const responses = names.responseStream;
  // Its instance's frames, magus.res.<replica>.<pool>.<instance>.<id>, of any replica and request.
  const frames = instanceResponseSubjectOf(scopedSubject(names, `${Nats.responseSubjectPrefix}.*.*`), '*', pool, instance);
  // Its instance's claims, <pool>.<instance>.<id>.
  const claims = `$KV.${names.claimsBucket}.${claimKeyOf({ pool, instance }, '>')}`;
  return {
    publish: {
      allow: [
        api('INFO'),
        frames,
        beatSubjectOf(names, pool, instance),
        api(`CONSUMER.INFO.${stream}.${durable}`),
        api(`CONSUMER.MSG.NEXT.${stream}.${durable}`),
        api(`CONSUMER.CREATE.${stream}.${durable}.${requestSubjectOf(names, pool, instance)}`),
        `$JS.ACK.${stream}.${durable}.>`,
        // The same for its lanes (names.ts LANES).
        ...LANES.flatMap((lane) => {
          const name = laneConsumerNameOf(pool, instance, lane);
          return [
            api(`CONSUMER.INFO.${stream}.${name}`),
            api(`CONSUMER.MSG.NEXT.${stream}.${name}`),
            api(`CONSUMER.CREATE.${stream}.${name}.${laneSubjectOf(names, pool, instance, lane)}`),
            `$JS.ACK.${stream}.${name}.>`,
          ];
        }),
        // Reading its own frames back (response-stream.ts): a direct get and an ordered consumer,
        // each naming the subject in the request's subject. The ordered consumer's pulls, info and
        // delete go by its name, random per read (nats.js: a NUID), which no other user learns.
        api(`STREAM.INFO.${responses}`),
        api(`DIRECT.GET.${responses}.${frames}`),
        api(`CONSUMER.CREATE.${responses}.*.${frames}`),
        api(`CONSUMER.MSG.NEXT.${responses}.*`),
        api(`CONSUMER.INFO.${responses}.*`),
        api(`CONSUMER.DELETE.${responses}.*`),
        // Its claims: bind, get (direct, by key), create and update.
        api(`STREAM.INFO.KV_${names.claimsBucket}`),
        api(`DIRECT.GET.KV_${names.claimsBucket}.${claims}`),
        claims,
        // The ledger, write-only: bind, and create a record (usage.ts writes without reading).
        api(`STREAM.INFO.KV_${names.usageBucket}`),
        `$KV.${names.usageBucket}.>`,
      ],
    },
    subscribe: {
      allow: [
        `${bridgeInboxPrefixOf(pool, instance)}.>`,
        cancelSubjectOf(names, pool, instance),
        `$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.${stream}.${durable}`,
        ...LANES.map((lane) => `$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.${stream}.${laneConsumerNameOf(pool, instance, lane)}`),
      ],
    },
  };
}

/**
 * What signs a data plane's NATS users (`magus nats-auth` makes it): nats-server runs in operator
 * mode, trusting the operator's JWT and, through it, one account (JetStream enabled) whose users
 * are signed by `signerSeed`, an account signing key. Whoever holds that key makes users: `magus
 * nats-auth` the roles', the Kubernetes runtime one bridge user per instance
 * ({@link bridgeCredentialsText}). The server needs no reload for a new user: it checks the
 * user's JWT against the account it trusts.
 */
export interface NatsAuthority {
  /** The server's side: the operator's, the system account's and the account's JWTs (no secret). */
  operatorJwt: string;
  systemAccount: { publicKey: string; jwt: string };
  account: { publicKey: string; jwt: string };
  /** The account signing key's seed (`SA…`): a secret. */
  signerSeed: string;
}

const td = new TextDecoder();
const te = new TextEncoder();

/** A new operator, system account and account (JetStream without limits), and the account's signing key. */
export async function newNatsAuthority(): Promise<NatsAuthority> {
  const operator = createOperator();
  const sys = createAccount();
  const acc = createAccount();
  const signer = createAccount();
  const opts = { signer: operator };
  const unlimited = { mem_storage: -1, disk_storage: -1, streams: -1, consumer: -1, max_ack_pending: -1, mem_max_stream_bytes: -1, disk_max_stream_bytes: -1 };
  return {
    operatorJwt: await encodeOperator('magus', operator, { system_account: sys.getPublicKey() }),
    systemAccount: { publicKey: sys.getPublicKey(), jwt: await encodeAccount('SYS', sys, {}, opts) },
    account: {
      publicKey: acc.getPublicKey(),
      jwt: await encodeAccount(
        'magus',
        acc,
        {
          signing_keys: [signer.getPublicKey()],
          limits: { ...unlimited, subs: -1, data: -1, payload: -1, imports: -1, exports: -1, wildcards: true, conn: -1, leaf: -1 },
        },
        opts,
      ),
    },
    signerSeed: td.decode(signer.getSeed()),
  };
}

/**
 * How long nats-server gives a new connection to authenticate, in seconds (its default is 2): the
 * servers magus configures (nats-auth.conf, nats-values.yaml) say 10. A Node process whose event
 * loop is held past 2 s between the server's INFO and its CONNECT (a loaded machine or a
 * CPU-throttled pod: CI's test workers were seen held 2.2 s) is closed by the server, which says
 * so only in its debug log, and nats.js then waits out its whole connect timeout (20 s) and fails
 * with a bare `TIMEOUT`, or, reconnecting, stays away that long (reproduced with nats.js 2.29 and
 * nats-server 2.15). A setting of the operator's after the include wins (nats-server keeps the last).
 */
export const NATS_AUTH_TIMEOUT_SEC = 10;

/** A JSON string as nats-server's configuration reads it (its strings are JSON's). */
const q = (s: string): string => JSON.stringify(s);

/** nats-server's configuration for `authority` (include it in the server's): operator mode, its accounts preloaded. Holds no secret. */
export const natsServerAuthConfig = (a: Pick<NatsAuthority, 'operatorJwt' | 'systemAccount' | 'account'>): string =>
  [
    '# magus NATS users (magus nats-auth): operator mode, one account; users are JWTs signed by its signing key.',
    `operator: ${q(a.operatorJwt)}`,
    `system_account: ${q(a.systemAccount.publicKey)}`,
    // A user's CONNECT carries its JWT, permissions included: the gateway's is ~6 KB, over the default 4 KB.
    'max_control_line: 32768',
    'resolver: MEMORY',
    `authorization { timeout: ${NATS_AUTH_TIMEOUT_SEC} }`,
    'resolver_preload: {',
    `  ${q(a.systemAccount.publicKey)}: ${q(a.systemAccount.jwt)}`,
    `  ${q(a.account.publicKey)}: ${q(a.account.jwt)}`,
    '}',
    '',
  ].join('\n');

/**
 * The same for the official nats Helm chart: values (JSON, which YAML reads) whose `config.merge`
 * puts these settings into the servers' configuration (`helm install nats nats/nats -f …`).
 */
export const natsChartValues = (a: Pick<NatsAuthority, 'operatorJwt' | 'systemAccount' | 'account'>): string =>
  `${JSON.stringify(
    {
      config: {
        merge: {
          operator: a.operatorJwt,
          system_account: a.systemAccount.publicKey,
          max_control_line: 32768,
          resolver: 'MEMORY',
          authorization: { timeout: NATS_AUTH_TIMEOUT_SEC },
          resolver_preload: { [a.systemAccount.publicKey]: a.systemAccount.jwt, [a.account.publicKey]: a.account.jwt },
        },
      },
    },
    null,
    2,
  )}\n`;

/** The signer file's text (`bridge-signer.nk`): the account it signs for, then the signing key's seed. */
export const signerFileText = (a: Pick<NatsAuthority, 'account' | 'signerSeed'>): string =>
  `# magus NATS signer: account ${a.account.publicKey}. Secret: whoever holds this file makes users of that account.\n${a.signerSeed}\n`;

/** The account and seed of a signer file's text, or what is wrong with it. */
export function parseSignerFile(text: string): { account: string; signerSeed: string } | { error: string } {
  const account = /^# magus NATS signer: account (A[A-Z2-7]{55})\b/m.exec(text)?.[1];
  const seed = /^(SA[A-Z2-7]{56})$/m.exec(text)?.[1];
  if (!account) return { error: 'it names no account (a first line "# magus NATS signer: account A…")' };
  if (!seed) return { error: 'it holds no account signing key seed (a line SA…, 58 characters)' };
  try {
    fromSeed(te.encode(seed));
  } catch {
    return { error: 'its seed is not a valid nkey seed' };
  }
  return { account, signerSeed: seed };
}

/** Reads the signer file at `path` (`what` names it in errors, e.g. its variable); throws naming the file and what is wrong. */
export function readNatsSigner(path: string, what = path): { account: string; signerSeed: string } {
  return readParsed(path, what, 'signer', parseSignerFile);
}

/** The file at `path` through `parse`; throws naming it (`what`) and what is wrong: unreadable, or not a magus NATS `kind` file. */
function readParsed<T extends object>(path: string, what: string, kind: string, parse: (text: string) => T | { error: string }): T {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (err) {
    throw new Error(`${what}: cannot be read (${(err as NodeJS.ErrnoException).code ?? (err as Error).message})`);
  }
  const parsed = parse(text);
  if ('error' in parsed) throw new Error(`${what}: not a magus NATS ${kind} file: ${parsed.error}`);
  return parsed;
}

/** A user JWT named `name` with `permissions`, signed by the signer for its account, in a credentials file. */
async function userCredentialsText(
  signer: { account: string; signerSeed: string },
  name: string,
  role: NatsRole,
  permissions: NatsPermissions,
): Promise<string> {
  const user = createUser();
  const jwt = await encodeUser(
    name,
    user,
    signer.account,
    { pub: { allow: permissions.publish.allow, deny: [] }, sub: { allow: permissions.subscribe.allow, deny: [] } },
    {
      signer: fromSeed(te.encode(signer.signerSeed)),
    },
  );
  return `# magus NATS credentials: role ${role}, user ${user.getPublicKey()}. Secret: whoever holds this file is that user.\n${td.decode(fmtCreds(jwt, user))}`;
}

/** The credentials file of a new `role` user (not a bridge: those are made per instance) in data plane `names`. */
export function roleCredentialsText(
  signer: { account: string; signerSeed: string },
  role: Exclude<NatsRole, 'bridge'>,
  names: DataPlaneNames,
): Promise<string> {
  return userCredentialsText(signer, `magus-${role}`, role, rolePermissions(role, names));
}

/**
 * The credentials file of a new bridge user of instance `instance` of pool `pool`:
 * {@link bridgePermissions}, or `permissions` (a test's user made as an older magus made it).
 */
export function bridgeCredentialsText(
  signer: { account: string; signerSeed: string },
  names: DataPlaneNames,
  pool: string,
  instance: string,
  permissions: NatsPermissions = bridgePermissions(names, pool, instance),
): Promise<string> {
  return userCredentialsText(signer, `magus-bridge ${pool}/${instance}`, 'bridge', permissions);
}

/** What a credentials file holds: its role, the user's JWT and seed, and the inbox prefix its JWT lets it subscribe to. */
export interface NatsCredentials {
  role: NatsRole;
  jwt: string;
  seed: string;
  inboxPrefix: string;
}

/** The credentials of a credentials file's text, or what is wrong with it. */
export function parseCredentialsFile(text: string): NatsCredentials | { error: string } {
  const role = /^# magus NATS credentials: role ([a-z]+)\b/m.exec(text)?.[1];
  if (!role || !(NATS_ROLES as readonly string[]).includes(role))
    return { error: `it names no role (a first line "# magus NATS credentials: role <${NATS_ROLES.join('|')}>")` };
  const jwt = /-----BEGIN NATS USER JWT-----\s*\n\s*(\S+)\s*\n/.exec(text)?.[1];
  const seed = /-----BEGIN USER NKEY SEED-----\s*\n\s*(SU[A-Z2-7]{56})\s*\n/.exec(text)?.[1];
  if (!jwt && !text.includes('-----BEGIN') && /^SU[A-Z2-7]{56}$/m.test(text))
    return { error: 'it is an nkey-only file of an older magus nats-auth: NATS users are JWTs now (operator mode); run magus nats-auth --out again' };
  if (!jwt) return { error: 'it holds no user JWT (-----BEGIN NATS USER JWT-----; made by magus nats-auth)' };
  if (!seed) return { error: 'it holds no user nkey seed (-----BEGIN USER NKEY SEED-----, a line SU…)' };
  let claims: { sub?: string; nats?: { sub?: { allow?: string[] } } };
  try {
    claims = decode(jwt);
  } catch {
    return { error: 'its JWT cannot be decoded' };
  }
  try {
    if (fromSeed(te.encode(seed)).getPublicKey() !== claims.sub) return { error: "its seed is not its JWT's user" };
  } catch {
    return { error: 'its seed is not a valid nkey seed' };
  }
  const inbox = (claims.nats?.sub?.allow ?? []).find((s) => s.startsWith('_INBOX') && s.endsWith('.>'));
  return { role: role as NatsRole, jwt, seed, inboxPrefix: inbox ? inbox.slice(0, -2) : inboxPrefixOf(role as NatsRole) };
}

/** nats.js connection options of a process holding `creds` (none: no authentication, a development server). */
export function natsAuthOptions(creds: NatsCredentials | undefined): { authenticator?: Authenticator; inboxPrefix?: string } {
  if (!creds) return {};
  return { authenticator: jwtAuthenticator(creds.jwt, te.encode(creds.seed)), inboxPrefix: creds.inboxPrefix };
}

/** Reads the credentials file at `path`; throws naming the file and what is wrong. */
export function readNatsCredentials(path: string): NatsCredentials {
  return readParsed(path, `MAGUS_NATS_CREDENTIALS=${path}`, 'credentials', parseCredentialsFile);
}

/**
 * `MAGUS_NATS_CREDENTIALS`: the file of this process's NATS user (checked now, read again when it
 * connects: the seed is kept in no configuration object); unset, none — adds to `problems` what
 * is wrong with it.
 */
export function natsCredentialsFrom(env: NodeJS.ProcessEnv, problems: string[]): string | undefined {
  const path = env.MAGUS_NATS_CREDENTIALS?.trim();
  if (!path) return undefined;
  try {
    readNatsCredentials(path);
  } catch (err) {
    problems.push((err as Error).message);
  }
  return path;
}

/**
 * nats.js options of a process connecting with the credentials file `path` (dataplane/roles.ts
 * says what its role may do); without one, none — and, unless every server is on loopback (a
 * development setup), `warn` is told once that NATS is open to whatever reaches it.
 */
export function natsConnectAuth(
  path: string | undefined,
  servers: readonly string[],
  warn: (line: string) => void,
): { authenticator?: Authenticator; inboxPrefix?: string } {
  if (path) return natsAuthOptions(readNatsCredentials(path));
  const loopback = (url: string) => /^[a-z]+:\/\/(localhost|127\.[0-9.]+|\[::1\])(:\d+)?$/i.test(url.trim());
  if (!servers.every(loopback))
    warn('connecting to NATS without credentials (MAGUS_NATS_CREDENTIALS unset): whatever reaches that server reads prompts and answers; for development only');
  return {};
}

/**
 * A new inbox subject of connection `nc`, under its `inboxPrefix` (its role's: the only inboxes it
 * may subscribe to). nats.js's `createInbox()` alone ignores the connection's prefix.
 */
export function inboxOf(nc: NatsConnection): string {
  return createInbox((nc as NatsConnection & { options?: Pick<ConnectionOptions, 'inboxPrefix'> }).options?.inboxPrefix);
}
