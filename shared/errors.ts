/**
 * Failure types (Temporal `ApplicationFailure.type`) shared by activities and workflows.
 * Permanent ones are raised non-retryable; the workflow records the reason and waits for a spec
 * change instead of retrying.
 */
export const ErrorType = {
  /** The repository or revision does not exist (HTTP 404 from the hub). */
  RepoNotFound: 'RepoNotFound',
  /** The token is missing, invalid, or lacks access to a gated/private repo (401/403). */
  Unauthorized: 'Unauthorized',
  /** Architecture, dtype or config the converter does not support. */
  UnsupportedModel: 'UnsupportedModel',
  /** Content did not match the source's sha256, even after a fresh download. */
  ChecksumMismatch: 'ChecksumMismatch',
  /** The spec itself is invalid. */
  InvalidSpec: 'InvalidSpec',
  /** A referenced secret could not be resolved. */
  SecretUnavailable: 'SecretUnavailable',
  /** The file the spec chooses (`source.gguf`) is not in the pinned revision, or not one file. */
  NoSuchFile: 'NoSuchFile',
  /**
   * The source's hub (or a redirect from it) is, or resolves to, an address the worker refuses:
   * loopback, private, link-local, metadata … outside its `MAGUS_HUB_ALLOW_NETWORKS`.
   */
  AddressRefused: 'AddressRefused',
} as const;
export type ErrorType = (typeof ErrorType)[keyof typeof ErrorType];

/** Types that no retry can fix. */
export const PERMANENT_ERROR_TYPES: readonly string[] = Object.values(ErrorType);

/**
 * A status write whose resource no longer exists, or is another object under the same name
 * (its uid differs): never retried; the workflow writes again when a resource comes back.
 */
export const RESOURCE_GONE = 'ResourceGone';

/**
 * Failure types of serving: the `type` of the gateway's session errors, which it answers by
 * (gateway/plugins/errors.ts). Kept apart from {@link ErrorType}, whose every value the
 * pipeline's retry policy lists as non-retryable.
 */
export const ServingErrorType = {
  /** No instance of the model serves, and none can be started (the pool's reason follows): 503 `no_capacity`. */
  NoCapacity: 'NoCapacity',
  /** The instance's request backlog is full: 429 with `Retry-After`. */
  BacklogFull: 'BacklogFull',
  /** What a first turn needs cannot be reached (Temporal, or a gateway that is stopping): 503 `unavailable`. */
  Unavailable: 'Unavailable',
} as const;
export type ServingErrorType = (typeof ServingErrorType)[keyof typeof ServingErrorType];

/**
 * Why a runtime could not start an instance: the `Error.name` it throws ({@link runtimeError}),
 * which `createInstance` keeps as the failure type of the permanent ones ({@link PERMANENT_RUNTIME_ERRORS}).
 */
export const RuntimeErrorType = {
  /** The model is not in the registry (not published yet, or deleted). */
  ModelNotReady: 'ModelNotReady',
  /** The model has no artifact this runtime can run (no GGUF for llama.cpp, no distributed-llama one). */
  NoArtifact: 'NoArtifact',
  /** The instance was destroyed while it started: a retry must not bring it back. */
  InstanceDestroyed: 'InstanceDestroyed',
  /** A pod of the instance stayed unschedulable past the runtime's limit (Kubernetes; the scheduler's reason follows). */
  Unschedulable: 'Unschedulable',
  /** No topology of the model fits the cluster's nodes (Kubernetes): nothing was created. */
  NoFit: 'NoFit',
  /** A pod of the instance failed while it started (Kubernetes). */
  InstanceFailed: 'InstanceFailed',
  /** Not every pod was ready within the runtime's start timeout (Kubernetes). */
  StartTimedOut: 'StartTimedOut',
  /** The runtime (its worker) stopped while the instance started. */
  RuntimeStopped: 'RuntimeStopped',
  /** The model's namespace is not one the runtime may place instances in (Kubernetes, a namespaced install). */
  NamespaceNotServed: 'NamespaceNotServed',
} as const;
export type RuntimeErrorType = (typeof RuntimeErrorType)[keyof typeof RuntimeErrorType];

/**
 * Runtime errors that no retry of the same start can fix, or that a retry must not undo
 * (`InstanceDestroyed`): `createInstance` fails at once, non-retryable and typed by the name, and
 * the pool backs off before its next start (for `Unschedulable` and `NoFit` as well).
 */
export const PERMANENT_RUNTIME_ERRORS: readonly string[] = [
  RuntimeErrorType.ModelNotReady,
  RuntimeErrorType.NoArtifact,
  RuntimeErrorType.InstanceDestroyed,
  RuntimeErrorType.Unschedulable,
  RuntimeErrorType.NoFit,
  RuntimeErrorType.NamespaceNotServed,
];

/**
 * The error a runtime's start fails with: a plain `Error` named by its type. Not a subclass:
 * Temporal types a thrown error by its class name first, so a retryable one (`InstanceFailed`)
 * keeps the failure type `Error` it is recorded with.
 */
export const runtimeError = (name: RuntimeErrorType, message: string): Error & { name: RuntimeErrorType } => Object.assign(new Error(message), { name });
