/**
 * Which engine on standby the local runtime keeps (llama-cpp.ts `standbyKind`): `auto` makes its
 * context ahead only when a second KV cache fits in half the memory free at that standby's start.
 */
import { standbyKind } from './llama-cpp';

const GIB = 2 ** 30;

test('warm or mapped as said, whatever the memory', () => {
  expect(standbyKind('warm', undefined, () => 0)()).toBe('warm');
  expect(standbyKind('mapped', 1, () => 100 * GIB)()).toBe('mapped');
});

test('auto: warm while the KV cache fits in half the free memory, asked again at each start', () => {
  let free = 4 * GIB;
  const kind = standbyKind('auto', 1.5 * GIB, () => free);
  expect(kind()).toBe('warm');
  free = 2.9 * GIB;
  expect(kind()).toBe('mapped');
  free = 3 * GIB;
  expect(kind()).toBe('warm');
});

test('auto beside an engine still loading: its own KV cache, not made yet, counts as taken', () => {
  const kind = standbyKind('auto', 1 * GIB, () => 2.9 * GIB);
  expect(kind()).toBe('warm');
  expect(kind(true)).toBe('mapped');
  expect(standbyKind('auto', 1 * GIB, () => 4 * GIB)(true)).toBe('warm');
});

test('auto without a memory plan (its KV cache unknown): mapped', () => {
  expect(standbyKind('auto', undefined, () => 100 * GIB)()).toBe('mapped');
});
