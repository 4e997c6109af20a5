/** `GET /v1/models` and `GET /v1/models/:model`: OpenAI's model objects. */
import { CAPABILITIES, ENGINE_KINDS, type Capability, type EngineKind } from '../../shared/engines';
import type { SamplingDefaults } from '../../shared/sampling';
import { errorResponses } from './errors';

const model = {
  type: 'object',
  required: ['id', 'object', 'created', 'owned_by'],
  properties: {
    id: { type: 'string' },
    object: { type: 'string' },
    created: { type: 'integer' },
    owned_by: { type: 'string' },
    servable: { type: 'boolean' },
    not_servable_reason: { type: 'string' },
    engines: { type: 'array', items: { type: 'string', enum: ENGINE_KINDS } },
    capabilities: { type: 'array', items: { type: 'string', enum: CAPABILITIES } },
    sampling: {
      type: 'object',
      properties: {
        temperature: { type: 'number' },
        top_p: { type: 'number' },
        top_k: { type: 'integer' },
        repetition_penalty: { type: 'number' },
      },
    },
    serving: {
      type: 'object',
      required: ['status', 'instances', 'starting'],
      properties: {
        status: { type: 'string', enum: ['ready', 'starting', 'idle', 'failing'] },
        instances: { type: 'integer' },
        starting: { type: 'integer' },
        starting_for_s: { type: 'integer' },
        failing: { type: 'string' },
      },
    },
  },
} as const;

export interface ModelObject {
  id: string;
  object: 'model';
  created: number;
  owned_by: string;
  /** magus: false when no live worker's runtime can run any of the model's artifacts (chat requests get 400 `model_not_servable`). */
  servable: boolean;
  /** magus: why, when `servable` is false. */
  not_servable_reason?: string;
  /** magus: the engines its instances may run on (llama.cpp: `llamacpp`, distributed-llama: `dllama`). */
  engines: EngineKind[];
  /** magus: what a request may ask of it beyond plain chat, on every engine it may run on (`json_schema`: `response_format`; `tools`). */
  capabilities: Capability[];
  /**
   * magus: the sampling defaults a request that leaves a field out is generated with (shared/sampling.ts:
   * the `Model`'s `spec.sampling` over what its repository publishes); a field absent here is the
   * engine's own default.
   */
  sampling: SamplingDefaults;
  /**
   * magus: its instances now, from its pool's published view: `ready` (one serves), `starting`
   * (none serves, one is being started, for `starting_for_s`), `idle` (none: the first request
   * starts one), `failing` (starts fail, and why). Absent where the gateway has no views.
   */
  serving?: { status: 'ready' | 'starting' | 'idle' | 'failing'; instances: number; starting: number; starting_for_s?: number; failing?: string };
}

export const listModelsSchema = {
  response: {
    200: { type: 'object', required: ['object', 'data'], properties: { object: { type: 'string' }, data: { type: 'array', items: model } } },
    ...errorResponses,
  },
} as const;

export const getModelSchema = {
  params: { type: 'object', required: ['model'], properties: { model: { type: 'string', minLength: 1, maxLength: 256 } } },
  response: { 200: model, ...errorResponses },
} as const;
