/**
 * gateway/serving/limits.ts's `KeyLimiter` against a real `magus_limits` bucket: a grant's settle
 * is held by the store for the key's next write, and `stop` (the gateway closing) writes it —
 * the reservation is gone and the budget charged what was used, with no request after it.
 */
import type { KV } from 'nats';
import type { KeyLimits } from '../../shared/limits';
import { LimitStore } from '../../dataplane/limits';
import { isolation } from '../../test/harness';
import { natsStack, TestStack } from '../../test/harness/stack';
import { KeyLimiter } from './limits';

const iso = isolation();
const stack = new TestStack();
let kv: KV;

beforeAll(async () => {
  const { nc, names } = await stack.open(natsStack(iso, { declare: true }));
  stack.defer(async () => (await nc.jetstreamManager()).streams.delete(`KV_${names.limitsBucket}`).catch(() => false));
  kv = await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true });
});
afterAll(() => stack.close());

it('stop writes the settles the store holds: the reservation is released and the budget charged what was used', async () => {
  const scope = 'team/limiter';
  const limits: KeyLimits = { concurrency: 4, budget: { tokens: 10_000, period: 'month' } };
  const warnings: string[] = [];
  // A hold longer than the test: only stop writes the settle.
  const store = new LimitStore(kv, { settleHoldMs: 600_000 });
  const limiter = new KeyLimiter(store, {
    replica: 'gw-test',
    leaseMs: 60_000,
    storedResponsesTtlMs: 86_400_000,
    retryAfterSec: 1,
    log: { warn: (_o, msg) => warnings.push(msg) },
  });
  stack.defer(() => limiter.stop());

  const grant = await limiter.admit(scope, limits, 'req-1', { tokens: 100 });
  expect(grant.tokens).toBe(100);
  grant.settle(42);
  grant.settle(99); // once only
  expect(Object.keys((await store.read(scope))!.state.reservations)).toEqual(['req-1']);

  await limiter.stop();
  expect((await store.read(scope))!.state).toMatchObject({ reservations: {}, budget: { used: 42 } });
  expect(warnings).toEqual([]);
});
