/**
 * The kinds of request that reach an engine, in one table: for each, the contract the bridge
 * checks it against (serving.ts), the engine's path, the prefix of its answers' ids, whether it
 * generates text (streamed when asked, with a pinned seed so a retry regenerates the same), and
 * why an engine cannot serve it. The bridge (dataplane/bridge/) reads everything per kind from
 * here; a new kind is a row here, its envelope in serving.ts, its gateway route and its engine
 * route (README.md, "Where to add X").
 * Workflow-safe: no I/O.
 */
import type { TSchema } from '@sinclair/typebox';
import { unsupportedBy } from './chat';
import { completionsUnsupportedBy } from './completions';
import { embeddingsUnsupportedBy } from './embeddings';
import type { EngineKind } from './engines';
import { ChatInference, CompletionsInference, EmbeddingsInference, type InferenceRequest } from './serving';

export interface RequestKindEntry {
  /** The whole request message's contract (envelope and body). */
  inference: TSchema;
  /** The engine's path. */
  path: string;
  /** The prefix of its answers' ids (OpenAI's for the kind); none: the answer is relayed as the engine gives it. */
  idPrefix?: string;
  /** It generates text: a stream when the body asks, a seed pinned when the client gave none. */
  generates: boolean;
  /** Why `engine` cannot serve `req` (its field and a sentence), or undefined when it can. */
  unsupportedBy(engine: EngineKind, req: InferenceRequest): { field: string; message: string } | undefined;
}

export const REQUEST_KINDS = {
  chat: {
    inference: ChatInference,
    path: '/v1/chat/completions',
    idPrefix: 'chatcmpl-',
    generates: true,
    unsupportedBy: (engine, req) => unsupportedBy(engine, (req as ChatInference).body),
  },
  completions: {
    inference: CompletionsInference,
    path: '/v1/completions',
    idPrefix: 'cmpl-',
    generates: true,
    unsupportedBy: (engine) => completionsUnsupportedBy(engine),
  },
  embeddings: { inference: EmbeddingsInference, path: '/v1/embeddings', generates: false, unsupportedBy: (engine) => embeddingsUnsupportedBy(engine) },
} as const satisfies Record<string, RequestKindEntry>;

export type RequestKind = keyof typeof REQUEST_KINDS;

/** The kind of `req` (a chat completion says none: what gateways sent before there were others). */
export function kindOf(req: { kind?: string }): RequestKind {
  return req.kind !== undefined && Object.hasOwn(REQUEST_KINDS, req.kind) ? (req.kind as RequestKind) : 'chat';
}

/** The table's entry for `req`. */
export function requestKindOf(req: { kind?: string }): RequestKindEntry {
  return REQUEST_KINDS[kindOf(req)];
}
