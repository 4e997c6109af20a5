/**
 * Resolves a {@link SecretRef} (what workflows carry) to the secret's value, inside an activity.
 * Values are trimmed (token files and `kubectl create secret --from-file` keep a trailing
 * newline). Errors name the *reference* (env var, file path, Secret name and key), never a value,
 * and never embed the Kubernetes API's response (which may echo request details).
 */
import { readFile } from 'node:fs/promises';
import type { CoreV1Api } from '@kubernetes/client-node';
import type { SecretRef } from '../../shared/model';
import { ErrorType } from '../../shared/errors';

/** The `name` of every {@link SecretUnavailableError}. */
export const SECRET_UNAVAILABLE_NAME = 'SecretUnavailableError';

/**
 * The reference cannot be resolved: unset or empty env var, unreadable or empty file, missing
 * Secret or key, or no access to it. Permanent: the workflow waits for a spec/secret change.
 */
export class SecretUnavailableError extends Error {
  override readonly name = SECRET_UNAVAILABLE_NAME;
  readonly code = ErrorType.SecretUnavailable;
}

/** True when `err` is a {@link SecretUnavailableError} (by name, so it works across realms). */
export function isSecretUnavailable(err: unknown): err is SecretUnavailableError {
  return typeof err === 'object' && err !== null && (err as { name?: unknown }).name === SECRET_UNAVAILABLE_NAME;
}

export interface SecretResolverDeps {
  /** Needed for `{ secret }` references. */
  kube?: { coreApi: Pick<CoreV1Api, 'readNamespacedSecret'>; defaultNamespace: string };
  /** Environment for `{ env }` references (default `process.env`). */
  env?: Record<string, string | undefined>;
}

export type SecretResolver = (ref: SecretRef) => Promise<string>;

/** Human-readable name of a reference, for messages and logs (no value). */
export function describeSecretRef(ref: SecretRef, defaultNamespace?: string): string {
  if ('env' in ref) return `environment variable ${ref.env}`;
  if ('file' in ref) return `file ${ref.file}`;
  const ns = ref.secret.namespace ?? defaultNamespace;
  return `key ${ref.secret.key} of Secret ${ns ? `${ns}/` : ''}${ref.secret.name}`;
}

export function createSecretResolver(deps: SecretResolverDeps = {}): SecretResolver {
  const env = deps.env ?? process.env;
  const unavailable = (ref: SecretRef, why: string): SecretUnavailableError =>
    new SecretUnavailableError(`${describeSecretRef(ref, deps.kube?.defaultNamespace)} ${why}`);
  const nonEmpty = (ref: SecretRef, value: string): string => {
    const trimmed = value.trim();
    if (!trimmed) throw unavailable(ref, 'is empty');
    return trimmed;
  };

  return async (ref: SecretRef): Promise<string> => {
    if ('env' in ref) {
      const value = env[ref.env];
      if (value === undefined) throw unavailable(ref, 'is not set');
      return nonEmpty(ref, value);
    }
    if ('file' in ref) {
      let text: string;
      try {
        text = await readFile(ref.file, 'utf8');
      } catch (err) {
        const code = (err as { code?: unknown }).code;
        throw unavailable(ref, `cannot be read (${typeof code === 'string' ? code : 'error'})`);
      }
      return nonEmpty(ref, text);
    }
    if ('secret' in ref) {
      const { name, key } = ref.secret;
      if (!deps.kube) throw unavailable(ref, 'cannot be read: no Kubernetes client is configured');
      const namespace = ref.secret.namespace ?? deps.kube.defaultNamespace;
      let data: Record<string, string> | undefined;
      try {
        data = (await deps.kube.coreApi.readNamespacedSecret({ name, namespace })).data;
      } catch (err) {
        const status = (err as { code?: unknown }).code;
        if (status === 404) throw unavailable(ref, 'does not exist (Secret not found)');
        if (status === 401 || status === 403) throw unavailable(ref, `cannot be read: access denied (HTTP ${status})`);
        // Anything else (API server down, 5xx, network) may pass: a plain error, retried.
        throw new Error(`reading ${describeSecretRef(ref, namespace)} failed${typeof status === 'number' ? ` (HTTP ${status})` : ''}; will retry`);
      }
      const encoded = data?.[key];
      if (encoded === undefined) throw unavailable(ref, 'does not exist (the Secret has no such key)');
      return nonEmpty(ref, Buffer.from(encoded, 'base64').toString('utf8'));
    }
    throw new SecretUnavailableError(`unsupported secret reference with keys ${Object.keys(ref).join(', ') || '(none)'}`);
  };
}
