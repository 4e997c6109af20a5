/**
 * The engine registry holds together: every engine declared in shared/engines.ts has a launcher,
 * the `Dllama` resource's `engine` enum (in the CRD and in the chart's copy) lists exactly the
 * declared kinds, and the bridge's usage names them.
 */
import { loadAllYaml } from '@kubernetes/client-node';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { ENGINE_KINDS, ENGINES, concurrentRequests, enginesLoading } from '../../shared/engines';
import { BRIDGE_USAGE } from '../../workers/bridge';
import { LAUNCHERS } from './engines';

const ROOT = join(__dirname, '..', '..');

/** The `engine` enum of the Dllama CRD at `path`. */
function crdEngines(path: string): string[] {
  const [crd] = loadAllYaml(readFileSync(join(ROOT, path), 'utf8')) as {
    spec: { versions: { schema: { openAPIV3Schema: { properties: { spec: { properties: { engine: { enum: string[] } } } } } } }[] };
  }[];
  return crd!.spec.versions[0]!.schema.openAPIV3Schema.properties.spec.properties.engine.enum;
}

test('every declared engine has a launcher, and nothing else does', () => {
  expect(Object.keys(LAUNCHERS).sort()).toEqual([...ENGINE_KINDS].sort());
});

test.each(['crds/dllama.yaml', 'charts/magus/files/crds/dllama.yaml'])('%s: Dllama.spec.engine lists the declared engines', (path) => {
  expect(crdEngines(path).sort()).toEqual([...ENGINE_KINDS].sort());
});

test('the bridge names every engine kind', () => {
  for (const kind of ENGINE_KINDS) expect(BRIDGE_USAGE).toContain(kind);
});

test('what follows from the declarations', () => {
  expect(enginesLoading('gguf')).toEqual(['llamacpp']);
  expect(enginesLoading('dllama')).toEqual(['dllama']);
  // distributed-llama answers one request at a time, whatever its instance was sized for.
  expect(concurrentRequests('dllama', 8)).toBe(1);
  expect(concurrentRequests('llamacpp', 8)).toBe(8);
  expect(ENGINES.dllama.capabilities).toEqual([]);
});
