import type { ReadyModel } from '../../shared/model';
import { FULL_HOLD_MS, FullBacklogs } from './backlogs';

const model = { namespace: 'team', name: 'm' } as ReadyModel;

test('a model is full while every instance its pool publishes refused a publish within the hold, and not after', () => {
  let now = 1_000_000;
  let instances: string[] | undefined = ['i1', 'i2'];
  const b = new FullBacklogs(
    () => instances,
    () => now,
  );
  expect(b.full(model)).toBe(false);
  b.refused({ namespace: 'team', pool: 'm', instance: 'i1' });
  expect(b.full(model)).toBe(false); // i2 may still take it
  b.refused({ namespace: 'other', pool: 'm', instance: 'i2' }); // another namespace's pool of the same name
  expect(b.full(model)).toBe(false);
  now += 10;
  b.refused({ namespace: 'team', pool: 'm', instance: 'i2' });
  expect(b.full(model)).toBe(true);
  now += FULL_HOLD_MS - 10; // i1's mark is past its hold
  expect(b.full(model)).toBe(false);
  b.refused({ namespace: 'team', pool: 'm', instance: 'i1' });
  expect(b.full(model)).toBe(true);
  // An instance the pool publishes now that has refused nothing: not full.
  instances = ['i1', 'i2', 'i3'];
  expect(b.full(model)).toBe(false);
  // No view, or an empty one: no pre-check.
  instances = undefined;
  expect(b.full(model)).toBe(false);
  instances = [];
  expect(b.full(model)).toBe(false);
});

test('an entry of no namespace is the default namespace', () => {
  const b = new FullBacklogs(
    () => ['i1'],
    () => 5,
  );
  b.refused({ pool: 'm', instance: 'i1' });
  expect(b.full({ namespace: 'default', name: 'm' } as ReadyModel)).toBe(true);
});
