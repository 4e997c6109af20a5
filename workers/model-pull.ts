/**
 * `magus model pull <repo>[@revision] --format gguf:q40,dllama:q40 [--hub URL] [--name NAME]
 *  [--namespace NS] [--token-env VAR | --token-file PATH] [--context N] [--detach]`
 *
 * Starts (or re-specs) the model's pipeline workflow and draws its progress until it is ready.
 * The token is passed as a reference (an env var name or a file path the worker can read),
 * never as a value.
 */
import { Client, Connection, WorkflowExecutionAlreadyStartedError } from '@temporalio/client';
import { SearchAttribute } from '../shared/constants';
import { validateModelSpec, type ArtifactRequest, type ModelSpec, type SecretRef } from '../shared/model';
import { modelWorkflowId, progressQuery, specChangedSignal, type PipelineProgress } from '../workflows/model/definitions';
import type { modelPipeline } from '../workflows/model/pipeline';
import { loadConfig } from './config';
import { TerminalProgress } from './progress';

export const PULL_USAGE =
  'usage: magus model pull <org/repo>[@revision] --format gguf:q40[,dllama:q40…] [--hub URL] [--name NAME] [--namespace NS] [--token-env VAR | --token-file PATH] [--context N] [--detach]';

class UsageError extends Error {}

export interface PullArgs {
  spec: ModelSpec;
  namespace: string;
  name: string;
  detach: boolean;
}

/** A DNS-label name from a repo id: `TinyLlama/TinyLlama-1.1B-Chat` → `tinyllama-1-1b-chat`. */
export function defaultModelName(repo: string): string {
  const base = (repo.split('/')[1] ?? repo).toLowerCase().replace(/[^a-z0-9]+/g, '-').replace(/^-+|-+$/g, '');
  return base.slice(0, 63).replace(/-+$/, '') || 'model';
}

export function parsePullArgs(args: string[]): PullArgs {
  let ref: string | undefined;
  const opts: Record<string, string> = {};
  let detach = false;
  const valued = new Set(['--format', '--hub', '--name', '--namespace', '--token-env', '--token-file', '--context']);
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === '--detach') detach = true;
    else if (valued.has(a)) {
      const v = args[++i];
      if (v === undefined) throw new UsageError(`${a} needs a value`);
      opts[a] = v;
    } else if (a.startsWith('-')) throw new UsageError(`unknown option ${a}`);
    else if (ref === undefined) ref = a;
    else throw new UsageError(`unexpected argument ${a}`);
  }
  if (!ref) throw new UsageError('missing <org/repo>');
  const [repo, revision] = ref.split('@', 2) as [string, string | undefined];
  if (!opts['--format']) throw new UsageError('--format is required, e.g. --format gguf:q40,dllama:q40');
  const artifacts = opts['--format'].split(',').map((f): ArtifactRequest => {
    const [format, weights] = f.trim().split(':');
    return { format: format as ArtifactRequest['format'], weights: weights as ArtifactRequest['weights'] };
  });
  if (opts['--token-env'] && opts['--token-file']) throw new UsageError('give --token-env or --token-file, not both');
  const tokenRef: SecretRef | undefined = opts['--token-env'] ? { env: opts['--token-env'] } : opts['--token-file'] ? { file: opts['--token-file'] } : undefined;
  const spec: ModelSpec = {
    source: { repo, ...(revision ? { revision } : {}), ...(opts['--hub'] ? { hubUrl: opts['--hub'] } : {}), ...(tokenRef ? { tokenRef } : {}) },
    artifacts,
    ...(opts['--context'] ? { contextLength: Number(opts['--context']) } : {}),
  };
  const errors = validateModelSpec(spec);
  if (errors.length > 0) throw new UsageError(errors.join('\n'));
  const name = opts['--name'] ?? defaultModelName(repo);
  const namespace = opts['--namespace'] ?? 'default';
  for (const [what, v] of [['--name', name], ['--namespace', namespace]] as const) {
    if (!/^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/.test(v)) throw new UsageError(`${what} ${v} is not a DNS label`);
  }
  return { spec, namespace, name, detach };
}

function describe(p: PipelineProgress): string {
  return p.failure ? `${p.phase}: ${p.failure.type}: ${p.failure.message}` : p.phase;
}

export async function modelPullCommand(args: string[]): Promise<number> {
  let parsed: PullArgs;
  try {
    parsed = parsePullArgs(args);
  } catch (err) {
    if (!(err instanceof UsageError)) throw err;
    process.stderr.write(`magus model pull: ${err.message}\n${PULL_USAGE}\n`);
    return 1;
  }
  const cfg = loadConfig();
  const connection = await Connection.connect({ address: cfg.temporal.address });
  try {
    const client = new Client({ connection, namespace: cfg.temporal.namespace });
    const workflowId = modelWorkflowId(parsed.namespace, parsed.name);
    const input = { namespace: parsed.namespace, name: parsed.name, spec: parsed.spec };
    try {
      await client.workflow.signalWithStart<typeof modelPipeline, [ModelSpec]>('modelPipeline', {
        workflowId,
        taskQueue: cfg.taskQueue,
        args: [input],
        signal: specChangedSignal,
        signalArgs: [parsed.spec],
        memo: { repo: parsed.spec.source.repo, revision: parsed.spec.source.revision ?? 'main' },
        searchAttributes: { [SearchAttribute.kind]: ['model'], [SearchAttribute.model]: [`${parsed.namespace}/${parsed.name}`] },
      });
    } catch (err) {
      if (!(err instanceof WorkflowExecutionAlreadyStartedError)) throw err;
    }
    process.stderr.write(`pipeline ${workflowId} (${parsed.spec.source.repo}@${parsed.spec.source.revision ?? 'main'})\n`);
    if (parsed.detach) return 0;

    const handle = client.workflow.getHandle(workflowId);
    const bar = new TerminalProgress();
    let stop = false;
    const onSignal = () => {
      stop = true;
    };
    process.once('SIGINT', onSignal);
    let last = '';
    try {
      for (;;) {
        const p = await handle.query(progressQuery);
        if (p.phase !== last) {
          bar.finish();
          process.stderr.write(`${describe(p)}\n`);
          last = p.phase;
        }
        if (p.phase === 'transferring') bar.update({ bytesDone: p.bytes.done, bytesTotal: p.bytes.total, itemsDone: p.files.done, itemsTotal: p.files.total, itemLabel: 'files' });
        if (p.phase === 'converting' && p.tensors.total > 0) bar.update({ bytesDone: p.tensors.done, bytesTotal: p.tensors.total, itemsDone: p.tensors.done, itemsTotal: p.tensors.total, itemLabel: 'tensors' });
        if (p.phase === 'ready') {
          bar.finish();
          process.stdout.write(`${parsed.namespace}/${parsed.name} is ready (${p.repo}@${p.sha})\n`);
          return 0;
        }
        if (p.phase === 'failed' || p.phase === 'cancelled') {
          bar.finish();
          return 1;
        }
        if (stop) {
          bar.finish();
          process.stderr.write(`stopped watching; the pipeline goes on (workflow ${workflowId})\n`);
          return 130;
        }
        await new Promise((r) => setTimeout(r, 500));
      }
    } finally {
      process.off('SIGINT', onSignal);
    }
  } finally {
    await connection.close();
  }
}
