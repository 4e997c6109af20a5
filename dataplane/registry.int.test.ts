/** The model registry on the real nats-server. */
import type { NatsConnection } from 'nats';
import type { ReadyModel } from '../shared/model';
import { isolation, natsConnect } from '../test/harness';
import { openModelRegistry } from './registry';

const iso = isolation();
let nc: NatsConnection;
beforeAll(async () => {
  nc = await natsConnect();
});
afterAll(() => nc.drain());

const model = (name: string): ReadyModel => ({
  namespace: 'default',
  name,
  source: { repo: `org/${name}`, revision: 'main', sha: 'a'.repeat(40) },
  artifacts: [],
  memory: [],
  readyAt: '2026-11-21T00:00:00.000Z',
});

test('lists every model, gets one, and forgets a removed one', async () => {
  const registry = await openModelRegistry(nc, `${iso.natsPrefix}_models`);
  for (const n of ['c', 'a', 'b']) await registry.put(model(n));
  expect((await registry.list()).map((m) => m.name)).toEqual(['a', 'b', 'c']);
  expect((await registry.get('default', 'b'))?.source.repo).toBe('org/b');
  await registry.remove('default', 'b');
  expect(await registry.get('default', 'b')).toBeNull();
  expect((await registry.list()).map((m) => m.name)).toEqual(['a', 'c']);
});
