/**
 * A model's sampling defaults: what a repository publishes (generation_config.json, a GGUF's
 * general.sampling.*), checked and never fatal; the precedence request > spec.sampling >
 * repository > engine; and the `Model` CRD's bounds (in the CRD and the chart's copy) held equal
 * to the ones declared here.
 */
import { loadAllYaml } from '@kubernetes/client-node';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { validateModelSpec } from './model';
import {
  checkSampling,
  modelSampling,
  SAMPLING_BOUNDS,
  SAMPLING_FIELDS,
  samplingFromGenerationConfig,
  samplingFromGguf,
  withSamplingDefaults,
  type SamplingDefaults,
} from './sampling';

describe('generation_config.json', () => {
  test('the sampling fields present are published; the rest of the file is not', () => {
    expect(
      samplingFromGenerationConfig({
        bos_token_id: 1,
        eos_token_id: [2, 3],
        do_sample: true,
        temperature: 0.6,
        top_p: 0.95,
        top_k: 20,
        repetition_penalty: 1.05,
        max_new_tokens: 512,
        transformers_version: '4.51.0',
      }),
    ).toEqual({ sampling: { temperature: 0.6, top_p: 0.95, top_k: 20, repetition_penalty: 1.05 }, warnings: [] });
    // A file without do_sample publishes what it lists.
    expect(samplingFromGenerationConfig({ temperature: 0.7 })).toEqual({ sampling: { temperature: 0.7 }, warnings: [] });
  });

  test('none published: no defaults (SmolLM2-135M-Instruct’s file names only its token ids)', () => {
    expect(samplingFromGenerationConfig({ bos_token_id: 1, eos_token_id: 2, pad_token_id: 2, transformers_version: '4.42.3' })).toEqual({ warnings: [] });
    expect(samplingFromGenerationConfig({ temperature: null })).toEqual({ warnings: [] });
  });

  test('do_sample: false is greedy: temperature 0, its top_p and top_k unused, its repetition penalty kept', () => {
    expect(samplingFromGenerationConfig({ do_sample: false, temperature: 0.6, top_p: 0.9, top_k: 50, repetition_penalty: 1.2 })).toEqual({
      sampling: { temperature: 0, repetition_penalty: 1.2 },
      warnings: [],
    });
  });

  test('a value out of bounds or of the wrong type is left out with a warning, the others kept', () => {
    const r = samplingFromGenerationConfig({ temperature: 5, top_p: 0, top_k: 2.5, repetition_penalty: '1.1' });
    expect(r.sampling).toBeUndefined();
    expect(r.warnings).toEqual([
      'generation_config.json.temperature: 5 must be a number from 0 to 2; ignored',
      'generation_config.json.top_p: 0 must be a number above 0, at most 1; ignored',
      'generation_config.json.top_k: 2.5 must be a whole number from 0 to 1000000; ignored',
      'generation_config.json.repetition_penalty: "1.1" must be a number above 0, at most 2; ignored',
    ]);
    expect(samplingFromGenerationConfig({ temperature: 0.3, top_k: -1 })).toEqual({
      sampling: { temperature: 0.3 },
      warnings: ['generation_config.json.top_k: -1 must be a whole number from 0 to 1000000; ignored'],
    });
    expect(samplingFromGenerationConfig([1, 2])).toEqual({ warnings: ['generation_config.json: not a JSON object; ignored'] });
  });
});

describe("a GGUF's general.sampling.*", () => {
  const kvs = (entries: Record<string, { type: string; value: unknown }>) => (key: string) => entries[key];

  test('temp, top_p, top_k and penalty_repeat are published, float32s as the decimal they were written from', () => {
    expect(
      samplingFromGguf(
        kvs({
          'general.sampling.temp': { type: 'float32', value: Math.fround(0.6) },
          'general.sampling.top_p': { type: 'float32', value: Math.fround(0.95) },
          'general.sampling.top_k': { type: 'uint32', value: 20 },
          'general.sampling.penalty_repeat': { type: 'float32', value: Math.fround(1.05) },
          'general.sampling.min_p': { type: 'float32', value: 0 },
          'general.architecture': { type: 'string', value: 'qwen3' },
        }),
      ),
    ).toEqual({ sampling: { temperature: 0.6, top_p: 0.95, top_k: 20, repetition_penalty: 1.05 }, warnings: [] });
  });

  test('no keys: nothing published; a bad one: left out with a warning', () => {
    expect(samplingFromGguf(kvs({}))).toEqual({ warnings: [] });
    expect(
      samplingFromGguf(
        kvs({
          'general.sampling.temp': { type: 'string', value: 'hot' },
          'general.sampling.top_k': { type: 'int32', value: -1 },
          'general.sampling.top_p': { type: 'float64', value: 0.8 },
        }),
      ),
    ).toEqual({
      sampling: { top_p: 0.8 },
      warnings: [
        'GGUF general.sampling.temp: a string, not a number; ignored',
        'GGUF general.sampling.top_k: -1 must be a whole number from 0 to 1000000; ignored',
      ],
    });
  });
});

describe('precedence', () => {
  const repository: SamplingDefaults = { temperature: 0.6, top_p: 0.95, top_k: 20, repetition_penalty: 1.05 };

  test("spec.sampling over the repository's, field by field", () => {
    expect(modelSampling({ sampling: { temperature: 0.2, top_p: 0.9 }, artifacts: [{ sampling: repository }] })).toEqual({
      temperature: 0.2,
      top_p: 0.9,
      top_k: 20,
      repetition_penalty: 1.05,
    });
    expect(modelSampling({ artifacts: [{}, { sampling: repository }] })).toEqual(repository);
    expect(modelSampling({ sampling: { temperature: 0 } })).toEqual({ temperature: 0 });
    expect(modelSampling({ artifacts: [{}] })).toEqual({});
  });

  test('a registry entry is checked again: what is invalid is dropped, not sent to an engine', () => {
    expect(modelSampling({ sampling: { temperature: 9, top_p: 0.5, seed: 3 }, artifacts: [{ sampling: 'hot' }] })).toEqual({ top_p: 0.5 });
  });

  test("the request's own parameter wins; what it leaves out (absent or null) comes from the defaults; else the engine's", () => {
    const defaults: SamplingDefaults = { temperature: 0.2, top_p: 0.9, top_k: 20 };
    type Body = { model: string; temperature?: number; top_p?: number | null; top_k?: number };
    const m = (over: Omit<Body, 'model'> = {}): Body => ({ model: 'm', ...over });
    expect(withSamplingDefaults(m(), defaults)).toEqual({ model: 'm', temperature: 0.2, top_p: 0.9, top_k: 20 });
    expect(withSamplingDefaults(m({ temperature: 0, top_p: null }), defaults)).toEqual({ model: 'm', temperature: 0, top_p: 0.9, top_k: 20 });
    expect(withSamplingDefaults(m({ temperature: 1.5, top_p: 1, top_k: 0 }), defaults)).toEqual({ model: 'm', temperature: 1.5, top_p: 1, top_k: 0 });
    const body = m();
    expect(withSamplingDefaults(body, {})).toBe(body);
  });
});

describe('spec.sampling', () => {
  const spec = (sampling: unknown) => ({ source: { repo: 'a/b' }, artifacts: [{ format: 'gguf', weights: 'q40' }], sampling });

  test('within bounds is valid', () => {
    expect(validateModelSpec(spec({ temperature: 0.2, top_p: 0.9 }))).toEqual([]);
    expect(validateModelSpec(spec({ temperature: 0, top_p: 1, top_k: 0, repetition_penalty: 2 }))).toEqual([]);
    expect(validateModelSpec(spec({}))).toEqual([]);
  });

  test('out of bounds, unknown or not an object is an invalid spec, naming the field', () => {
    expect(validateModelSpec(spec({ temperature: 2.1, top_p: 0, min_p: 0.1 }))).toEqual([
      'sampling.temperature: 2.1 must be a number from 0 to 2',
      'sampling.top_p: 0 must be a number above 0, at most 1',
      'sampling.min_p: unknown field (temperature, top_p, top_k, repetition_penalty are)',
    ]);
    expect(validateModelSpec(spec(0.2))).toEqual(['sampling: must be an object']);
    expect(checkSampling({ top_k: 1e7 }).problems).toEqual(['sampling.top_k: 10000000 must be a whole number from 0 to 1000000']);
  });
});

interface Schema {
  type?: string;
  minimum?: number;
  maximum?: number;
  exclusiveMinimum?: boolean;
  properties?: Record<string, Schema>;
}

test.each(['crds/model.yaml', 'charts/magus/files/crds/model.yaml'])("%s: spec.sampling's fields and bounds are the declared ones", (path) => {
  const [crd] = loadAllYaml(readFileSync(join(__dirname, '..', path), 'utf8')) as { spec: { versions: { schema: { openAPIV3Schema: Schema } }[] } }[];
  const sampling = crd!.spec.versions[0]!.schema.openAPIV3Schema.properties!.spec!.properties!.sampling!;
  expect(Object.keys(sampling.properties!)).toEqual([...SAMPLING_FIELDS]);
  for (const field of SAMPLING_FIELDS) {
    const s = sampling.properties![field]!;
    const b = SAMPLING_BOUNDS[field];
    expect([field, s.type, s.minimum, s.exclusiveMinimum ?? false, s.maximum]).toEqual([
      field,
      b.integer ? 'integer' : 'number',
      b.minimum ?? b.exclusiveMinimum,
      b.exclusiveMinimum !== undefined,
      b.maximum,
    ]);
  }
});
