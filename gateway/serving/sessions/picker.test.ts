/** The instance a conversation goes to: the most room, counting every replica's entries and this one's picks in flight. */
import type { PoolEntry } from '../../../shared/serving';
import { readyModel } from '../../../test/harness/gateway-app';
import type { SessionMirror } from './mirror';
import { InstancePicker } from './picker';
import type { PoolViews } from './pool-views';
import { SessionCounters } from './stats';
import type { QueueWaitsView } from './types';

const model = readyModel('tiny');
const view = (over: Partial<PoolEntry> = {}): PoolEntry => ({
  instances: ['i1', 'i2'].map((instance) => ({ instance, subject: `magus.req.tiny.${instance}`, leases: 0 })),
  leasesPerInstance: 2,
  growable: true,
  updatedAt: 0,
  ...over,
});

function pickerWith(
  leases: Record<string, number>,
  entry: PoolEntry | undefined,
  stale = false,
  waits?: QueueWaitsView,
  silent?: (pool: string, instance: string) => boolean,
  stopping?: (pool: string, instance: string) => boolean,
) {
  const mirror = { counts: true, leasesOn: (_ns: string, _pool: string, instance: string) => leases[instance] ?? 0 } as unknown as SessionMirror;
  const views = { viewOf: () => entry, stale: () => stale } as unknown as PoolViews;
  const counters = new SessionCounters();
  return { picker: new InstancePicker(mirror, views, counters, waits, silent, stopping), counters };
}

it('picks the instance with the fewest entries, counting reservations until released', () => {
  const { picker } = pickerWith({ i1: 0, i2: 1 }, view());
  const a = picker.reserve(model, picker.pick(model)!);
  expect(a.instance).toBe('i1');
  const b = picker.reserve(model, picker.pick(model)!);
  expect(b.instance).toBe('i1');
  expect(picker.pick(model)?.instance).toBe('i2');
  picker.release(model, 'i1');
  expect(picker.pick(model)?.instance).toBe('i1');
});

it('with every instance full: none while the pool can grow; the least loaded when it cannot, or for a request that takes no lease', () => {
  expect(pickerWith({ i1: 2, i2: 3 }, view()).picker.pick(model)).toBeUndefined();
  expect(pickerWith({ i1: 3, i2: 2 }, view()).picker.pick(model, { anyLoad: true })?.instance).toBe('i2');
  expect(pickerWith({ i1: 3, i2: 2 }, view({ growable: false })).picker.pick(model)?.instance).toBe('i2');
  expect(pickerWith({}, undefined).picker.pick(model)).toBeUndefined();
});

it('counts picks from a stale view', () => {
  const { picker, counters } = pickerWith({}, view(), true);
  picker.pick(model);
  expect(counters.staleViewPicks).toBe(1);
});

it('`busier` ranks before leases (answers just moved to an instance), and `avoid` leaves one out', () => {
  const three = view({ instances: ['i1', 'i2', 'i3'].map((instance) => ({ instance, subject: `magus.req.tiny.${instance}`, leases: 0 })) });
  const { picker } = pickerWith({ i1: 0, i2: 0, i3: 5 }, three);
  const moved: Record<string, number> = { i2: 1 };
  expect(picker.pick(model, { anyLoad: true, avoid: 'i1', busier: (i) => moved[i] ?? 0 })?.instance).toBe('i3');
  moved.i3 = 1;
  expect(picker.pick(model, { anyLoad: true, avoid: 'i1', busier: (i) => moved[i] ?? 0 })?.instance).toBe('i2');
  expect(picker.pick(model, { anyLoad: true, avoid: 'i2' })?.instance).toBe('i1');
});

it('a pool that scales on load: no lease limit, the emptiest instance by its bridge’s load first, leases only between equals', () => {
  const full: Record<string, number | undefined> = { i1: 0.5, i2: 2 };
  const waits = { overBudget: () => false, occupancy: (_p: string, i: string) => full[i] } as unknown as QueueWaitsView;
  // Far more conversations than leasesPerInstance on both: still placed, on the one with a free slot.
  const { picker } = pickerWith({ i1: 900, i2: 10 }, view({ scalesOn: 'load' }), false, waits);
  expect(picker.pick(model)?.instance).toBe('i1');
  full.i1 = 3;
  expect(picker.pick(model)?.instance).toBe('i2');
  // Equally full (or not heard): the fewer conversations.
  full.i1 = full.i2 = undefined;
  expect(picker.pick(model)?.instance).toBe('i2');
  // The same leases on a pool that scales on them: full, so none (the pool may grow).
  expect(pickerWith({ i1: 900, i2: 10 }, view(), false, waits).picker.pick(model)).toBeUndefined();
});

it('an instance whose bridge went silent comes last: after a crowded one, one just moved to, and more leases', () => {
  const quiet = new Set(['i1']);
  const crowded = { overBudget: (_p: string, i: string) => i === 'i2', occupancy: () => undefined } as unknown as QueueWaitsView;
  const { picker } = pickerWith({ i1: 0, i2: 1 }, view(), false, crowded, (pool, i) => pool === 'tiny' && quiet.has(i));
  expect(picker.pick(model)?.instance).toBe('i2');
  expect(picker.pick(model, { anyLoad: true, busier: (i) => (i === 'i2' ? 5 : 0) })?.instance).toBe('i2');
  // The one left: a moved answer goes there rather than nowhere.
  expect(picker.pick(model, { anyLoad: true, avoid: 'i2' })?.instance).toBe('i1');
  quiet.clear();
  expect(picker.pick(model)?.instance).toBe('i1');
});

it('an instance whose bridge says it stops comes after every live one, before a silent one', () => {
  const leaving = new Set(['i1']);
  const quiet = new Set<string>();
  const crowded = { overBudget: (_p: string, i: string) => i === 'i2', occupancy: () => undefined } as unknown as QueueWaitsView;
  const { picker } = pickerWith(
    { i1: 0, i2: 1, i3: 2 },
    view({ instances: ['i1', 'i2', 'i3'].map((instance) => ({ instance, subject: `magus.req.tiny.${instance}`, leases: 0 })) }),
    false,
    crowded,
    (_pool, i) => quiet.has(i),
    (_pool, i) => leaving.has(i),
  );
  // Fewest leases and an empty queue, but going: a crowded live one first.
  expect(picker.pick(model, { anyLoad: true, avoid: 'i3' })?.instance).toBe('i2');
  expect(picker.pick(model, { anyLoad: true })?.instance).toBe('i3');
  // Silent is worse than stopping.
  quiet.add('i2');
  quiet.add('i3');
  expect(picker.pick(model, { anyLoad: true })?.instance).toBe('i1');
  leaving.clear();
  quiet.clear();
  expect(picker.pick(model)?.instance).toBe('i1');
});
