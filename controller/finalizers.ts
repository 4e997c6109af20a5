/**
 * The `magus.dev/cleanup` finalizer on `Model` and `Dllama` resources, through which their
 * deletion waits for the workflow's cleanup: added by server-side apply under the controller's
 * field manager, and removed with a JSON patch that `test`s the list first, so a change to it
 * meanwhile fails the patch and the key is retried on the new list instead of overwriting it.
 */
import { PatchStrategy, setHeaderOptions, type CustomObjectsApi } from '@kubernetes/client-node';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';
import { FieldManager, FINALIZER, type DllamaResource, type ModelResource } from '../shared/kube';

const applyHeaders = setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply);
const jsonPatchHeaders = setHeaderOptions('Content-Type', PatchStrategy.JsonPatch);
const errCode = (err: unknown): number | undefined => (err as { code?: number }).code;

type Finalized = ModelResource | DllamaResource;

export class Finalizers {
  /** Finalizers removed (each a cleanup finished, or cut short). */
  removed = 0;

  constructor(private readonly custom: CustomObjectsApi) {}

  /** Whether `o` carries the finalizer. */
  static held(o: Finalized): boolean {
    return o.metadata.finalizers?.includes(FINALIZER) ?? false;
  }

  async add(plural: string, kind: string, o: Finalized): Promise<void> {
    const body = {
      apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
      kind,
      metadata: { name: o.metadata.name, namespace: o.metadata.namespace, uid: o.metadata.uid, finalizers: [FINALIZER] },
    };
    await this.custom.patchNamespacedCustomObject(
      {
        group: CRD_GROUP,
        version: CRD_VERSION,
        namespace: o.metadata.namespace,
        plural,
        name: o.metadata.name,
        body,
        fieldManager: FieldManager.controller,
        force: true,
      },
      applyHeaders,
    );
  }

  /** Removes the finalizer; `o` gone already is no failure. */
  async remove(plural: string, o: Finalized): Promise<void> {
    const finalizers = o.metadata.finalizers ?? [];
    const body = [
      { op: 'test', path: '/metadata/finalizers', value: finalizers },
      { op: 'replace', path: '/metadata/finalizers', value: finalizers.filter((f) => f !== FINALIZER) },
    ];
    try {
      await this.custom.patchNamespacedCustomObject(
        { group: CRD_GROUP, version: CRD_VERSION, namespace: o.metadata.namespace, plural, name: o.metadata.name, body },
        jsonPatchHeaders,
      );
      this.removed++;
    } catch (err) {
      if (errCode(err) !== 404) throw err;
    }
  }
}
