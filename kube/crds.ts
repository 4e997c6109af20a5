/**
 * Installs magus's CustomResourceDefinitions (`crds/*.yaml`) into a cluster, as
 * `kubectl apply --server-side -f crds/` would, and waits until the new kinds can be used.
 * Idempotent and safe to call concurrently (many test files call it against one apiserver).
 */
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import {
  ApiextensionsV1Api,
  CustomObjectsApi,
  type KubeConfig,
  loadAllYaml,
  PatchStrategy,
  setHeaderOptions,
  type V1CustomResourceDefinition,
} from '@kubernetes/client-node';
// Not re-exported by the package index: the typed models use renamed keys (`x_kubernetes_validations`,
// `_default`, `_enum`), and only this serializer maps YAML's wire names onto them.
import { ObjectSerializer } from '@kubernetes/client-node/dist/serializer.js';

/** The field manager that owns the CRDs; a second manager applying them would conflict. */
export const CRD_FIELD_MANAGER = 'magus-crds';
export const CRD_FILES = ['model.yaml', 'dllama.yaml', 'session.yaml', 'apikey.yaml'] as const;

/**
 * `crds/` of the checkout this module lives in, from sources or from `dist/activities/kubernetes`.
 * Looked up on use, not on import: an image without the YAML can still load this module.
 */
export function crdsDir(): string {
  let dir = __dirname;
  while (!existsSync(join(dir, 'crds', CRD_FILES[0]))) {
    const up = dirname(dir);
    if (up === dir) throw new Error(`cannot find crds/${CRD_FILES[0]} above ${__dirname}`);
    dir = up;
  }
  return join(dir, 'crds');
}

/** What the installer reads from a manifest (the same keys in wire and typed form). */
export interface RawCrd {
  kind: string;
  metadata: { name: string };
  spec: { group: string; names: { plural: string }; versions: { name: string; served: boolean }[] };
}

/** The manifests as written (wire field names), which is what is sent to the API server. */
export function loadRawCrdManifests(): RawCrd[] {
  const dir = crdsDir();
  return CRD_FILES.flatMap((file) => {
    const docs = (loadAllYaml(readFileSync(join(dir, file), 'utf8')) as unknown[]).filter((d) => d != null);
    for (const d of docs) {
      const kind = (d as { kind?: unknown }).kind;
      if (kind !== 'CustomResourceDefinition') throw new Error(`crds/${file}: expected only CustomResourceDefinitions, found ${String(kind)}`);
    }
    return docs as RawCrd[];
  });
}

/** The three CRDs as the client's typed models. */
export function loadCrdManifests(): V1CustomResourceDefinition[] {
  return loadRawCrdManifests().map((raw) => ObjectSerializer.deserialize(raw, 'V1CustomResourceDefinition') as V1CustomResourceDefinition);
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const statusCode = (err: unknown): number | undefined => (err as { code?: number }).code;

/**
 * Server-side applies every CRD (field manager {@link CRD_FIELD_MANAGER}, forced), then waits
 * until each is Established and its resource answers a list: the apiserver reports
 * Established before its handler serves the new plural, so a create right after can 404.
 */
export async function installCrds(kc: KubeConfig, opts: { timeoutMs?: number } = {}): Promise<void> {
  const deadline = Date.now() + (opts.timeoutMs ?? 60_000);
  const ext = kc.makeApiClient(ApiextensionsV1Api);
  const custom = kc.makeApiClient(CustomObjectsApi);
  // The generated patch call picks JSON Patch as its Content-Type; apply needs its own. The
  // raw manifest goes as the body (the `any`-typed body is sent as is), so nothing is lost to
  // the typed models' key renaming.
  const apply = setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply);
  const crds = loadRawCrdManifests();

  for (const crd of crds) {
    await ext.patchCustomResourceDefinition({ name: crd.metadata.name, body: crd, fieldManager: CRD_FIELD_MANAGER, force: true }, apply);
  }

  for (const crd of crds) {
    const name = crd.metadata.name;
    for (;;) {
      const got = await ext.readCustomResourceDefinition({ name });
      const cond = (type: string) => got.status?.conditions?.find((c) => c.type === type);
      // A name clash with another CRD never resolves by waiting.
      if (cond('NamesAccepted')?.status === 'False') throw new Error(`CRD ${name}: names not accepted: ${cond('NamesAccepted')?.message ?? ''}`);
      if (cond('Established')?.status === 'True') break;
      if (Date.now() > deadline) throw new Error(`CRD ${name} did not become Established in time`);
      await sleep(100);
    }
    const { group, names, versions } = crd.spec;
    for (const version of versions.filter((v) => v.served)) {
      for (;;) {
        try {
          await custom.listNamespacedCustomObject({ group, version: version.name, namespace: 'default', plural: names.plural, limit: 1 });
          break;
        } catch (err) {
          if (statusCode(err) !== 404 || Date.now() > deadline) throw err;
          await sleep(100);
        }
      }
    }
  }
}
