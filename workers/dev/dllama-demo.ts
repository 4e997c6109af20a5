/**
 * `magus dev --engine dllama [--nodes N]`: the demo served by distributed-llama for real — the
 * `dllama-api` root and `dllama worker`s built from the vendored source (scripts/dev-services),
 * serving the one trained model distributed-llama can run here, stories260K with its FFN padded
 * to 192 (stories260k.ts; SmolLM2's tokenizer and 3 KV heads rule it out), converted to
 * distributed-llama F32, which splits into 1, 2 or 4 nodes.
 */
import { CustomObjectsApi, PatchStrategy, setHeaderOptions, type KubeConfig } from '@kubernetes/client-node';
import { existsSync, mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { CRD_GROUP, CRD_VERSION } from '../../shared/constants';
import { binaryPath, resolveBinaries } from './services';
import { LLAMA2_CHAT_TEMPLATE, STORIES260K_DLLAMA_FFN, writeStories260k } from './stories260k';

/** The demo hub's repository of the padded stories260K. */
export const STORIES_REPO = 'magus-demo/stories260k';
/** Nodes per topology when `--nodes` is not given: a root and one worker. */
export const DEFAULT_DEV_NODES = 2;
/** The node counts the demo's F32 weights split into (64 / 8 heads / 4 KV heads / FFN 192). */
export const DEV_NODES = [1, 2, 4] as const;

/** `--nodes` checked: a node count the demo model splits into. */
export function devNodes(text: string | undefined): number {
  if (text === undefined) return DEFAULT_DEV_NODES;
  const n = Number(text);
  if (!(DEV_NODES as readonly number[]).includes(n))
    throw new Error(`--nodes ${text}: the distributed-llama demo model splits into ${DEV_NODES.join(', ')} nodes (its 4 KV heads)`);
  return n;
}

/** The padded stories260K as a Hugging Face folder in `dataDir` (written once; the same bytes every time, so the same commit). */
export async function storiesDemoFolder(dataDir: string, say: (line: string) => void): Promise<string> {
  const dir = join(dataDir, 'demo-stories260k');
  if (!existsSync(join(dir, '.complete'))) {
    say('writing the distributed-llama demo model (stories260K, FFN padded to 192) …');
    mkdirSync(dir, { recursive: true });
    await writeStories260k(dir, { ffn: STORIES260K_DLLAMA_FFN, chatTemplate: LLAMA2_CHAT_TEMPLATE });
    writeFileSync(join(dir, '.complete'), '');
  }
  return dir;
}

/** The worker's environment for distributed-llama topologies of `nodes` nodes (the programs resolved, built once if need be). */
export async function dllamaEnv(nodes: number, say: (line: string) => void): Promise<Record<string, string>> {
  const bins = await resolveBinaries(['dllama', 'dllama-api'], say);
  return { MAGUS_DLLAMA_API_BIN: binaryPath(bins, 'dllama-api'), MAGUS_DLLAMA_BIN: binaryPath(bins, 'dllama'), MAGUS_DLLAMA_NODES: String(nodes) };
}

/**
 * Creates or updates `body`, a magus resource in `default`, by server-side apply as magus dev
 * (its own field manager, taking over any field another wrote): the demo's `Model` and `Dllama`.
 */
export async function applyAsDev(
  kc: KubeConfig,
  plural: 'models' | 'dllamas',
  body: { apiVersion: string; kind: string; metadata: { name: string; namespace: string }; spec: unknown },
): Promise<void> {
  await kc
    .makeApiClient(CustomObjectsApi)
    .patchNamespacedCustomObject(
      { group: CRD_GROUP, version: CRD_VERSION, namespace: 'default', plural, name: body.metadata.name, body, fieldManager: 'magus-dev', force: true },
      setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply),
    );
}

/**
 * The demo's pool as a `Dllama` resource (`kubectl get dllamas` shows its topology): distributed-
 * llama on `nodes` nodes, one instance at most, none kept while idle.
 */
export async function declareDemoDllama(kc: KubeConfig, model: string, nodes: number): Promise<void> {
  await applyAsDev(kc, 'dllamas', {
    apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
    kind: 'Dllama',
    metadata: { name: model, namespace: 'default' },
    spec: { model, engine: 'dllama', nodesPower: Math.log2(nodes), replicas: 0, minReplicas: 0, maxReplicas: 1, leasesPerInstance: 1, idleTimeout: '30m' },
  });
}

/**
 * Without `--engine dllama`, the demo's `Dllama` an earlier `--engine dllama` run declared is
 * deleted (its pool then serves the demo with the default engine), so `kubectl get dllamas`
 * never shows a topology that does not serve. One that someone outside magus wrote to is left alone.
 * Returns whether it deleted one.
 */
export async function withdrawDemoDllama(kc: KubeConfig, model: string): Promise<boolean> {
  const api = kc.makeApiClient(CustomObjectsApi);
  const where = { group: CRD_GROUP, version: CRD_VERSION, namespace: 'default', plural: 'dllamas', name: model };
  const found = (await api.getNamespacedCustomObject(where).catch((err: unknown) => {
    if ((err as { code?: number }).code === 404) return undefined;
    throw err;
  })) as { metadata?: { managedFields?: { manager?: string }[] } } | undefined;
  // magus's own writers: magus dev (the spec), the controller (its finalizer), the status mirror.
  const managers = new Set((found?.metadata?.managedFields ?? []).map((f) => f.manager ?? ''));
  if (!found || !managers.has('magus-dev') || [...managers].some((m) => !m.startsWith('magus-'))) return false;
  await api.deleteNamespacedCustomObject(where);
  return true;
}
