/** A Kubernetes client configuration for the test kube-apiserver (bearer token, self-signed TLS). */
import { KubeConfig } from '@kubernetes/client-node';
import { endpoint } from '.';

export function kubeConfig(): KubeConfig {
  const kubernetes = endpoint('kubernetes');
  const kc = new KubeConfig();
  kc.loadFromOptions({
    clusters: [{ name: 'magus-test', server: kubernetes.server, skipTLSVerify: true }],
    users: [{ name: 'magus-admin', token: kubernetes.token }],
    contexts: [{ name: 'magus-test', cluster: 'magus-test', user: 'magus-admin' }],
    currentContext: 'magus-test',
  });
  return kc;
}
