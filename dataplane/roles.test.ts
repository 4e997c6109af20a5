import {
  bridgeCredentialsText,
  bridgeInboxPrefixOf,
  bridgePermissions,
  NATS_AUTH_TIMEOUT_SEC,
  natsChartValues,
  natsConnectAuth,
  natsServerAuthConfig,
  newNatsAuthority,
  parseCredentialsFile,
  parseSignerFile,
  roleCredentialsText,
  rolePermissions,
  signerFileText,
} from './roles';
import { dataPlaneNames } from './names';

describe('credentials files', () => {
  const names = dataPlaneNames('T');
  it('hold a JWT of their role and its seed; anything else is refused with why', async () => {
    const authority = await newNatsAuthority();
    const signer = { account: authority.account.publicKey, signerSeed: authority.signerSeed };
    const text = await roleCredentialsText(signer, 'gateway', names);
    const c = parseCredentialsFile(text);
    if ('error' in c) throw new Error(c.error);
    expect(c).toMatchObject({ role: 'gateway', inboxPrefix: '_INBOX_gateway' });
    expect(c.seed).toMatch(/^SU[A-Z2-7]{56}$/);
    expect(parseCredentialsFile(c.seed)).toEqual({ error: expect.stringContaining('names no role') as string });
    expect(parseCredentialsFile(text.replace('role gateway', 'role admin'))).toEqual({ error: expect.stringContaining('names no role') as string });
    expect(parseCredentialsFile(text.replace(c.jwt, ''))).toEqual({ error: expect.stringContaining('no user JWT') as string });
    // The nkey-only file of the magus before operator mode.
    expect(parseCredentialsFile(`# magus NATS credentials: role gateway, user U.\n${c.seed}\n`)).toEqual({
      error: expect.stringContaining('older magus nats-auth') as string,
    });
    expect(parseCredentialsFile(text.replace(c.seed, 'SUnope'))).toEqual({ error: expect.stringContaining('no user nkey seed') as string });
    // Another user's seed with this JWT.
    const other = parseCredentialsFile(await roleCredentialsText(signer, 'controller', names));
    if ('error' in other) throw new Error(other.error);
    expect(parseCredentialsFile(text.replace(c.seed, other.seed))).toEqual({ error: "its seed is not its JWT's user" });
    // A bridge's inbox is its instance's.
    const bridge = parseCredentialsFile(await bridgeCredentialsText(signer, names, 'm', 'i-1'));
    expect(bridge).toMatchObject({ role: 'bridge', inboxPrefix: bridgeInboxPrefixOf('m', 'i-1') });
  });

  it('the signer file names its account; anything else is refused with why', async () => {
    const authority = await newNatsAuthority();
    const text = signerFileText(authority);
    expect(parseSignerFile(text)).toEqual({ account: authority.account.publicKey, signerSeed: authority.signerSeed });
    expect(parseSignerFile(authority.signerSeed)).toEqual({ error: expect.stringContaining('names no account') as string });
    expect(parseSignerFile(text.replace(authority.signerSeed, 'SAnope'))).toEqual({ error: expect.stringContaining('no account signing key seed') as string });
    // One character of the key itself changed (the last one's low bits are padding): its checksum no longer holds.
    const bad = authority.signerSeed.slice(0, 10) + (authority.signerSeed[10] === 'A' ? 'B' : 'A') + authority.signerSeed.slice(11);
    expect(parseSignerFile(text.replace(authority.signerSeed, bad))).toEqual({ error: 'its seed is not a valid nkey seed' });
  });

  it('without credentials, one warning unless every server is on loopback', () => {
    const lines: string[] = [];
    expect(natsConnectAuth(undefined, ['nats://127.0.0.1:4222', 'nats://localhost:4223'], (l) => lines.push(l))).toEqual({});
    expect(lines).toEqual([]);
    natsConnectAuth(undefined, ['nats://nats.nats.svc:4222'], (l) => lines.push(l));
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(/without credentials \(MAGUS_NATS_CREDENTIALS unset\)/);
  });
});

describe('permissions', () => {
  const names = dataPlaneNames('T');
  it('grant the JetStream API per stream, never all of it, except to the worker', () => {
    for (const role of ['gateway', 'controller'] as const) {
      const p = rolePermissions(role, names);
      expect(p.publish.allow).not.toContain('$JS.API.>');
      expect(p.publish.allow).not.toContain('>');
      expect(p.subscribe.allow.filter((s) => s.startsWith('_INBOX'))).toEqual([`_INBOX_${role}.>`]);
    }
    expect(rolePermissions('worker', names).publish.allow).toEqual(['>']);
  });

  it("a bridge gets its own instance's requests and none of the secrets", () => {
    const p = bridgePermissions(names, 'm', 'i-1');
    const pub = p.publish.allow.join(' ');
    for (const bucket of [names.tokensBucket, names.responsesBucket, names.modelsBucket, names.sessionsBucket, names.limitsBucket])
      expect(pub).not.toContain(bucket);
    // The request stream: only its own consumers (its requests', its lanes'), created only with their own filters.
    const onRequests = p.publish.allow.filter((s) => s.includes(names.requestStream));
    expect(onRequests.every((s) => s.includes(`${names.requestStream}.m_i-1`))).toBe(true);
    expect(onRequests).toContain(`$JS.API.CONSUMER.CREATE.${names.requestStream}.m_i-1.t.magus.req.m.i-1`);
    expect(onRequests).toContain(`$JS.API.CONSUMER.CREATE.${names.requestStream}.m_i-1_moved.t.magus.req.m.i-1.moved`);
    expect(onRequests).toContain(`$JS.API.CONSUMER.CREATE.${names.requestStream}.m_i-1_requeued.t.magus.req.m.i-1.requeued`);
    expect(onRequests.some((s) => s.includes('>') && s.startsWith('$JS.API'))).toBe(false);
    expect(p.subscribe.allow).toEqual([
      `${bridgeInboxPrefixOf('m', 'i-1')}.>`,
      't.magus.cancel.m.i-1',
      `$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.${names.requestStream}.m_i-1`,
      `$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.${names.requestStream}.m_i-1_moved`,
      `$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.${names.requestStream}.m_i-1_requeued`,
    ]);
  });

  it('the server configuration holds JWTs, no seed', async () => {
    const authority = await newNatsAuthority();
    const conf = natsServerAuthConfig(authority);
    expect(conf).toContain(authority.operatorJwt);
    expect(conf).toContain(authority.account.jwt);
    expect(conf).not.toContain(authority.signerSeed);
    expect(conf).toMatch(/^resolver: MEMORY$/m);
  });

  it('both forms of the server configuration give a client NATS_AUTH_TIMEOUT_SEC to authenticate', async () => {
    const authority = await newNatsAuthority();
    expect(NATS_AUTH_TIMEOUT_SEC).toBeGreaterThan(2);
    expect(natsServerAuthConfig(authority)).toMatch(new RegExp(`^authorization \\{ timeout: ${NATS_AUTH_TIMEOUT_SEC} \\}$`, 'm'));
    const values = JSON.parse(natsChartValues(authority)) as { config: { merge: Record<string, unknown> } };
    expect(values.config.merge.authorization).toEqual({ timeout: NATS_AUTH_TIMEOUT_SEC });
  });
});
