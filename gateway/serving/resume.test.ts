import { parseLastEventId, resumeIdPrefix } from './resume';

const SECRET = 'a-secret-the-replicas-share';
const answer = { replica: 'gw-0123456789ab', pool: 'demo', instance: 'demo-1-b3327fdc', requestId: 'DEWB470OX5M5WYBKOS7RQ7' };

describe('resume points: event ids a key can resume from, and nobody else', () => {
  it('an event id parses back to its answer and seq', () => {
    const id = `${resumeIdPrefix(SECRET, 'config/team-a', answer)}17`;
    expect(id).toMatch(/^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{16}\.17$/);
    expect(parseLastEventId(SECRET, 'config/team-a', id)).toEqual({ ...answer, seq: 17, idPrefix: id.slice(0, -2) });
  });

  it('an id without a seq (said while the answer waits for its first chunk) resumes from before the first', () => {
    const prefix = resumeIdPrefix(SECRET, 'config/team-a', answer);
    expect(parseLastEventId(SECRET, 'config/team-a', prefix)).toEqual({ ...answer, seq: -1, idPrefix: prefix });
    expect(parseLastEventId(SECRET, 'config/team-b', prefix)).toBeUndefined();
  });

  it.each([
    ['another scope', (id: string) => id, 'config/team-b', SECRET],
    ['another secret', (id: string) => id, 'config/team-a', 'another-secret'],
    [
      'a changed answer',
      (id: string) => `${Buffer.from('gw-0123456789ab/demo/other/DEWB470OX5M5WYBKOS7RQ7').toString('base64url')}.${id.split('.')[1]}.3`,
      'config/team-a',
      SECRET,
    ],
    ['a changed MAC', (id: string) => id.replace(/\.[^.]+\./, '.AAAAAAAAAAAAAAAA.'), 'config/team-a', SECRET],
    ['a seq that is no number', (id: string) => `${id.slice(0, id.lastIndexOf('.') + 1)}-1`, 'config/team-a', SECRET],
    ['garbage', () => 'x.y.z', 'config/team-a', SECRET],
  ])('%s: no resume point', (_what, change, scope, secret) => {
    const id = `${resumeIdPrefix(SECRET, 'config/team-a', answer)}3`;
    expect(parseLastEventId(secret, scope, change(id))).toBeUndefined();
  });
});
