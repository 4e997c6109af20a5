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
  const cat = createModelCatalog(l, { maxAgeMs: 1000, now: () => now });
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

it('re-reads at once for an unknown id, so a new model is found immediately; concurrent misses share a read', async () => {
  let now = 0;
  const l = lister([readyModel('a')]);
  const cat = createModelCatalog(l, { maxAgeMs: 60_000, now: () => now });
  await cat.find('a');
  now = 500;
  l.state.models = [readyModel('a'), readyModel('new')];
  expect((await cat.find('new'))?.name).toBe('new');
  expect(l.state.calls).toBe(2);
  // A miss is answered from a read made after it arrived, however recent the last one was.
  expect(await cat.find('nope')).toBeUndefined();
  expect(l.state.calls).toBe(3);
  expect(await Promise.all([cat.find('x'), cat.find('y'), cat.find('z')])).toEqual([undefined, undefined, undefined]);
  expect(l.state.calls).toBe(4);
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
  const cat = createModelCatalog(l, { maxAgeMs: 5000, now: () => now });
  expect(await cat.find('demo')).toBeUndefined();
  now = 60_000; // long after: the catalog is stale, and the model has been published meanwhile
  l.state.models = [readyModel('demo')];
  expect((await cat.find('demo'))?.name).toBe('demo');
  expect(l.state.calls).toBe(2);
});

it('a model published just after the last read (the demo in `magus dev`) is found on the first request', async () => {
  const now = 0; // no time passes: the last read is as recent as can be
  const l = lister([]);
  const cat = createModelCatalog(l, { maxAgeMs: 5000, now: () => now });
  await cat.refresh();
  l.state.models = [readyModel('demo')];
  expect((await cat.find('demo'))?.name).toBe('demo');
});

it('forgetInflight: the next refresh reads anew, and the forgotten read, ending later, does not overwrite it', async () => {
  const reads: { resolve: (models: ReadyModel[]) => void }[] = [];
  const cat = createModelCatalog({ list: () => new Promise<ReadyModel[]>((resolve) => reads.push({ resolve })) });
  const stuck = cat.refresh();
  expect(cat.refresh()).toBe(stuck); // joined while in flight
  cat.forgetInflight();
  const fresh = cat.refresh();
  expect(fresh).not.toBe(stuck);
  expect(reads).toHaveLength(2);
  reads[1]!.resolve([readyModel('new')]);
  await fresh;
  reads[0]!.resolve([readyModel('old')]);
  await stuck;
  expect((await cat.list()).map((m) => m.name)).toEqual(['new']);
});
