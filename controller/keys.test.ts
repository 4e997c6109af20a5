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
  properties?: Record<string, Schema>;
}

/** The bounds a schema (the CRD's, or KeyLimits' TypeBox schema, which is JSON Schema too) sets on each field, by path. */
function bounds(schema: Schema, path = ''): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [name, s] of Object.entries(schema.properties ?? {})) {
    const at = `${path}${name}`;
    if (s.properties) {
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
  expect(Object.keys(declared)).toEqual(['requestsPerMinute', 'tokensPerMinute', 'concurrency', 'budget', 'budget.tokens', 'budget.period']);
  expect(bounds(limits)).toEqual(declared);
});
