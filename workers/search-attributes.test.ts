import type { Connection } from '@temporalio/client';
import { ensureSearchAttributes } from './worker';

/** A connection whose operator service refuses or accepts as told, recording what was added. */
function fake(add: (name: string) => Promise<unknown>, list: () => Promise<{ customAttributes: Record<string, number> }>) {
  const added: string[] = [];
  const connection = {
    operatorService: {
      addSearchAttributes: ({ searchAttributes }: { searchAttributes: Record<string, number> }) => {
        const name = Object.keys(searchAttributes)[0]!;
        return add(name).then(() => added.push(name));
      },
      listSearchAttributes: list,
    },
  } as unknown as Connection;
  return { connection, added };
}
const refused = (code: number, message: string) => Object.assign(new Error(message), { code });

test('each attribute is added on its own: one that exists does not keep the others out', async () => {
  const { connection, added } = fake(
    (n) => (n === 'MagusKind' ? Promise.reject(refused(6, 'Search attribute MagusKind already exists.')) : Promise.resolve()),
    () => Promise.reject(new Error('unused')),
  );
  await ensureSearchAttributes(connection, 'default');
  expect(added).toEqual(['MagusModel', 'MagusPhase']);
});

test('a Temporal that refuses the worker: fine when an operator added them, a clear error naming the fix when one is missing', async () => {
  const denied = () => Promise.reject(refused(7, 'Request unauthorized.'));
  const all = fake(denied, () => Promise.resolve({ customAttributes: { MagusKind: 2, MagusModel: 2, MagusPhase: 2 } }));
  await expect(ensureSearchAttributes(all.connection, 'prod')).resolves.toBeUndefined();
  const some = fake(denied, () => Promise.resolve({ customAttributes: { MagusKind: 2, MagusModel: 2 } }));
  await expect(ensureSearchAttributes(some.connection, 'prod')).rejects.toThrow(
    'the search attribute MagusPhase is missing in Temporal namespace prod and this worker may not add it (Request unauthorized.); add it once: temporal operator search-attribute create --namespace prod --name MagusPhase --type Keyword',
  );
  const other = fake(
    () => Promise.reject(refused(13, 'internal')),
    () => Promise.resolve({ customAttributes: {} }),
  );
  await expect(ensureSearchAttributes(other.connection, 'prod')).rejects.toThrow('internal');
});
