/**
 * The ApiKey CRD's `spec.limits` (crds/apikey.yaml and the chart's copy) is KeyLimits
 * (shared/limits.ts): the same fields, integers with the same bounds, the budget's two fields
 * required and its periods the same — so what admission accepts the controller can always write
 * and the gateway always enforce, and what it refuses neither would take.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { loadAllYaml } from '@kubernetes/client-node';
import { KeyLimits } from '../shared/limits';

interface Schema {
  type?: string;
  minimum?: number;
  maximum?: number;
  enum?: string[];
  required?: string[];
  maxProperties?: number;
  properties?: Record<string, Schema>;
  /** The CRD's map values. */
  additionalProperties?: Schema | boolean;
  /** TypeBox's map values (keyed by the pattern a key must match). */
  patternProperties?: Record<string, Schema>;
}

/** The schema of a map's values: the CRD's `additionalProperties`, TypeBox's one `patternProperties`. */
const valuesOf = (s: Schema): Schema | undefined =>
  typeof s.additionalProperties === 'object' ? s.additionalProperties : s.patternProperties ? Object.values(s.patternProperties)[0] : undefined;

/** The bounds a schema (the CRD's, or KeyLimits' TypeBox schema, which is JSON Schema too) sets on each field, by path. */
function bounds(schema: Schema, path = ''): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [name, s] of Object.entries(schema.properties ?? {})) {
    const at = `${path}${name}`;
    const values = valuesOf(s);
    if (values) {
      out[at] = { type: s.type, maxProperties: s.maxProperties };
      Object.assign(out, bounds(values, `${at}.*.`));
    } else if (s.properties) {
      out[at] = { type: s.type, required: [...(s.required ?? [])].sort() };
      Object.assign(out, bounds(s, `${at}.`));
    } else out[at] = { type: s.type, minimum: s.minimum, maximum: s.maximum, enum: s.enum };
  }
  return out;
}

test.each(['crds/apikey.yaml', 'charts/magus/files/crds/apikey.yaml'])("%s: spec.limits' fields and bounds are KeyLimits'", (path) => {
  const [crd] = loadAllYaml(readFileSync(join(__dirname, '..', path), 'utf8')) as { spec: { versions: { schema: { openAPIV3Schema: Schema } }[] } }[];
  const limits = crd!.spec.versions[0]!.schema.openAPIV3Schema.properties!.spec!.properties!.limits!;
  expect(limits.type).toBe('object');
  expect(limits.required).toBeUndefined(); // every limit is optional
  const declared = bounds(KeyLimits as Schema);
  const rates = ['requestsPerMinute', 'tokensPerMinute', 'concurrency', 'budget', 'budget.tokens', 'budget.period'];
  expect(Object.keys(declared)).toEqual([...rates, 'models', ...rates.map((r) => `models.*.${r}`), 'storageBytes']);
  expect(bounds(limits)).toEqual(declared);
});
