/**
 * A model's sampling defaults: what a request that sets no sampling parameter is generated with.
 * Workflow-safe: no I/O, no imports (the pipeline workflow validates `spec.sampling` with it).
 *
 * Where they come from, field by field, first found wins:
 * 1. the request's own parameter;
 * 2. the `Model`'s `spec.sampling` (an operator's choice: it overrides the repository's);
 * 3. what the model's repository publishes — `generation_config.json` (`temperature`, `top_p`,
 *    `top_k`, `repetition_penalty`; `do_sample: false` is greedy, temperature 0), or, for a GGUF
 *    source, its `general.sampling.*` keys (`temp`, `top_p`, `top_k`, `penalty_repeat`);
 * 4. the engine's default (llama.cpp engine: temperature 1, top_p 1, top-k 40, no repetition
 *    penalty; dllama-api: the `--temperature` and `--topp` it was started with, no top-k).
 *
 * 2 and 3 travel with the model's registry entry (shared/model.ts `ReadyModel.sampling` and each
 * `Artifact.sampling`); the gateway fills what a request leaves out ({@link withSamplingDefaults})
 * before the request goes to either engine, and `/v1/models` shows the result ({@link modelSampling}).
 *
 * Names and bounds are OpenAI's where OpenAI has the field (`temperature` 0–2), else those of
 * llama.cpp's server and vLLM (`top_k`, `repetition_penalty`); a default `top_p` of 0 is refused
 * (it means nothing a temperature of 0 does not say better), as is a `repetition_penalty` of 0.
 */
/** The sampling fields a model may have defaults for, in the request's spelling. */
export const SAMPLING_FIELDS = ['temperature', 'top_p', 'top_k', 'repetition_penalty'] as const;
export type SamplingField = (typeof SAMPLING_FIELDS)[number];

/** Sampling defaults; an absent field has none (the next source down decides). */
export interface SamplingDefaults {
  /** 0–2; 0 = greedy. */
  temperature?: number;
  /** Above 0, at most 1 (1 = off). */
  top_p?: number;
  /** A whole number, 0 (off) to {@link MAX_TOP_K}. */
  top_k?: number;
  /** Above 0, at most 2 (1 = off): llama.cpp's repeat penalty over the last 64 tokens. */
  repetition_penalty?: number;
}

/** The largest `top_k` accepted (beyond any vocabulary: the same as 0, off). */
export const MAX_TOP_K = 1_000_000;

/** Each field's bounds (the `Model` CRD's are held equal to these by shared/sampling.test.ts). */
export const SAMPLING_BOUNDS: Readonly<Record<SamplingField, { integer: boolean; minimum?: number; exclusiveMinimum?: number; maximum: number }>> = {
  temperature: { integer: false, minimum: 0, maximum: 2 },
  top_p: { integer: false, exclusiveMinimum: 0, maximum: 1 },
  top_k: { integer: true, minimum: 0, maximum: MAX_TOP_K },
  repetition_penalty: { integer: false, exclusiveMinimum: 0, maximum: 2 },
};

/** What a field must be, in words (the end of "<field> must be …"). */
function boundsInWords(field: SamplingField): string {
  const b = SAMPLING_BOUNDS[field];
  const low = b.minimum !== undefined ? `from ${b.minimum}` : `above ${b.exclusiveMinimum}`;
  return `a ${b.integer ? 'whole number' : 'number'} ${low}${b.minimum !== undefined ? ' to' : ', at most'} ${b.maximum}`;
}

function inBounds(field: SamplingField, v: unknown): v is number {
  const b = SAMPLING_BOUNDS[field];
  if (typeof v !== 'number' || !Number.isFinite(v) || (b.integer && !Number.isInteger(v))) return false;
  if (b.minimum !== undefined && v < b.minimum) return false;
  if (b.exclusiveMinimum !== undefined && v <= b.exclusiveMinimum) return false;
  return v <= b.maximum;
}

/**
 * The valid fields of `value` (a `spec.sampling`, a registry entry's), and a problem per field that
 * is not (`<where>.<field>: … must be …`) or is unknown. Not an object: no fields, one problem
 * (absent: none).
 */
export function checkSampling(value: unknown, where = 'sampling'): { sampling: SamplingDefaults; problems: string[] } {
  const sampling: SamplingDefaults = {};
  if (value === undefined) return { sampling, problems: [] };
  if (typeof value !== 'object' || value === null || Array.isArray(value)) return { sampling, problems: [`${where}: must be an object`] };
  const problems: string[] = [];
  for (const [key, v] of Object.entries(value as Record<string, unknown>)) {
    if (!(SAMPLING_FIELDS as readonly string[]).includes(key)) {
      problems.push(`${where}.${key}: unknown field (${SAMPLING_FIELDS.join(', ')} are)`);
      continue;
    }
    const field = key as SamplingField;
    if (inBounds(field, v)) sampling[field] = v;
    else problems.push(`${where}.${field}: ${JSON.stringify(v) ?? String(v)} must be ${boundsInWords(field)}`);
  }
  return { sampling, problems };
}

/** Defaults read from a repository, and a line per value that was left out and why. */
export interface PublishedSampling {
  /** Absent when the repository publishes none. */
  sampling?: SamplingDefaults;
  warnings: string[];
}

const published = (sampling: SamplingDefaults, warnings: string[]): PublishedSampling =>
  Object.keys(sampling).length > 0 ? { sampling, warnings } : { warnings };

/**
 * The defaults a Hugging Face `generation_config.json` publishes (its parsed JSON): `temperature`,
 * `top_p`, `top_k`, `repetition_penalty` where present and valid; `do_sample: false` means greedy
 * decoding — temperature 0, its `top_p` and `top_k` unused — as transformers reads it. Only an
 * explicit `do_sample: false` does: a file without `do_sample` publishes what it lists. A value out
 * of bounds is left out with a warning, never an error.
 */
export function samplingFromGenerationConfig(config: unknown): PublishedSampling {
  if (typeof config !== 'object' || config === null || Array.isArray(config)) return { warnings: ['generation_config.json: not a JSON object; ignored'] };
  const c = config as Record<string, unknown>;
  const greedy = c.do_sample === false;
  const raw: Record<string, unknown> = {};
  if (greedy) raw.temperature = 0;
  else for (const f of ['temperature', 'top_p', 'top_k'] as const) if (c[f] !== undefined && c[f] !== null) raw[f] = c[f];
  if (c.repetition_penalty !== undefined && c.repetition_penalty !== null) raw.repetition_penalty = c.repetition_penalty;
  const { sampling, problems } = checkSampling(raw, 'generation_config.json');
  return published(
    sampling,
    problems.map((p) => `${p}; ignored`),
  );
}

/** The GGUF keys of sampling defaults llama.cpp's converter writes, and the fields they hold. */
export const GGUF_SAMPLING_KEYS: Readonly<Record<string, SamplingField>> = {
  'general.sampling.temp': 'temperature',
  'general.sampling.top_p': 'top_p',
  'general.sampling.top_k': 'top_k',
  'general.sampling.penalty_repeat': 'repetition_penalty',
};

/**
 * The defaults a GGUF's metadata publishes: `general.sampling.*` ({@link GGUF_SAMPLING_KEYS}), given
 * as a lookup of a key's `{type, value}` (as convert/gguf-reader.ts reads them). float32 values are
 * rounded to the 7 significant digits a float32 holds (0.6, not 0.6000000238418579). A value of the
 * wrong type or out of bounds is left out with a warning.
 */
export function samplingFromGguf(get: (key: string) => { type: string; value: unknown } | undefined): PublishedSampling {
  const sampling: SamplingDefaults = {};
  const warnings: string[] = [];
  for (const [key, field] of Object.entries(GGUF_SAMPLING_KEYS)) {
    const kv = get(key);
    if (kv === undefined) continue;
    const n = typeof kv.value === 'number' || typeof kv.value === 'bigint' ? Number(kv.value) : undefined;
    const v = n !== undefined && kv.type === 'float32' ? Number(n.toPrecision(7)) : n;
    if (inBounds(field, v)) sampling[field] = v;
    else warnings.push(`GGUF ${key}: ${n === undefined ? `a ${kv.type}, not a number` : `${v} must be ${boundsInWords(field)}`}; ignored`);
  }
  return published(sampling, warnings);
}

/** What {@link modelSampling} reads of a registry entry (shared/model.ts `ReadyModel`). */
export interface SampledModel {
  /** The `Model`'s `spec.sampling`. */
  sampling?: unknown;
  /** What the repository publishes, as each artifact's source gave it (they share one source: the first found is taken). */
  artifacts?: readonly { sampling?: unknown }[];
}

/**
 * A model's effective defaults: its `spec.sampling` over its repository's, field by field. Read
 * from a registry entry, so every value is checked again and an invalid one dropped.
 */
export function modelSampling(model: SampledModel): SamplingDefaults {
  const fromRepository = model.artifacts?.find((a) => a.sampling !== undefined)?.sampling;
  return { ...checkSampling(fromRepository).sampling, ...checkSampling(model.sampling).sampling };
}

/** `body` with each sampling field it leaves out (absent or null) taken from `defaults`; `body` itself when there is nothing to fill. */
export function withSamplingDefaults<B extends Partial<Record<SamplingField, number | null>>>(body: B, defaults: SamplingDefaults): B {
  let out: B | undefined;
  for (const field of SAMPLING_FIELDS) {
    const d = defaults[field];
    if (d === undefined || body[field] != null) continue;
    out ??= { ...body };
    (out as Record<SamplingField, number>)[field] = d;
  }
  return out ?? body;
}
