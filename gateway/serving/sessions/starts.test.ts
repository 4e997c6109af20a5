/** Session workflows started off the client's path: retried with backoff until started, expired or closed; bounded. */
import type { SessionEntry } from '../../../shared/serving';
import { readyModel } from '../../../test/harness/gateway-app';
import { SessionStarts } from './starts';
import type { FirstTurns } from './types';

beforeEach(() => jest.useFakeTimers({ now: 1_000_000 }));
afterEach(() => jest.useRealTimers());

const req = { conversationKey: 'k', model: readyModel('tiny'), owner: 'o' };
const entry = (expiresAt: number): SessionEntry => ({ subject: 's', pool: 'tiny', instance: 'i1', expiresAt });
function startsWith(adopt: FirstTurns['adopt'], max = 2) {
  const errors: unknown[] = [];
  return { starts: new SessionStarts({ adopt } as FirstTurns, Date.now, max, (err) => errors.push(err)), errors };
}

it('retries a failed start with doubling backoff until it works, counting it as pending meanwhile', async () => {
  let failures = 2;
  const adopt = jest.fn(() => (failures-- > 0 ? Promise.reject(new Error('Temporal away')) : Promise.resolve()));
  const { starts, errors } = startsWith(adopt);
  starts.start(req, entry(Date.now() + 600_000));
  expect(starts.pending).toBe(1);
  await jest.advanceTimersByTimeAsync(999);
  expect(adopt).toHaveBeenCalledTimes(1);
  await jest.advanceTimersByTimeAsync(1);
  expect(adopt).toHaveBeenCalledTimes(2);
  await jest.advanceTimersByTimeAsync(2_000);
  expect(adopt).toHaveBeenCalledTimes(3);
  expect(starts.pending).toBe(0);
  expect(errors).toHaveLength(2);
});

it('gives up on an entry that expired, and on every start once closed', async () => {
  const adopt = jest.fn(() => Promise.reject(new Error('Temporal away')));
  const { starts } = startsWith(adopt);
  starts.start(req, entry(Date.now() + 1_500));
  starts.start({ ...req, conversationKey: 'k2' }, entry(Date.now() + 600_000));
  // Tried at 0, 1 s and 3 s each; the first has expired by then, the second waits for 7 s.
  await jest.advanceTimersByTimeAsync(3_000);
  expect(adopt).toHaveBeenCalledTimes(6);
  expect(starts.pending).toBe(1);
  starts.close();
  await jest.advanceTimersByTimeAsync(60_000);
  expect(adopt).toHaveBeenCalledTimes(6);
});

it('is full at its bound', () => {
  const { starts } = startsWith(() => new Promise<void>(() => undefined), 2);
  starts.start(req, entry(Date.now() + 600_000));
  expect(starts.full).toBe(false);
  starts.start(req, entry(Date.now() + 600_000));
  expect(starts.full).toBe(true);
});
