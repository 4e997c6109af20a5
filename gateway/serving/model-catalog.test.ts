/** The model catalog's caching over a registry lister. */
import type { ReadyModel } from '../../shared/model';
import type { RuntimeAdvert } from '../../shared/runtimes';
import { readyModel } from '../../test/harness/gateway-app';
import { createModelCatalog } from './model-catalog';

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
  // The copy holds the newer read: a find of 'new' answers from it without another read.
  const found = cat.find('new');
  await new Promise((r) => setImmediate(r));
  expect(reads).toHaveLength(2);
  expect((await found)?.name).toBe('new');
});

it('list() and lookup() answer from a read that began after the call, so a model published a moment ago is listed', async () => {
  const now = 0; // the copy is as fresh as can be: find() alone would not re-read for a known id
  const l = lister([]);
  const cat = createModelCatalog(l, { maxAgeMs: 60_000, now: () => now });
  await cat.refresh();
  l.state.models = [readyModel('demo')];
  expect((await cat.list()).map((m) => m.name)).toEqual(['demo']);
  l.state.models = [];
  expect(await cat.lookup('demo')).toBeUndefined();
  expect(await cat.list()).toEqual([]);
});

it('a list called while an older read is in flight waits for a newer one; concurrent lists share it', async () => {
  const reads: { resolve: (models: ReadyModel[]) => void }[] = [];
  const cat = createModelCatalog({ list: () => new Promise<ReadyModel[]>((resolve) => reads.push({ resolve })) });
  const old = cat.refresh();
  const lists = [cat.list(), cat.list()];
  reads[0]!.resolve([]);
  await old;
  await new Promise((r) => setImmediate(r));
  expect(reads).toHaveLength(2);
  reads[1]!.resolve([readyModel('new')]);
  expect((await Promise.all(lists)).map((l) => l.map((m) => m.name))).toEqual([['new'], ['new']]);
});

it('unservable: a model none of whose artifacts a live runtime runs, with the reason', async () => {
  const now = 1_000_000;
  const dllamaOnly: ReadyModel = { ...readyModel('d'), artifacts: [{ format: 'dllama', weights: 'q40', converterVersion: 't', files: [] }] };
  const both: ReadyModel = {
    ...dllamaOnly,
    name: 'b',
    artifacts: [...dllamaOnly.artifacts, { format: 'gguf', weights: 'q80', converterVersion: 't', files: [] }],
  };
  const runtimes: { local: RuntimeAdvert } = { local: { worker: 'w1', runtime: 'local', formats: ['gguf'], at: now } };
  const catalog = (adverts: RuntimeAdvert[]) => {
    const cat = createModelCatalog({ list: () => Promise.resolve([]), read: () => Promise.resolve({ models: [], runtimes: adverts }) }, { now: () => now });
    return cat.refresh().then(() => cat);
  };
  const gguf = await catalog([runtimes.local]);
  expect(gguf.unservable(dllamaOnly)).toMatch(/dllama:q40.*gguf \(llama\.cpp\).*--format gguf/);
  expect(gguf.unservable(both)).toBeUndefined();
  expect(gguf.unservable(readyModel('hand-made'))).toBeUndefined(); // no artifacts: not judged
  // A worker with distributed-llama serves it; one whose advert is stale (gone) does not count.
  expect(
    (await catalog([runtimes.local, { ...runtimes.local, worker: 'w2', formats: ['gguf', 'dllama'], dllamaNodes: 2 }])).unservable(dllamaOnly),
  ).toBeUndefined();
  expect((await catalog([{ ...runtimes.local, formats: ['gguf', 'dllama'], at: now - 10 * 60_000 }])).unservable(dllamaOnly)).toBeUndefined();
  expect((await catalog([{ ...runtimes.local, formats: ['gguf', 'dllama'], at: now - 10 * 60_000 }, runtimes.local])).unservable(dllamaOnly)).toMatch(
    /cannot be served/,
  );
  // Its plan splits it into 1 and 4 nodes, the worker runs 2: not servable, and why.
  const planned: ReadyModel = {
    ...dllamaOnly,
    memory: [
      {
        format: 'dllama',
        weights: 'q40',
        contextLength: 64,
        topologies: [1, 4].map((nodes) => ({ nodes, root: { weights: 1, kvCache: 1, buffers: 1, total: 3 }, worker: null })),
      },
    ],
  };
  expect((await catalog([{ ...runtimes.local, formats: ['gguf', 'dllama'], dllamaNodes: 2 }])).unservable(planned)).toMatch(/splits into 1, 4 nodes, not 2/);
  // No live advert at all (no worker, or workers older than adverts): nothing is said.
  expect((await catalog([])).unservable(dllamaOnly)).toBeUndefined();
});
