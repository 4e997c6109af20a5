/** The model catalog's caching over a registry lister. */
import type { ReadyModel } from '../../shared/model';
import { readyModel } from '../test-support';
import { createModelCatalog } from './models';

function lister(initial: ReadyModel[]) {
  const state = { models: initial, calls: 0 };
  return { state, list: () => (state.calls++, Promise.resolve(state.models)) };
}

it('reads the registry once, then serves from memory until stale', async () => {
  let now = 0;
  const l = lister([readyModel('a')]);
  const cat = createModelCatalog(l, { maxAgeMs: 1000, missRefreshMs: 100, now: () => now });
  expect((await cat.find('a'))?.name).toBe('a');
  expect(await cat.find('default/a')).toBeDefined();
  await cat.find('a');
  expect(l.state.calls).toBe(1);
  now = 2000;
  l.state.models = [readyModel('a'), readyModel('b')];
  expect((await cat.find('a'))?.name).toBe('a'); // stale copy answers; refresh runs behind
  await new Promise((r) => setImmediate(r));
  expect(l.state.calls).toBe(2);
  expect((await cat.list()).map((m) => m.name)).toEqual(['a', 'b']);
});

it('re-reads at once (rate-limited) for an unknown id, so a new model is found immediately', async () => {
  let now = 0;
  const l = lister([readyModel('a')]);
  const cat = createModelCatalog(l, { maxAgeMs: 60_000, missRefreshMs: 100, now: () => now });
  await cat.find('a');
  now = 500;
  l.state.models = [readyModel('a'), readyModel('new')];
  expect((await cat.find('new'))?.name).toBe('new');
  expect(l.state.calls).toBe(2);
  expect(await cat.find('nope')).toBeUndefined(); // within missRefreshMs of the last read
  expect(l.state.calls).toBe(2);
  now = 700;
  expect(await cat.find('nope')).toBeUndefined();
  expect(l.state.calls).toBe(3);
});

it('a bare name means the first namespace in registry order', async () => {
  const cat = createModelCatalog(lister([readyModel('m', 'a'), readyModel('m', 'b')]));
  expect((await cat.find('m'))?.namespace).toBe('a');
  expect((await cat.find('b/m'))?.namespace).toBe('b');
});

it('a model published while the catalog was stale is found on the first request', async () => {
  let now = 0;
  // A registry read takes a moment, as the real one (NATS KV) does.
  const state = { models: [] as ReadyModel[], calls: 0 };
  const l = { state, list: () => (state.calls++, new Promise<ReadyModel[]>((r) => setTimeout(() => r(state.models), 10))) };
  const cat = createModelCatalog(l, { maxAgeMs: 5000, missRefreshMs: 1000, now: () => now });
  expect(await cat.find('demo')).toBeUndefined();
  now = 60_000; // long after: the catalog is stale, and the model has been published meanwhile
  l.state.models = [readyModel('demo')];
  expect((await cat.find('demo'))?.name).toBe('demo');
  expect(l.state.calls).toBe(2);
});
