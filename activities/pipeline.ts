/**
 * The activities of the `modelPipeline` workflow, created from injected clients (workers inject
 * real ones; tests inject real ones pointed at test servers). Each takes one serializable input
 * and is idempotent: S3 keys derive from the commit and content, so re-running finds its work
 * done. Permanent errors become non-retryable failures with a type from shared/errors.ts;
 * everything else is retried by the workflow's policy. Secrets are resolved here from
 * references and never appear in inputs, results, heartbeats or errors.
 */
import { DeleteObjectsCommand, GetObjectCommand, ListObjectsV2Command, type S3Client } from '@aws-sdk/client-s3';
import { Context, activityInfo, ApplicationFailure, heartbeat, log } from '@temporalio/activity';
import { basename } from 'node:path';
import {
  type CheckpointFiles,
  ConvertError,
  type ConvertProgress,
  CONVERTER_VERSION,
  convertGgufToDllama,
  convertModel,
  type GgufSource,
  ggufRopeFreqs,
  isConvertError,
  type ModelSpec,
  parseModelSpec,
  readGguf,
  readGgufSource,
  specFromGguf,
} from '../convert';
import { allowedNetworks } from './huggingface/addresses';
import { HubClient, hubErrorType, isHubError } from './huggingface/client';
import type { HubResolver } from './huggingface/network';
import { isSecretUnavailable } from './huggingface/secrets';
import type { ModelRegistry } from '../dataplane/registry';
import { planLlamaCppMemory, planMemory } from './size/memory';
import { abortStaleUploads } from './storage/cleanup';
import { isStorageError } from './storage/errors';
import { headObject } from './storage/multipart';
import { s3Source } from './storage/s3-source';
import { s3OutputTarget } from './storage/s3-writer';
import { transferToS3, type TransferCheckpoint } from './storage/transfer';
import { ErrorType, PERMANENT_ERROR_TYPES } from '../shared/errors';
import {
  artifactPrefix,
  sourceKey,
  type Artifact,
  type ArtifactRequest,
  type MemoryPlan,
  type ModelSource,
  type ReadyModel,
  type ResolvedSource,
  type SecretRef,
  type SourceFile,
  type StoredObject,
} from '../shared/model';
import { samplingFromGenerationConfig, samplingFromGguf, type PublishedSampling, type SamplingDefaults } from '../shared/sampling';
import type { WeightsFormat } from '../shared/weights';
import type { ActivityProgress, ActivityRetry } from '../shared/status';

export interface PipelineDeps {
  s3: S3Client;
  bucket: string;
  registry: ModelRegistry;
  resolveSecret: (ref: SecretRef) => Promise<string>;
  /** Sends throttled progress to the running workflow (a Temporal client's signal). */
  reportProgress?: (workflowId: string, progress: ActivityProgress) => Promise<void>;
  /** Tells the running workflow that an attempt failed and will be retried (a Temporal client's signal). */
  reportRetry?: (workflowId: string, retry: ActivityRetry) => Promise<void>;
  /**
   * Networks a Model's hub (and its redirects) may be at despite their kind (the worker's
   * `MAGUS_HUB_ALLOW_NETWORKS`; activities/huggingface/addresses.ts); default none.
   */
  hubAllowNetworks?: readonly string[];
  /** Name resolution for the hub's address checks (default the system's); tests inject their own. */
  hubResolve?: HubResolver;
  transfer?: { partSize?: number; concurrency?: number };
  convertThreads?: number;
}

/** A source file in S3, as the workflow passes it to conversion and sizing. */
export interface StoredSource {
  path: string;
  object: StoredObject;
}

/** Heartbeat details of `transferFile`; the next attempt resumes from them. */
export interface TransferHeartbeat {
  checkpoint: TransferCheckpoint | null;
  bytesDone: number;
  bytesTotal: number;
}

const PROGRESS_EVERY_MS = 3000;
/** Heartbeats go out at least this often, whatever the part size or link speed (timeout: 10 s). */
const HEARTBEAT_EVERY_MS = 2000;

/**
 * Heartbeats `details()` every {@link HEARTBEAT_EVERY_MS} until stopped: progress callbacks
 * come per part or per tensor, which on a slow link can be rarer than the heartbeat timeout.
 */
function keepHeartbeating(details: () => unknown): () => void {
  const timer = setInterval(() => heartbeat(details()), HEARTBEAT_EVERY_MS);
  return () => clearInterval(timer);
}

/** Re-throws `err` as a non-retryable failure when no retry can fix it. */
function classify(err: unknown): never {
  if (isHubError(err)) {
    const type = hubErrorType(err.code);
    if (type) throw ApplicationFailure.nonRetryable(err.message, type);
  } else if (isConvertError(err)) {
    // The input is pinned by commit and verified by sha256: a conversion error is permanent.
    throw ApplicationFailure.nonRetryable(`${err.code}: ${err.message}`, ErrorType.UnsupportedModel);
  } else if (isSecretUnavailable(err)) {
    throw ApplicationFailure.nonRetryable(err.message, ErrorType.SecretUnavailable);
  } else if (isStorageError(err) && err.permanent) {
    // E.g. a source longer than its listing: content at a pinned commit cannot change, so no
    // retry helps (a source that ends early is transient and resumes).
    throw ApplicationFailure.nonRetryable(`${err.code}: ${err.message}`, ErrorType.ChecksumMismatch);
  }
  throw err;
}

/** Which one of its kind an activity's input names: a file's path, an artifact's `format:weights`. */
function stepKey(input: unknown): string | undefined {
  const i = input as { file?: { path?: unknown }; request?: { format?: unknown; weights?: unknown } } | null;
  if (typeof i?.file?.path === 'string') return i.file.path;
  if (typeof i?.request?.format === 'string') return `${i.request.format}:${String(i.request.weights)}`;
  return undefined;
}

/**
 * `activities` whose failed attempts, when they will be retried, are reported to the workflow
 * (best effort, not awaited): its `progress` names the step, the attempt and the error instead of
 * sitting at a phase with `failure: null` while the step retries for minutes.
 */
function reportingRetries<T extends Record<string, (input: never) => Promise<unknown>>>(activities: T, report: PipelineDeps['reportRetry']): T {
  if (!report) return activities;
  const wrapped: Record<string, (input: never) => Promise<unknown>> = {};
  for (const [name, fn] of Object.entries(activities)) {
    wrapped[name] = async (input) => {
      try {
        return await fn(input);
      } catch (err) {
        const permanent = err instanceof ApplicationFailure && (err.nonRetryable || (err.type != null && PERMANENT_ERROR_TYPES.includes(err.type)));
        const info = activityInfo();
        const workflowId = info.workflowExecution?.workflowId;
        const cancelled = Context.current().cancellationSignal.aborted;
        if (!permanent && !cancelled && workflowId) {
          const key = stepKey(input);
          const message = err instanceof Error ? `${err.name === 'Error' ? '' : `${err.name}: `}${err.message}` : String(err);
          report(workflowId, { activity: name, ...(key === undefined ? {} : { key }), attempt: info.attempt, message, at: new Date().toISOString() }).catch(
            () => undefined,
          );
        }
        throw err;
      }
    };
  }
  return wrapped as T;
}

export function createPipelineActivities(deps: PipelineDeps) {
  return reportingRetries(pipelineActivities(deps), deps.reportRetry);
}

function pipelineActivities(deps: PipelineDeps) {
  const { s3, bucket } = deps;
  // Parsed once: a bad entry fails the worker's start, not every download.
  const allowNetworks = allowedNetworks(deps.hubAllowNetworks ?? []);

  async function hubFor(source: ModelSource): Promise<HubClient> {
    const token = source.tokenRef ? await deps.resolveSecret(source.tokenRef) : undefined;
    return new HubClient({ baseUrl: source.hubUrl, token, allowNetworks, ...(deps.hubResolve ? { resolve: deps.hubResolve } : {}) });
  }

  /** Calls `send` at most every few seconds (and always for the final value). */
  function throttledProgress(kind: ActivityProgress['kind'], key: string): (done: number, total: number, final?: boolean) => void {
    let last = 0;
    const workflowId = activityInfo().workflowExecution?.workflowId;
    return (done, total, final = false) => {
      const now = Date.now();
      if (!deps.reportProgress || !workflowId || (!final && now - last < PROGRESS_EVERY_MS)) return;
      last = now;
      deps.reportProgress(workflowId, { key, kind, done, total }).catch(() => undefined); // progress is best effort
    };
  }

  async function getText(key: string, signal?: AbortSignal): Promise<string> {
    const r = await s3.send(new GetObjectCommand({ Bucket: bucket, Key: key }), { abortSignal: signal });
    return r.Body!.transformToString('utf8');
  }

  /** The checkpoint's files as S3 objects. */
  function s3Checkpoint(sources: StoredSource[], signal: AbortSignal): CheckpointFiles {
    const byPath = new Map(sources.map((s) => [s.path, s.object]));
    return {
      location: `s3://${bucket}/${sources[0]?.object.key.replace(/[^/]*$/, '') ?? ''}`,
      async readText(name) {
        const o = byPath.get(name);
        return o ? getText(o.key, signal) : null;
      },
      open(name) {
        const o = byPath.get(name);
        if (!o) return Promise.reject(new ConvertError('MissingFile', `${name} is not among the model's files`));
        return Promise.resolve(s3Source(s3, bucket, o.key, { size: o.bytes }));
      },
    };
  }

  /** A GGUF source's parts in order (no `config.json`: a GGUF repository), or null. */
  function ggufSourceOf(sources: StoredSource[]): StoredSource[] | null {
    if (sources.some((s) => s.path === 'config.json')) return null;
    const parts = sources.filter((s) => /\.gguf$/i.test(s.path));
    return parts.length > 0 ? parts : null;
  }

  /** The converter's spec of a (single-file) GGUF source, as its distributed-llama conversion reads it. */
  async function ggufSpecIn(part: StoredSource, signal: AbortSignal): Promise<ModelSpec> {
    const source = s3Source(s3, bucket, part.object.key, { size: part.object.bytes, blockSize: 1 << 20, signal });
    try {
      const file = await readGguf(source);
      const ropeFreqs = await ggufRopeFreqs(source, file);
      return specFromGguf(file, ropeFreqs ? { ropeFreqs } : {});
    } finally {
      await source.close();
    }
  }

  /** A GGUF source read (its parts in order, as byte sources over S3; small blocks: only headers are read). */
  async function readGgufSourceIn(sources: StoredSource[], signal: AbortSignal): Promise<GgufSource> {
    const parts = sources
      .filter((s) => /\.gguf$/i.test(s.path))
      .map((s) => s3Source(s3, bucket, s.object.key, { size: s.object.bytes, blockSize: 1 << 20, signal }));
    try {
      return await readGgufSource(parts);
    } finally {
      await Promise.all(parts.map((p) => p.close()));
    }
  }

  /**
   * The sampling defaults the model's repository publishes (shared/sampling.ts): its
   * `generation_config.json`, or a GGUF source's `general.sampling.*` keys (its first part's
   * header). A value that is no default, or a file that is no JSON, is left out with a warning
   * line: it never fails the pipeline.
   */
  async function publishedSampling(sources: StoredSource[], signal: AbortSignal): Promise<SamplingDefaults | undefined> {
    let found: PublishedSampling = { warnings: [] };
    const config = sources.find((s) => s.path === 'generation_config.json');
    const gguf = ggufSourceOf(sources);
    if (config) {
      const text = await getText(config.object.key, signal);
      let json: unknown;
      try {
        json = JSON.parse(text);
      } catch (err) {
        found.warnings.push(`generation_config.json: not JSON (${(err as Error).message}); ignored`);
      }
      if (json !== undefined) found = samplingFromGenerationConfig(json);
    } else if (gguf) {
      const source = s3Source(s3, bucket, gguf[0]!.object.key, { size: gguf[0]!.object.bytes, blockSize: 1 << 20, signal });
      try {
        const { metadata } = await readGguf(source);
        found = samplingFromGguf((key) => metadata.get(key));
      } finally {
        await source.close();
      }
    }
    for (const warning of found.warnings) log.warn(`sampling defaults: ${warning}`);
    return found.sampling;
  }

  return {
    /** Pins `revision` to a commit and lists the repository's files with sizes and sha256. */
    async resolveSource(input: { source: ModelSource }): Promise<ResolvedSource> {
      try {
        const hub = await hubFor(input.source);
        return await hub.resolve(input.source.repo, input.source.revision ?? 'main', { signal: Context.current().cancellationSignal });
      } catch (err) {
        classify(err);
      }
    },

    /**
     * Streams one file from the hub into S3 (multipart), verifying its sha256; resumes from the
     * last heartbeat's checkpoint without re-sending parts already in S3. A checksum mismatch is
     * retried once from scratch (a fresh download) before it is reported as permanent.
     */
    async transferFile(input: { source: ModelSource; sha: string; file: SourceFile }): Promise<StoredObject> {
      const ctx = Context.current();
      const { file } = input;
      const key = sourceKey(input.source.repo, input.sha, file.path);
      const previous = activityInfo().heartbeatDetails as TransferHeartbeat | undefined;
      let checkpoint = previous?.checkpoint ?? null;
      const progress = throttledProgress('transfer', file.path);
      let bytesDone = previous?.bytesDone ?? 0;
      const stopHeartbeats = keepHeartbeating(() => ({ checkpoint, bytesDone, bytesTotal: file.size }) satisfies TransferHeartbeat);
      try {
        const hub = await hubFor(input.source);
        for (let attempt = 1; ; attempt++) {
          try {
            const result = await transferToS3({
              s3,
              bucket,
              key,
              size: file.size,
              sha256: file.sha256,
              partSize: deps.transfer?.partSize,
              concurrency: deps.transfer?.concurrency,
              resume: checkpoint,
              signal: ctx.cancellationSignal,
              // Progress counts bytes as they arrive from the source (parts commit much more rarely).
              open: async (offset, signal) => {
                const { body } = await hub.download(input.source.repo, input.sha, file.path, { offset, signal });
                bytesDone = offset;
                return (async function* counted() {
                  for await (const chunk of body) {
                    bytesDone += chunk.length;
                    progress(bytesDone, file.size);
                    yield chunk;
                  }
                })();
              },
              onCheckpoint: (cp) => {
                checkpoint = cp;
              },
              // Called when parts commit: heartbeat the new checkpoint right away.
              onProgress: () => heartbeat({ checkpoint, bytesDone, bytesTotal: file.size } satisfies TransferHeartbeat),
            });
            progress(file.size, file.size, true);
            return { key: result.key, bytes: result.bytes, sha256: result.sha256 };
          } catch (err) {
            if (isStorageError(err, 'ChecksumMismatch')) {
              if (attempt >= 2)
                throw ApplicationFailure.nonRetryable(
                  `${file.path}: content does not match the hub's sha256 after a fresh download`,
                  ErrorType.ChecksumMismatch,
                );
              checkpoint = null; // the upload was aborted; download everything again
              continue;
            }
            throw err;
          }
        }
      } catch (err) {
        classify(err);
      } finally {
        stopHeartbeats();
      }
    },

    /**
     * Converts the source files into one artifact; a no-op when it already exists in S3. A GGUF
     * source's `gguf:source` is its file itself, checked and published without a copy.
     */
    async convertArtifact(input: { repo: string; sha: string; name: string; sources: StoredSource[]; request: ArtifactRequest }): Promise<Artifact> {
      const ctx = Context.current();
      if (input.request.weights === 'source') {
        try {
          const { fileType } = await readGgufSourceIn(input.sources, ctx.cancellationSignal);
          const sampling = await publishedSampling(input.sources, ctx.cancellationSignal);
          return {
            format: 'gguf',
            weights: 'source',
            converterVersion: CONVERTER_VERSION,
            files: input.sources.map((s) => s.object),
            ...(fileType ? { sourceType: fileType } : {}),
            ...(sampling ? { sampling } : {}),
          };
        } catch (err) {
          classify(err);
        }
      }
      const weights: WeightsFormat = input.request.weights;
      // Read once the artifact exists: a source that cannot be converted fails as it always has.
      const published = async (): Promise<SamplingDefaults | undefined> => {
        try {
          return await publishedSampling(input.sources, ctx.cancellationSignal);
        } catch (err) {
          classify(err);
        }
      };
      const prefix = artifactPrefix(input.repo, input.sha, input.request, CONVERTER_VERSION);
      const names = input.request.format === 'gguf' ? ['model.gguf'] : ['model.m', 'tokenizer.t'];
      const existing = await Promise.all(names.map((n) => headObject({ s3, bucket, key: prefix + n }, ctx.cancellationSignal)));
      if (existing.every((o) => o?.sha256)) {
        const sampling = await published();
        return {
          ...input.request,
          converterVersion: CONVERTER_VERSION,
          files: existing.map((o, i) => ({ key: prefix + names[i]!, bytes: o!.size, sha256: o!.sha256! })),
          ...(sampling ? { sampling } : {}),
        };
      }
      const stored: StoredObject[] = [];
      const outputs = names.map((n, i) => s3OutputTarget(s3, bucket, prefix + n, { onStored: (o) => (stored[i] = o) }));
      const progress = throttledProgress('convert', `${input.request.format}:${input.request.weights}`);
      let latest: ConvertProgress | null = null;
      const stopHeartbeats = keepHeartbeating(() => latest);
      const onProgress = (p: ConvertProgress) => {
        if (ctx.cancellationSignal.aborted) throw ctx.cancellationSignal.reason;
        latest = p;
        heartbeat(p);
        progress(p.tensorsDone, p.tensorsTotal, p.tensorsDone === p.tensorsTotal);
      };
      const gguf = ggufSourceOf(input.sources);
      try {
        if (gguf) {
          // A GGUF source to distributed-llama: dequantized and quantized again (gguf-dllama.ts).
          if (gguf.length > 1)
            throw new ConvertError(
              'UnsupportedConfig',
              `a split GGUF (${gguf.length} parts) cannot be converted to distributed-llama yet; serve it as gguf:source`,
            );
          const source = s3Source(s3, bucket, gguf[0]!.object.key, { size: gguf[0]!.object.bytes, signal: ctx.cancellationSignal });
          try {
            await convertGgufToDllama({
              gguf: source,
              weights,
              output: { model: outputs[0]!, tokenizer: outputs[1]! },
              threads: deps.convertThreads,
              onProgress,
            });
          } finally {
            await source.close();
          }
        } else {
          await convertModel({
            source: s3Checkpoint(input.sources, ctx.cancellationSignal),
            format: input.request.format,
            weights,
            output: input.request.format === 'gguf' ? outputs[0]! : { model: outputs[0]!, tokenizer: outputs[1]! },
            name: basename(input.repo),
            threads: deps.convertThreads,
            onProgress,
          });
        }
      } catch (err) {
        classify(err);
      } finally {
        stopHeartbeats();
      }
      const sampling = await published();
      return { ...input.request, converterVersion: CONVERTER_VERSION, files: stored, ...(sampling ? { sampling } : {}) };
    },

    /** The memory table of every artifact (see activities/size/memory.ts). */
    async sizeArtifacts(input: { sources: StoredSource[]; artifacts: Artifact[]; contextLength?: number }): Promise<MemoryPlan[]> {
      const bytesOf = (a: Artifact) => a.files.reduce((n, f) => n + f.bytes, 0);
      const gguf = ggufSourceOf(input.sources);
      if (gguf) {
        // A GGUF source: its own metadata says what llama.cpp needs, and distributed-llama's spec.
        const signal = Context.current().cancellationSignal;
        try {
          const { sizing } = await readGgufSourceIn(input.sources, signal);
          const spec = input.artifacts.some((a) => a.format === 'dllama') ? await ggufSpecIn(gguf[0]!, signal) : undefined;
          return input.artifacts.map((a) =>
            a.weights === 'source'
              ? planLlamaCppMemory(sizing, a.weights, input.contextLength, bytesOf(a))
              : planMemory(spec!, a.format, a.weights, input.contextLength, bytesOf(a)),
          );
        } catch (err) {
          classify(err);
        }
      }
      const config = input.sources.find((s) => s.path === 'config.json');
      if (!config) throw ApplicationFailure.nonRetryable('no config.json among the sources', ErrorType.UnsupportedModel);
      let spec;
      try {
        spec = parseModelSpec(JSON.parse(await getText(config.object.key)));
      } catch (err) {
        classify(err);
      }
      return input.artifacts.map((a) =>
        a.weights === 'source'
          ? planLlamaCppMemory(spec, a.weights, input.contextLength, bytesOf(a))
          : planMemory(spec, a.format, a.weights, input.contextLength, bytesOf(a)),
      );
    },

    /** Writes the ready model to the registry (`magus_models`). */
    async publishModel(model: ReadyModel): Promise<void> {
      await deps.registry.put(model);
    },

    /**
     * The model's resource is gone: it leaves the registry (gateways stop listing it) and, with
     * `deleteObjects`, its sources and artifacts leave S3 — unless another ready model was made
     * from the same commit (keys are content-addressed and shared).
     */
    async forgetModel(input: {
      namespace: string;
      name: string;
      repo: string;
      sha: string | null;
      deleteObjects: boolean;
    }): Promise<{ deletedObjects: number; keptFor: string[] }> {
      await deps.registry.remove(input.namespace, input.name);
      if (!input.deleteObjects || !input.sha) return { deletedObjects: 0, keptFor: [] };
      const keptFor = (await deps.registry.list())
        .filter((m) => m.source.repo === input.repo && m.source.sha === input.sha && !(m.namespace === input.namespace && m.name === input.name))
        .map((m) => `${m.namespace}/${m.name}`);
      if (keptFor.length > 0) return { deletedObjects: 0, keptFor };
      let deletedObjects = 0;
      for (const prefix of [`sources/${input.repo}/${input.sha}/`, `artifacts/${input.repo}/${input.sha}/`]) {
        await abortStaleUploads(s3, bucket, { prefix, olderThanMs: 0 });
        for (;;) {
          // Deleting what a page listed and listing again converges even while keys disappear.
          const page = await s3.send(new ListObjectsV2Command({ Bucket: bucket, Prefix: prefix, MaxKeys: 1000 }));
          const keys = (page.Contents ?? []).map((o) => o.Key).filter((k): k is string => typeof k === 'string');
          if (keys.length === 0) break;
          await s3.send(new DeleteObjectsCommand({ Bucket: bucket, Delete: { Objects: keys.map((Key) => ({ Key })), Quiet: true } }));
          deletedObjects += keys.length;
        }
      }
      return { deletedObjects, keptFor };
    },

    /** Aborts incomplete multipart uploads under the given prefixes (cleanup after a cancel). */
    async abortUploads(input: { prefixes: string[] }): Promise<number> {
      let n = 0;
      for (const prefix of input.prefixes) n += await abortStaleUploads(s3, bucket, { prefix, olderThanMs: 0 });
      return n;
    },
  };
}

export type PipelineActivities = ReturnType<typeof pipelineActivities>;
