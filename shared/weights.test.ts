/**
 * The weights formats and the ggml types hold together: what follows from each declaration, the
 * ggml table's ids, and the `Model` resource's `weights` enums (in the CRD and in the chart's
 * copy), which list exactly the declared formats and `source`.
 */
import { loadAllYaml } from '@kubernetes/client-node';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { GGML_TYPES, ggmlLayout, ggmlTypeName } from './ggml';
import { isBlockQuantized, isWeightsFormat, WEIGHTS_FORMATS, WEIGHTS_PREFERENCE, weightsFormat } from './weights';

const ROOT = join(__dirname, '..');

interface Schema {
  properties?: Record<string, Schema>;
  items?: Schema;
  enum?: string[];
}

/** Every `weights` property's enum in the Model CRD at `path`, by its place in the schema. */
function crdWeightsEnums(path: string): Map<string, string[]> {
  const [crd] = loadAllYaml(readFileSync(join(ROOT, path), 'utf8')) as { spec: { versions: { schema: { openAPIV3Schema: Schema } }[] } }[];
  const found = new Map<string, string[]>();
  const walk = (s: Schema, at: string): void => {
    for (const [name, p] of Object.entries(s.properties ?? {})) {
      if (name === 'weights') found.set(`${at}.weights`, p.enum ?? []);
      walk(p, `${at}.${name}`);
    }
    if (s.items) walk(s.items, `${at}[]`);
  };
  for (const version of crd!.spec.versions) walk(version.schema.openAPIV3Schema, '');
  return found;
}

test.each(['crds/model.yaml', 'charts/magus/files/crds/model.yaml'])('%s: every weights enum lists the declared formats and source', (path) => {
  const enums = crdWeightsEnums(path);
  expect([...enums.keys()]).toEqual(expect.arrayContaining(['.spec.artifacts[].weights', '.status.artifacts[].weights', '.status.sizing[].weights']));
  for (const [, values] of enums) expect([...values].sort()).toEqual([...WEIGHTS_FORMATS, 'source'].sort());
});

test('the formats, in preference order', () => {
  expect(WEIGHTS_FORMATS).toEqual(['q40', 'q80', 'f16', 'f32']);
  expect(WEIGHTS_PREFERENCE).toEqual(['source', 'q40', 'q80', 'f16', 'f32']);
  expect(WEIGHTS_FORMATS.map((f) => weightsFormat(f).rank)).toEqual([0, 1, 2, 3]);
  expect(isWeightsFormat('q40')).toBe(true);
  expect(isWeightsFormat('source')).toBe(false);
  expect(isWeightsFormat('toString')).toBe(false);
});

test('what follows from each declaration', () => {
  const row = (f: (typeof WEIGHTS_FORMATS)[number]) => {
    const w = weightsFormat(f);
    return [w.ggml, w.ggmlType, w.blockSize, w.blockBytes, w.blockQuantized, w.bitsPerValue, w.dllamaFloatType, w.llamaFileType];
  };
  expect(row('q40')).toEqual(['Q4_0', 2, 32, 18, true, 4.5, 2, 2]);
  expect(row('q80')).toEqual(['Q8_0', 8, 32, 34, true, 8.5, 3, 7]);
  expect(row('f16')).toEqual(['F16', 1, 1, 2, false, 16, 1, 1]);
  expect(row('f32')).toEqual(['F32', 0, 1, 4, false, 32, 0, 0]);
  expect(WEIGHTS_FORMATS.filter(isBlockQuantized)).toEqual(['q40', 'q80']);
  expect(weightsFormat('q80').bytesPerValue).toBe(34 / 32);
});

test('the ggml table: ids in order, names and layouts by id', () => {
  expect(Object.values(GGML_TYPES).map((t) => t.id)).toEqual([...Array(40).keys()]);
  expect([ggmlTypeName(2), ggmlTypeName(30), ggmlTypeName(39), ggmlTypeName(40)]).toEqual(['Q4_0', 'BF16', 'MXFP4', 'type 40']);
  expect(ggmlLayout(12)).toEqual({ name: 'Q4_K', id: 12, blockSize: 256, typeSize: 144 });
  // Retired ids keep a name but have no layout.
  expect([ggmlTypeName(4), ggmlLayout(4), ggmlLayout(31), ggmlLayout(40)]).toEqual(['Q4_2', undefined, undefined, undefined]);
});
