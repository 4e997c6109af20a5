/**
 * One call per key that concurrent callers share: the placement of a conversation that several
 * turns ask for at once runs once. The call is aborted only when every caller waiting for it has
 * gone away (each caller's own signal rejects its own wait at once), and forgotten once it settles.
 */
interface Call<T> {
  promise: Promise<T>;
  waiters: number;
  abort: AbortController;
}

const reasonOf = (signal: AbortSignal): Error => (signal.reason instanceof Error ? signal.reason : new Error('aborted'));

export class SharedCalls<T> {
  private readonly calls = new Map<string, Call<T>>();

  /** Waits, until `signal` aborts, for the call under `key`, started with `run` when none is under way; `run` gets the call's own signal. */
  join(key: string, run: (signal: AbortSignal) => Promise<T>, signal: AbortSignal): Promise<T> {
    const call = this.calls.get(key) ?? this.start(key, run);
    return new Promise<T>((resolve, reject) => {
      call.waiters++;
      const onAbort = () => {
        if (--call.waiters === 0) {
          if (this.calls.get(key) === call) this.calls.delete(key);
          call.abort.abort(signal.reason);
        }
        reject(reasonOf(signal));
      };
      if (signal.aborted) return onAbort();
      signal.addEventListener('abort', onAbort, { once: true });
      call.promise.then(
        (value) => {
          signal.removeEventListener('abort', onAbort);
          resolve(value);
        },
        (err: unknown) => {
          signal.removeEventListener('abort', onAbort);
          reject(err instanceof Error ? err : new Error(String(err)));
        },
      );
    });
  }

  /** Aborts every call under way (their callers get the calls' rejections). */
  abortAll(reason: Error): void {
    for (const call of this.calls.values()) call.abort.abort(reason);
  }

  private start(key: string, run: (signal: AbortSignal) => Promise<T>): Call<T> {
    const abort = new AbortController();
    const call: Call<T> = { abort, waiters: 0, promise: run(abort.signal) };
    const forget = () => {
      if (this.calls.get(key) === call) this.calls.delete(key);
    };
    call.promise.then(forget, forget);
    this.calls.set(key, call);
    return call;
  }
}
