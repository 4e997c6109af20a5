/** Kubernetes Events about magus's resources (what `kubectl describe` lists). */
import { randomBytes } from 'node:crypto';
import type { CoreV1Api } from '@kubernetes/client-node';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';

export interface EventTarget {
  namespace: string;
  name: string;
  uid: string;
}

/**
 * Records a Kubernetes Event about one of our resources (what `kubectl describe` lists). Best
 * effort: an Event that cannot be written never fails the work it reports.
 */
export async function recordEvent(core: CoreV1Api, kind: string, ref: EventTarget, type: 'Normal' | 'Warning', reason: string, message: string): Promise<void> {
  const now = new Date();
  try {
    await core.createNamespacedEvent({
      namespace: ref.namespace,
      body: {
        metadata: { name: `${ref.name}.${randomBytes(8).toString('hex')}`, namespace: ref.namespace },
        involvedObject: { apiVersion: `${CRD_GROUP}/${CRD_VERSION}`, kind, name: ref.name, namespace: ref.namespace, uid: ref.uid },
        reason,
        message: message.slice(0, 1024),
        type,
        source: { component: 'magus' },
        reportingComponent: 'magus.dev/magus',
        firstTimestamp: now,
        lastTimestamp: now,
        count: 1,
      },
    });
  } catch {
    // Events are advisory.
  }
}
