/**
 * NATS users per role: what each magus process may publish and subscribe to in one data plane,
 * as nats-server permissions, and the credentials it connects with (an nkey: the server holds
 * only its public key). A role gets the subjects of its own work and nothing else, so that —
 * whatever else reaches NATS — prompts, answers, tokens and stored responses are read only by
 * the processes that serve them:
 *
 * | role | may | may not |
 * |---|---|---|
 * | `gateway` | publish requests and cancels; read frames of its replicas; KV sessions, responses (declares it), limits, usage (records what it gave up on); read tokens, models, pools | consume the request stream; write tokens, the registry, pools |
 * | `bridge` | consume the request stream; publish frames; KV claims, usage | read tokens, responses, sessions, limits; write the registry |
 * | `controller` | KV tokens, sessions (mirror), usage sums; read usage, limits, models | publish or consume requests and frames |
 * | `worker` | everything: it declares the data plane, runs pipelines and instances | |
 *
 * Every role's replies come to an inbox of its own (`_INBOX_<role>.…`, nats.js `inboxPrefix`):
 * no role can subscribe to another's, where KV reads and JetStream acknowledgements arrive.
 *
 * The JetStream API is granted per stream (`$JS.API.<verb>.<stream>…`), never as `$JS.API.>`,
 * so a role that may read one bucket cannot create a consumer on another.
 */
import { readFileSync } from 'node:fs';
import { createInbox, nkeyAuthenticator, nkeys as untypedNkeys, type Authenticator, type ConnectionOptions, type NatsConnection } from 'nats';
import type { DataPlaneNames } from './names';
import { scopedSubject } from './names';
import { Nats } from '../shared/constants';

/** What of nats.js's nkeys (typed `any` there) this module uses. */
interface Nkeys {
  createUser(): { getPublicKey(): string; getSeed(): Uint8Array };
  fromSeed(seed: Uint8Array): unknown;
}
const nkeys = untypedNkeys as Nkeys;

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
export function rolePermissions(role: NatsRole, names: DataPlaneNames): NatsPermissions {
  const inbox = `${inboxPrefixOf(role)}.>`;
  const req = scopedSubject(names, `${Nats.requestSubjectPrefix}.>`);
  const res = scopedSubject(names, `${Nats.responseSubjectPrefix}.>`);
  const cancel = scopedSubject(names, `${Nats.cancelSubjectPrefix}.>`);
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
            ...kvRead(names.tokensBucket),
            ...kvRead(names.modelsBucket),
            ...kvRead(names.poolsBucket),
            // Frames it missed are read back from the response stream; its consumer is its own.
            ...streamRead(names.responseStream),
            api(`STREAM.INFO.${names.requestStream}`),
          ],
        },
        subscribe: { allow: [inbox, res] },
      };
    case 'bridge':
      return {
        publish: {
          allow: [
            ...common,
            res,
            ...streamRead(names.requestStream),
            api(`CONSUMER.DURABLE.CREATE.${names.requestStream}.>`),
            ...kvWrite(names.claimsBucket),
            ...kvWrite(names.usageBucket),
          ],
        },
        subscribe: { allow: [inbox, cancel, `$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.${names.requestStream}.>`] },
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

/** One role's user: its nkey's public key (the server's) and seed (the process's secret). */
export interface RoleCredentials {
  role: NatsRole;
  publicKey: string;
  seed: string;
}

/** New credentials for `role`: a fresh user nkey. */
export function newRoleCredentials(role: NatsRole): RoleCredentials {
  const kp = nkeys.createUser();
  return { role, publicKey: kp.getPublicKey(), seed: new TextDecoder().decode(kp.getSeed()) };
}

/** A JSON string as nats-server's configuration reads it (its strings are JSON's). */
const q = (s: string): string => JSON.stringify(s);

/**
 * The `authorization` block of a nats-server configuration with one user per role of `users`
 * (their public keys), each with {@link rolePermissions} in data plane `names`. Holds no secret.
 */
export function natsAuthorizationConfig(users: readonly Pick<RoleCredentials, 'role' | 'publicKey'>[], names: DataPlaneNames): string {
  const list = (xs: string[]) => `[${xs.map(q).join(', ')}]`;
  const entries = users.map(({ role, publicKey }) => {
    const p = rolePermissions(role, names);
    return `    # ${role}\n    { nkey: ${q(publicKey)}, permissions: { publish: { allow: ${list(p.publish.allow)} }, subscribe: { allow: ${list(p.subscribe.allow)} } } }`;
  });
  return `authorization {\n  users: [\n${entries.join(',\n')}\n  ]\n}\n`;
}

/**
 * The credentials file of one role, as `magus nats-auth` writes it and `MAGUS_NATS_CREDENTIALS`
 * names it: a comment naming the role, then the nkey seed.
 */
export const credentialsFileText = (c: RoleCredentials): string =>
  `# magus NATS credentials: role ${c.role}, user ${c.publicKey}. Secret: whoever holds this file is that user.\n${c.seed}\n`;

/** The role and seed of a credentials file's text, or what is wrong with it. */
export function parseCredentialsFile(text: string): { role: NatsRole; seed: string } | { error: string } {
  const role = /^# magus NATS credentials: role ([a-z]+)\b/m.exec(text)?.[1];
  const seed = /^(SU[A-Z2-7]{56})$/m.exec(text)?.[1];
  if (!role || !(NATS_ROLES as readonly string[]).includes(role))
    return { error: `it names no role (a first line "# magus NATS credentials: role <${NATS_ROLES.join('|')}>")` };
  if (!seed) return { error: 'it holds no user nkey seed (a line SU…, 58 characters)' };
  try {
    nkeys.fromSeed(new TextEncoder().encode(seed));
  } catch {
    return { error: 'its seed is not a valid nkey seed' };
  }
  return { role: role as NatsRole, seed };
}

/** nats.js connection options of a process holding `creds` (none: no authentication, a development server). */
export function natsAuthOptions(creds: { role: NatsRole; seed: string } | undefined): { authenticator?: Authenticator; inboxPrefix?: string } {
  if (!creds) return {};
  return { authenticator: nkeyAuthenticator(new TextEncoder().encode(creds.seed)), inboxPrefix: inboxPrefixOf(creds.role) };
}

/** Reads the credentials file at `path`; throws naming the file and what is wrong. */
export function readNatsCredentials(path: string): { role: NatsRole; seed: string } {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (err) {
    throw new Error(`MAGUS_NATS_CREDENTIALS=${path}: cannot be read (${(err as NodeJS.ErrnoException).code ?? (err as Error).message})`);
  }
  const c = parseCredentialsFile(text);
  if ('error' in c) throw new Error(`MAGUS_NATS_CREDENTIALS=${path}: not a magus NATS credentials file: ${c.error}`);
  return c;
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
