import { restartChange } from '../../shared/status';
import type { PoolInput } from './definitions';
import { poolDetails } from './details';
import {
  DEMAND_HOLD_MS,
  instanceIdOf,
  MAX_INSTANCE_ID,
  PoolState,
  PRESSURE_PENDING,
  START_BACKOFF_BASE_MS,
  VIEW_REFRESH_MS,
  type LoadReport,
  type PoolView,
} from './state';

const input = (over: Partial<PoolInput> = {}): PoolInput => ({
  namespace: 'default',
  model: 'm',
  minInstances: 0,
  maxInstances: 4,
  leasesPerInstance: 2,
  idleTimeoutMs: 60_000,
  drainGraceMs: 5000,
  ...over,
});
const report = (r: Record<string, [number, number?, number?]>): LoadReport => ({
  instances: Object.fromEntries(Object.entries(r).map(([id, [leases, pending = 0, ackPending = 0]]) => [id, { leases, pending, ackPending }])),
});

/** A view listing these instances (of a pool of two leases per instance, able to grow). */
const viewOf = (...ids: string[]): PoolView => ({
  instances: ids.map((id) => ({ instance: id, subject: `magus.req.m.${id}`, leases: 0 })),
  leasesPerInstance: 2,
  growable: true,
});

/** A pool with `n` ready instances m-1..m-n at time 0. */
function ready(n: number, over: Partial<PoolInput> = {}): PoolState {
  const s = new PoolState(input({ minInstances: n, ...over }));
  for (const id of s.plan(0).start) s.started(id, { subject: `magus.req.m.${id}` }, 0);
  s.input.minInstances = over.minInstances ?? 0;
  return s;
}

describe('instance ids', () => {
  it('names each new instance <model>-<n>-<tag>: two namespaces’ pools of one model name never start the same id', () => {
    const tags = ['0a1b2c3d', 'ffee0011', '12345678'];
    const a = new PoolState(input({ namespace: 'team-a', minInstances: 2 }));
    const b = new PoolState(input({ namespace: 'team-b', minInstances: 1 }));
    const ids = [...a.plan(0, () => tags.shift()).start, ...b.plan(0, () => tags.shift()).start];
    expect(ids).toEqual(['m-1-0a1b2c3d', 'm-2-ffee0011', 'm-1-12345678']);
    // A pool from before the patch (no tag) keeps naming them <model>-<n>.
    expect(new PoolState(input({ minInstances: 1 })).plan(0, () => undefined).start).toEqual(['m-1']);
  });

  it('cuts a long model name so the id stays one DNS label, never ending in a separator before the suffix', () => {
    const long = `${'x'.repeat(50)}-${'y'.repeat(20)}`;
    const id = instanceIdOf(long, 12, 'abcdef01');
    expect(id.length).toBeLessThanOrEqual(MAX_INSTANCE_ID);
    expect(id).toBe(`${'x'.repeat(50)}-12-abcdef01`); // the 51st character was the separator
    expect(instanceIdOf(`${'z'.repeat(51)}--q`, 7, '00000000')).toBe(`${'z'.repeat(51)}-7-00000000`);
  });
});

describe('PoolState', () => {
  it('starts nothing without load, min instances at once, and one per leasesPerInstance of leases and demand', () => {
    expect(new PoolState(input()).plan(0).start).toEqual([]);
    expect(new PoolState(input({ minInstances: 2 })).plan(0).start).toEqual(['m-1', 'm-2']);
    const s = ready(1);
    s.loaded(report({ 'm-1': [2] }), 1);
    expect(s.plan(1).start).toEqual([]); // 2 leases fill one instance exactly
    s.demanded('gw-a', 1, 1);
    expect(s.plan(1).start).toEqual(['m-2']); // the third conversation needs a second
    expect(s.plan(2).start).toEqual([]); // already starting
  });

  it('counts demand per replica until it lapses', () => {
    const s = new PoolState(input());
    s.demanded('gw-a', 3, 0);
    s.demanded('gw-b', 2, 0);
    s.demanded('gw-a', 1, 10); // replaces gw-a's
    expect(s.waiting(10)).toBe(3);
    expect(s.wanted(10)).toBe(2);
    expect(s.waiting(DEMAND_HOLD_MS + 1)).toBe(1); // gw-b's lapsed, gw-a's (sent at 10) not yet
    s.demanded('gw-a', 0, 20);
    expect(s.waiting(20)).toBe(2);
  });

  it('never goes past max, and says so in the view (not growable)', () => {
    const s = ready(2, { maxInstances: 2 });
    s.loaded(report({ 'm-1': [5], 'm-2': [5] }), 1);
    expect(s.plan(1).start).toEqual([]);
    expect(s.view()).toMatchObject({ growable: false, leasesPerInstance: 2 });
    expect(s.view().instances.map((i) => i.instance)).toEqual(['m-1', 'm-2']);
  });

  it('scales up on backlog pressure on every ready instance, one at a time', () => {
    const s = ready(2);
    s.loaded(report({ 'm-1': [1, PRESSURE_PENDING], 'm-2': [1, PRESSURE_PENDING - 1] }), 1);
    expect(s.plan(1).start).toEqual([]); // m-2 still takes requests promptly
    s.loaded(report({ 'm-1': [1, PRESSURE_PENDING], 'm-2': [1, PRESSURE_PENDING] }), 2);
    expect(s.plan(2).start).toEqual(['m-3']);
    expect(s.plan(3).start).toEqual([]);
  });

  it('drains an idle instance after its timeout, stops it after the grace once no view lists it, and takes it back if used', () => {
    const s = ready(2);
    s.loaded(report({ 'm-1': [1], 'm-2': [0] }), 1000);
    expect(s.plan(1000).stop).toEqual([]);
    expect(s.nextDeadline(1000)).toBe(60_000); // m-2 idle since its first report (1 s), not since it started
    s.plan(60_000);
    expect(s.instances.get('m-2')!.phase).toBe('ready');
    s.plan(61_000);
    expect(s.instances.get('m-2')!.phase).toBe('draining');
    expect(s.view().instances.map((i) => i.instance)).toEqual(['m-1']);
    s.writing(viewOf('m-1', 'm-2'));
    s.written(true, 62_000); // a view that still listed it was the last one written
    expect(s.plan(70_000).stop).toEqual([]);
    s.writing(viewOf('m-1'));
    s.written(true, 70_000);
    expect(s.plan(70_000).stop.map((i) => i.id)).toEqual(['m-2']);
    // Taken back: a draining instance with a conversation again is ready.
    const t = ready(2);
    t.loaded(report({ 'm-1': [1], 'm-2': [0] }), 0);
    t.plan(60_000);
    expect(t.instances.get('m-2')!.phase).toBe('draining');
    t.loaded(report({ 'm-1': [1], 'm-2': [1] }), 61_000);
    expect(t.instances.get('m-2')!.phase).toBe('ready');
  });

  it('a new instance is not idle before the reconciler has reported on it', () => {
    const s = ready(2);
    s.plan(3_600_000);
    expect([...s.instances.values()].map((i) => i.phase)).toEqual(['ready', 'ready']);
    expect(s.nextDeadline(0)).toBeUndefined();
  });

  it('restarts the idle clock when an instance becomes idle again', () => {
    const s = ready(1);
    s.loaded(report({ 'm-1': [1] }), 10_000);
    s.loaded(report({ 'm-1': [0] }), 50_000);
    expect(s.instances.get('m-1')!.idleSince).toBe(50_000);
    s.plan(100_000);
    expect(s.instances.get('m-1')!.phase).toBe('ready'); // 50 s idle, timeout 60 s
  });

  it('backs off failed starts and says why nothing can serve', () => {
    const s = new PoolState(input());
    s.demanded('gw', 1, 0);
    const [id] = s.plan(0).start;
    s.startFailed(id!, 'no fit', 0);
    expect(s.failing()).toMatch(/^no fit \(1 failed start in a row; next attempt in 5s\)$/);
    expect(s.view()).toMatchObject({ failing: s.failing(), nextStartAt: START_BACKOFF_BASE_MS });
    expect(s.plan(1000).start).toEqual([]);
    const [again] = s.plan(START_BACKOFF_BASE_MS).start;
    expect(s.failing()).toBeUndefined(); // one is starting
    s.startFailed(again!, 'no fit', START_BACKOFF_BASE_MS);
    expect(s.nextStartAt).toBe(3 * START_BACKOFF_BASE_MS);
    s.clearBackoff();
    expect(s.plan(START_BACKOFF_BASE_MS + 1).start).toHaveLength(1);
  });

  it('drops a lost instance from the view; a second loss report of it changes nothing', () => {
    const s = ready(2);
    const lost = s.instances.get('m-1')!;
    expect(s.lost(lost, 'instance m-1 stopped serving')).toBe(true);
    expect(s.lost(lost, 'again')).toBe(false);
    expect(s.view().instances.map((i) => i.instance)).toEqual(['m-2']);
    expect(s.lastError).toBe('instance m-1 stopped serving');
  });

  it('records an instance restarting in place and then its count, for the status; a report on one gone changes nothing', () => {
    const s = ready(1);
    const i = s.instances.get('m-1')!;
    const how = 'node 1 (worker) killed by SIGKILL';
    expect(s.restarted(i, { stops: 1, last: how, recovering: true })).toBe(true);
    expect(s.status(0).instances[0]).toMatchObject({ id: 'm-1', phase: 'ready', restarting: how, restarts: 1, lastRestart: how });
    expect(s.restarted(i, { stops: 1, last: how, recovering: false })).toBe(true);
    expect(s.status(0).instances[0]).toEqual({
      id: 'm-1',
      phase: 'ready',
      subject: 'magus.req.m.m-1',
      leases: 0,
      reported: false,
      restarts: 1,
      lastRestart: how,
    });
    expect(s.view().instances.map((v) => v.instance)).toEqual(['m-1']); // it keeps its conversations: restarted where it was
    expect(s.lastError).toBeNull();
    // Carried over continue-as-new, so the next run's watcher reports only what is new.
    expect(new PoolState(s.input, s.carry(0)).instances.get('m-1')!.restarts).toEqual({ stops: 1, last: how, recovering: false });
    s.lost(i, 'gone');
    expect(s.restarted(i, { stops: 2, recovering: true })).toBe(false);
  });

  it('rewrites the view for instances, growth and failure, not for lease counts alone', () => {
    const s = ready(2);
    const before = PoolState.shape(s.view());
    s.loaded(report({ 'm-1': [1], 'm-2': [2] }), 1);
    expect(PoolState.shape(s.view())).toBe(before);
    s.lost(s.instances.get('m-2')!, 'gone');
    expect(PoolState.shape(s.view())).not.toBe(before);
  });

  it('writes the view when its shape changes, one write at a time, again after a failed write, and refreshes it while it lists instances', () => {
    const s = ready(1);
    const first = s.viewToWrite(0);
    expect(first?.instances.map((i) => i.instance)).toEqual(['m-1']);
    expect(s.writeInFlight).toBe(true);
    s.demanded('gw', 5, 0);
    s.plan(0); // m-2 and m-3 start: growable still, same shape
    s.demanded('gw', 0, 0);
    expect(s.viewToWrite(0)).toBeUndefined(); // one write at a time
    s.written(false, 100);
    expect(s.viewToWrite(100)).toEqual(first); // the failed write is retried
    s.written(true, 200);
    expect(s.viewToWrite(300)).toBeUndefined(); // nothing changed
    s.loaded(report({ 'm-1': [1] }), 300);
    expect(s.viewToWrite(300)).toBeUndefined(); // lease counts alone
    s.started('m-2', { subject: 'magus.req.m.m-2' }, 400);
    expect(s.viewToWrite(400)?.instances.map((i) => i.instance)).toEqual(['m-1', 'm-2']);
    s.written(true, 500);
    expect(s.nextDeadline(500)).toBe(VIEW_REFRESH_MS); // the refresh is a deadline while instances serve
    expect(s.viewToWrite(500 + VIEW_REFRESH_MS - 1)).toBeUndefined();
    expect(s.viewToWrite(500 + VIEW_REFRESH_MS)).toBeDefined();
    // A view listing nothing is written when it changes, never refreshed.
    const empty = new PoolState(input());
    expect(empty.viewToWrite(0)?.instances).toEqual([]);
    empty.written(true, 0);
    expect(empty.viewToWrite(10 * VIEW_REFRESH_MS)).toBeUndefined();
    expect(empty.nextDeadline(0)).toBeUndefined();
  });

  it("keeps the reconciler's last report, starting from the counts a run carried over", () => {
    expect(new PoolState(input()).lastLoad).toBeNull();
    const s = ready(2);
    s.loaded(report({ 'm-1': [3, 1, 2], 'm-2': [0] }), 1);
    expect(s.lastLoad).toEqual(report({ 'm-1': [3, 1, 2], 'm-2': [0] }));
    expect(new PoolState(input(), s.carry(2)).lastLoad).toEqual(report({ 'm-1': [3, 1, 2], 'm-2': [0] }));
  });

  it('carries O(instances) across runs: 50,000 live conversations fit in well under 16 KB', () => {
    const s = ready(4, { maxInstances: 4 });
    s.loaded(report({ 'm-1': [12_500], 'm-2': [12_500], 'm-3': [12_500], 'm-4': [12_500] }), 1);
    for (let r = 0; r < 5; r++) s.demanded(`gw-${r}`, 3, 1);
    const carry = s.carry(2);
    expect(JSON.stringify(carry).length).toBeLessThan(16 * 1024);
    const next = new PoolState(input({ maxInstances: 4 }), carry);
    expect(next.status(2).instances.map((i) => [i.id, i.phase, i.leases])).toEqual([
      ['m-1', 'ready', 12_500],
      ['m-2', 'ready', 12_500],
      ['m-3', 'ready', 12_500],
      ['m-4', 'ready', 12_500],
    ]);
    expect(next.waiting(2)).toBe(15);
    expect(next.plan(2).start).toEqual([]); // at max
    expect(next.nextId).toBe(5);
  });

  it('takes a Dllama generation once, lets a deleted one scale to zero, and refuses bad sizes', () => {
    const s = new PoolState(input());
    const r = { name: 'd', uid: 'u1', generation: 2, minInstances: 1, maxInstances: 3, leasesPerInstance: 5, idleTimeoutMs: 1000, nodesPerInstance: 1 };
    expect(s.resource(r)).toBe(true);
    expect(s.input).toMatchObject({ minInstances: 1, maxInstances: 3, leasesPerInstance: 5 });
    expect(s.resource({ ...r })).toBe(false);
    expect(s.resource({ ...r, generation: 3, minInstances: 4 })).toBe(false);
    expect(s.resource({ ...r, generation: 3, deleted: true })).toBe(true);
    expect(s.input.minInstances).toBe(0);
  });
});

describe('scaling on load (pool-scale-on-load)', () => {
  /** A pool on load with `n` ready instances m-1..m-n at time 0 (two slots each). */
  function onLoad(n: number): PoolState {
    const s = new PoolState(input({ minInstances: n, scaleOn: 'load' }), undefined, { onLoad: true });
    for (const id of s.plan(0).start) s.started(id, { subject: `magus.req.m.${id}` }, 0);
    s.input.minInstances = 0;
    return s;
  }

  it('wants one instance per slots of requests in flight or queued, whatever the conversations; one while any conversation lives', () => {
    const s = onLoad(1);
    // 500 live conversations, 1 request in flight: one instance does (on leases it would be the maximum).
    s.loaded(report({ 'm-1': [500, 0, 1] }), 1);
    expect(s.wanted(1)).toBe(1);
    expect(s.plan(1).start).toEqual([]);
    // Both slots taken and three queued: ⌈5 / 2⌉.
    s.loaded(report({ 'm-1': [500, 3, 2] }), 2);
    expect(s.wanted(2)).toBe(3);
    expect(s.plan(2).start).toEqual(['m-2', 'm-3']);
    // Nothing in flight, conversations live: one stays (their prefixes); none live: none.
    s.loaded(report({ 'm-1': [500, 0, 0] }), 3);
    expect(s.wanted(3)).toBe(1);
    s.loaded(report({ 'm-1': [0, 0, 0] }), 4);
    expect(s.wanted(4)).toBe(0);
    // The same report on leases: the conversations fill the maximum.
    const leases = ready(1);
    leases.loaded(report({ 'm-1': [500, 0, 1] }), 1);
    expect(leases.wanted(1)).toBe(4);
  });

  it('a burst grows the pool, and the pool shrinks back idleTimeout after it: an instance with idle conversations is drained, its conversations move', () => {
    const s = onLoad(1);
    s.loaded(report({ 'm-1': [40, 6, 2] }), 1000);
    const started = s.plan(1000).start;
    expect(started).toHaveLength(3);
    for (const id of started) s.started(id, { subject: `magus.req.m.${id}` }, 2000);
    // The burst, spread: every instance busy.
    s.loaded(report({ 'm-1': [10, 0, 2], [started[0]!]: [10, 0, 2], [started[1]!]: [10, 0, 2], [started[2]!]: [10, 0, 1] }), 3000);
    expect(s.plan(3000)).toEqual({ start: [], stop: [] });
    // It ends at 10 s: conversations live on every instance, none has a request.
    s.loaded(report({ 'm-1': [10, 0, 0], [started[0]!]: [10, 0, 0], [started[1]!]: [10, 0, 0], [started[2]!]: [10, 0, 0] }), 10_000);
    expect(s.wanted(10_000)).toBe(1);
    expect(s.nextDeadline(10_000)).toBe(60_000); // idleTimeout after it ended
    s.plan(69_999);
    expect(s.view().instances).toHaveLength(4);
    s.plan(70_000);
    // Three drained (unpublished: their conversations move at their next turn), one kept.
    expect(s.view().instances).toHaveLength(1);
    expect([...s.instances.values()].filter((i) => i.phase === 'draining')).toHaveLength(3);
    s.writing(s.view());
    s.written(true, 70_000);
    expect(s.plan(75_000).stop).toHaveLength(3); // after the drain grace
    expect(s.view()).toMatchObject({ scalesOn: 'load' });
    // The Temporal UI's page says what sizes it.
    expect(poolDetails(s.input, s.phase(), s.status(75_000), s.onLoad)).toContain(
      'scales on load (2 requests in flight or queued per instance) · 40 live conversations',
    );
    // On leases, the same idle conversations hold all four.
    const leases = ready(4);
    leases.loaded(report({ 'm-1': [10], 'm-2': [10], 'm-3': [10], 'm-4': [10] }), 10_000);
    leases.plan(200_000);
    expect(leases.view().instances).toHaveLength(4);
    expect(leases.view()).not.toHaveProperty('scalesOn');
  });

  it('a report counted for the pool as a whole (the server counts its entries) decides, shows and carries as the leases did', () => {
    const s = onLoad(1);
    // 500 conversations counted by the server; no instance has leases counted.
    s.loaded({ ...report({ 'm-1': [0, 0, 0] }), live: 500 }, 1);
    expect(s.wanted(1)).toBe(1); // one stays while any conversation lives
    expect(s.status(1).live).toBe(500);
    const details = poolDetails(s.input, s.phase(), s.status(1), s.onLoad);
    expect(details).toContain('· 500 live conversations');
    expect(details).not.toContain('0 leases'); // per instance: not counted, so not said
    // Carried into the next run, and known to its reconciler.
    const next = new PoolState(s.input, s.carry(2), { onLoad: true });
    expect(next.lastLoad).toMatchObject({ live: 500 });
    expect(next.status(2).live).toBe(500);
    next.loaded({ ...report({ 'm-1': [0, 0, 0] }), live: 0 }, 3);
    expect(next.wanted(3)).toBe(0);
    // A report without it (an older worker's) counts the instances' leases again.
    next.loaded(report({ 'm-1': [7, 0, 0] }), 4);
    expect(next.wanted(4)).toBe(1);
    expect(next.status(4)).not.toHaveProperty('live');
  });

  it('an instance drained while idle is taken back when a request reaches it after all', () => {
    const s = onLoad(2);
    s.loaded(report({ 'm-1': [3, 0, 0], 'm-2': [3, 0, 0] }), 0);
    s.plan(60_000);
    const drained = [...s.instances.values()].find((i) => i.phase === 'draining')!;
    s.loaded(report({ 'm-1': [3, 0, 0], [drained.id]: [3, 0, 1] }), 61_000);
    expect(s.instances.get(drained.id)!.phase).toBe('ready');
  });
});

describe('restarts in place, as a watcher reports them and the pool page shows them', () => {
  const how = 'node 1 (worker) killed by SIGKILL';
  it('a watcher reports a new stop, then the end of the restart, and nothing else', () => {
    const none = { stops: 0, recovering: false };
    expect(restartChange(none, none)).toBeNull();
    expect(restartChange(none, { stops: 1, last: how, recovering: true })).toEqual({ reason: how, restart: { stops: 1, last: how, recovering: true } });
    // Restarted between two looks: one report, already recovered.
    expect(restartChange(none, { stops: 1, last: how, recovering: false })).toMatchObject({ restart: { stops: 1, recovering: false } });
    expect(restartChange({ stops: 1, last: how, recovering: true }, { stops: 1, last: how, recovering: true })).toBeNull();
    expect(restartChange({ stops: 1, last: how, recovering: true }, { stops: 1, last: how, recovering: false })).toMatchObject({
      restart: { recovering: false },
    });
  });

  it('the Temporal UI page says an instance restarts, and how often it did', () => {
    const s = ready(1);
    const i = s.instances.get('m-1')!;
    s.restarted(i, { stops: 1, last: how, recovering: true });
    expect(poolDetails(s.input, s.phase(), s.status(0))).toContain(`- \`m-1\` **restarting** (${how}), 0 leases`);
    s.restarted(i, { stops: 2, last: how, recovering: false });
    expect(poolDetails(s.input, s.phase(), s.status(0))).toContain(`- \`m-1\` ready, 0 leases; restarted 2 times, last: ${how}`);
  });
});

describe('rollout to a new model revision', () => {
  /** `n` ready instances serving revision `r1`, with these reported loads. */
  function at(n: number, loads: Record<string, [number, number?, number?]>, over: Partial<PoolInput> = {}): PoolState {
    const s = new PoolState(input({ minInstances: n, ...over }));
    for (const id of s.plan(0).start) s.started(id, { subject: `magus.req.m.${id}`, revision: 'r1' }, 0);
    s.input.minInstances = over.minInstances ?? 0;
    s.loaded(report(loads), 0);
    return s;
  }
  /** Writes the view a plan leaves (as the workflow does) and returns its instances. */
  const publish = (s: PoolState, now: number): string[] => {
    const v = s.viewToWrite(now) ?? s.view();
    s.written(true, now);
    return v.instances.map((i) => i.instance);
  };

  it('starts new instances beside the old, retires an old one only once a new one serves, and stops it once its answers in flight ended', () => {
    const s = at(1, { 'm-1': [2, 0, 2] }); // two conversations, both answering now
    expect(s.revision).toBe('r1'); // the first instance said its revision
    expect(s.revisionPublished('r1')).toBe(false);
    expect(s.revisionPublished('r2')).toBe(true);
    const p1 = s.plan(1000);
    expect(p1.start).toEqual(['m-2']); // a surge past maxInstances is allowed; the old still serves
    expect(p1.stop).toEqual([]);
    expect(publish(s, 1000)).toEqual(['m-1']);

    s.started('m-2', { subject: 'magus.req.m.m-2', revision: 'r2' }, 2000);
    s.plan(2000);
    // m-1 is unpublished at once: new first turns, and its conversations at their next turn, go to m-2.
    expect(publish(s, 2000)).toEqual(['m-2']);
    expect(s.status(2000).instances).toEqual([
      expect.objectContaining({ id: 'm-1', phase: 'draining', revision: 'r1', retiring: 'revision r1 is replaced by r2', inFlight: 2 }),
      expect.objectContaining({ id: 'm-2', phase: 'ready', revision: 'r2' }),
    ]);
    // Its conversations still count: the pool does not shrink below what they need.
    expect(s.wanted(2000)).toBe(1);
    // The reconciler has not reported since: what it had of m-1's flight may be stale, so m-1 stays past the grace.
    expect(s.plan(10_000).stop).toEqual([]);
    s.loaded(report({ 'm-1': [2, 0, 1], 'm-2': [0] }), 10_000);
    expect(s.plan(10_000).stop).toEqual([]); // one answer still in flight
    expect(s.nextDeadline(10_000)).toBeGreaterThan(0); // no busy loop while it finishes
    s.loaded(report({ 'm-1': [2, 0, 0], 'm-2': [0] }), 12_000);
    const p3 = s.plan(12_000);
    expect(p3.stop.map((i) => i.id)).toEqual(['m-1']); // its leases do not hold it: they move
    s.stopped('m-1');
    expect(s.status(12_000).instances.map((i) => i.id)).toEqual(['m-2']);
    expect(poolDetails(s.input, s.phase(), s.status(12_000))).not.toContain('rolling out');
  });

  it('stops an old instance at the drain deadline whatever it still has in flight', () => {
    const s = at(1, { 'm-1': [1, 0, 1] }, { drainTimeoutMs: 30_000 });
    s.revisionPublished('r2');
    s.plan(0);
    s.started('m-2', { subject: 'magus.req.m.m-2', revision: 'r2' }, 1000);
    s.plan(1000);
    publish(s, 1000);
    s.loaded(report({ 'm-1': [1, 0, 1], 'm-2': [0] }), 5000);
    expect(s.plan(5000).stop).toEqual([]);
    expect(s.nextDeadline(5000)).toBe(1000); // the grace's end
    expect(s.nextDeadline(6000)).toBe(25_000); // then the deadline
    expect(poolDetails(s.input, s.phase(), s.status(5000))).toContain('**rolling out**: 1 instance being replaced draining, 1 answer in flight on them');
    expect(s.plan(31_000).stop.map((i) => i.id)).toEqual(['m-1']);
  });

  it('keeps old instances serving while new ones cannot start, and retires them one for one as new ones serve', () => {
    const s = at(2, { 'm-1': [2], 'm-2': [2] });
    s.revisionPublished('r2');
    expect(s.plan(0).start).toEqual(['m-3', 'm-4']);
    s.startFailed('m-3', 'no room', 0);
    s.started('m-4', { subject: 'magus.req.m.m-4', revision: 'r2' }, 100);
    s.plan(100);
    // One new one serves: one old one (either: both have 2 leases) retires, the other keeps serving.
    const phases = s.status(100).instances.map((i) => `${i.id}:${i.phase}`);
    expect(phases.filter((p) => p.endsWith(':draining'))).toHaveLength(1);
    expect(phases).toContain('m-4:ready');
    expect(s.view().instances.map((i) => i.instance)).toHaveLength(2);
  });

  it('retires idle old instances at once when nothing wants a new one, and carries a rollout into the next run', () => {
    const s = at(1, { 'm-1': [0] });
    s.revisionPublished('r2');
    expect(s.plan(0).start).toEqual([]); // no load: no new instance
    expect(s.status(0).instances[0]).toMatchObject({ phase: 'draining', retiring: 'revision r1 is replaced by r2' });
    const next = new PoolState(s.input, s.carry(0));
    expect(next.revision).toBe('r2');
    expect(next.status(0).instances[0]).toMatchObject({ id: 'm-1', phase: 'draining', revision: 'r1' });
    // Its flight must be reported again in the new run before it stops.
    publish(next, 0);
    expect(next.plan(6000).stop).toEqual([]);
    next.loaded(report({ 'm-1': [0] }), 6000);
    expect(next.plan(6000).stop.map((i) => i.id)).toEqual(['m-1']);
  });

  it('never replaces instances whose runtime did not say a revision, nor any before the revision is known', () => {
    const s = new PoolState(input({ minInstances: 1 }));
    for (const id of s.plan(0).start) s.started(id, { subject: `magus.req.m.${id}` }, 0);
    expect(s.revision).toBeNull();
    s.revisionPublished('r2');
    expect(s.plan(1).start).toEqual([]);
    expect(s.status(1).instances[0]!.phase).toBe('ready');
  });
});

describe('rollout to a new instance spec (its Dllama changed how instances are built)', () => {
  const resource = (generation: number, instanceSpec?: string) => ({
    name: 'd',
    uid: 'u1',
    generation,
    minInstances: 1,
    maxInstances: 2,
    leasesPerInstance: 2,
    idleTimeoutMs: 60_000,
    nodesPerInstance: 1,
    ...(instanceSpec ? { instanceSpec } : {}),
  });
  const spec = (digest: string, generation: number) => ({ digest, uid: 'u1', generation });
  /** A pool sized by generation 2 (spec `a`), its one instance built from it and reported idle. */
  function pool(): PoolState {
    const s = new PoolState(input());
    expect(s.resource(resource(2, 'a'))).toBe(true);
    for (const id of s.plan(0).start) s.started(id, { subject: `magus.req.m.${id}`, spec: spec('a', 2) }, 0);
    s.loaded(report({ 'm-1': [1] }), 0);
    return s;
  }

  it('a change that only sizes the pool replaces nothing; one that changes the spec starts a new instance and retires the old once it serves', () => {
    const s = pool();
    expect(s.resource(resource(3, 'a'))).toBe(true); // e.g. the idle timeout
    expect(s.plan(1000)).toEqual({ start: [], stop: [] });
    expect(s.resource(resource(4, 'b'))).toBe(true); // e.g. a new image
    expect(s.plan(2000).start).toEqual(['m-2']);
    expect(s.status(2000).instances.find((i) => i.id === 'm-1')!.phase).toBe('ready'); // serves until the new one does
    s.started('m-2', { subject: 'magus.req.m.m-2', spec: spec('b', 4) }, 3000);
    expect(s.plan(3000).start).toEqual([]);
    expect(s.status(3000).instances).toEqual([
      expect.objectContaining({ id: 'm-1', phase: 'draining', retiring: 'built from Dllama generation 2, replaced by instances of generation 4' }),
      expect.objectContaining({ id: 'm-2', phase: 'ready' }),
    ]);
    // Carried into the next run: the new one is not replaced, the old one still drains.
    const next = new PoolState(s.input, s.carry(3000));
    expect(next.spec).toEqual(spec('b', 4));
    expect(next.plan(3000).start).toEqual([]);
    expect(next.status(3000).instances.map((i) => `${i.id}:${i.phase}`)).toEqual(['m-1:draining', 'm-2:ready']);
  });

  it('a start that read a generation not yet signalled is the newest spec: the older instance is replaced, the new one is not, and nothing loops', () => {
    const s = pool();
    s.input.minInstances = 2;
    expect(s.plan(1000).start).toEqual(['m-2']);
    s.started('m-2', { subject: 'magus.req.m.m-2', spec: spec('b', 5) }, 2000);
    expect(s.spec).toEqual(spec('b', 5));
    const p = s.plan(2000);
    expect(p.start).toEqual(['m-3']); // m-1 no longer counts; m-2 does
    expect(s.status(2000).instances.find((i) => i.id === 'm-2')!.phase).toBe('ready');
    // The controller's signal of that generation (or an older one, late) changes nothing more.
    s.resource(resource(5, 'b'));
    expect(s.spec).toEqual(spec('b', 5));
    s.started('m-3', { subject: 'magus.req.m.m-3', spec: spec('b', 5) }, 3000);
    expect(s.plan(3000).start).toEqual([]);
    expect(
      s
        .status(3000)
        .instances.filter((i) => i.retiring)
        .map((i) => i.id),
    ).toEqual(['m-1']);
  });

  it('never replaces instances whose runtime did not say their spec, nor any while the pool knows none', () => {
    const s = new PoolState(input({ minInstances: 1 }));
    for (const id of s.plan(0).start) s.started(id, { subject: `magus.req.m.${id}` }, 0);
    s.resource(resource(2, 'b'));
    expect(s.plan(1000).start).toEqual([]);
    const t = new PoolState(input({ minInstances: 1 }));
    for (const id of t.plan(0).start) t.started(id, { subject: `magus.req.m.${id}`, spec: spec('a', 2) }, 0);
    t.resource(resource(3)); // a controller from before specs
    expect(t.plan(1000).start).toEqual([]);
    expect(t.status(1000).instances[0]!.phase).toBe('ready');
  });
});

describe('the view lists instances being started (pool-view-starting)', () => {
  it('writes a view when a start begins, naming it and since when; pools before the patch write none', () => {
    const s = new PoolState(input({ minInstances: 1 }));
    expect(s.plan(1000, () => 'abcdef01').start).toEqual(['m-1-abcdef01']);
    const v = s.viewToWrite(1000, true);
    expect(v).toMatchObject({ instances: [], starting: [{ instance: 'm-1-abcdef01', since: 1000 }] });
    s.written(true, 1000);
    s.started('m-1-abcdef01', { subject: 'magus.req.m.m-1-abcdef01' }, 3000);
    const ready = s.viewToWrite(3000, true)!;
    expect(ready.instances.map((i) => i.instance)).toEqual(['m-1-abcdef01']);
    expect(ready.starting).toBeUndefined();
    // Without the patch: no write for the start (an older history's commands).
    const old = new PoolState(input({ minInstances: 1 }));
    old.viewToWrite(0, false);
    old.written(true, 0);
    expect(old.plan(0).start).toHaveLength(1);
    expect(old.viewToWrite(0, false)).toBeUndefined();
  });
});
