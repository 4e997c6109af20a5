import { credentialsFileText, natsAuthorizationConfig, natsConnectAuth, newRoleCredentials, parseCredentialsFile, rolePermissions } from './roles';
import { dataPlaneNames } from './names';

describe('credentials files', () => {
  it('name their role and hold the seed; anything else is refused with why', () => {
    const c = newRoleCredentials('bridge');
    expect(c.seed).toMatch(/^SU[A-Z2-7]{56}$/);
    expect(c.publicKey).toMatch(/^U[A-Z2-7]{55}$/);
    expect(parseCredentialsFile(credentialsFileText(c))).toEqual({ role: 'bridge', seed: c.seed });
    expect(parseCredentialsFile(c.seed)).toEqual({ error: expect.stringContaining('names no role') as string });
    expect(parseCredentialsFile('# magus NATS credentials: role admin\n' + c.seed)).toEqual({ error: expect.stringContaining('names no role') as string });
    expect(parseCredentialsFile('# magus NATS credentials: role gateway\nSUnope')).toEqual({ error: expect.stringContaining('no user nkey seed') as string });
    // A seed whose checksum does not hold.
    const bad = c.seed.slice(0, -1) + (c.seed.endsWith('A') ? 'B' : 'A');
    expect(parseCredentialsFile(`# magus NATS credentials: role gateway\n${bad}`)).toEqual({ error: 'its seed is not a valid nkey seed' });
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
    for (const role of ['gateway', 'bridge', 'controller'] as const) {
      const p = rolePermissions(role, names);
      expect(p.publish.allow).not.toContain('$JS.API.>');
      expect(p.publish.allow).not.toContain('>');
      expect(p.subscribe.allow).toContain(`_INBOX_${role}.>`);
      expect(p.subscribe.allow.filter((s) => s.startsWith('_INBOX'))).toEqual([`_INBOX_${role}.>`]);
    }
    const bridge = rolePermissions('bridge', names).publish.allow.join(' ');
    expect(bridge).not.toContain(names.tokensBucket);
    expect(bridge).not.toContain(names.responsesBucket);
    expect(bridge).not.toContain(names.modelsBucket);
    expect(rolePermissions('worker', names).publish.allow).toEqual(['>']);
  });

  it('the server configuration holds public keys and permissions, no seed', () => {
    const users = (['gateway', 'bridge'] as const).map(newRoleCredentials);
    const conf = natsAuthorizationConfig(users, names);
    for (const u of users) {
      expect(conf).toContain(u.publicKey);
      expect(conf).not.toContain(u.seed);
    }
    expect(conf).toMatch(/^authorization \{\n {2}users: \[/);
  });
});
