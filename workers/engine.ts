/**
 * `magus engine`: runs the llama.cpp engine (engine/) until SIGTERM or SIGINT.
 */
import { access, constants } from 'node:fs/promises';
import { createInterface } from 'node:readline';
import { ENGINE_USAGE, parseEngineArgs, startEngine, type EngineOptions, type RunningEngine, type Standby } from '../engine';
import { usageFailure } from '../platform/cli';

export { ENGINE_USAGE } from '../engine';

const message = (err: unknown): string => (err instanceof Error ? err.message : String(err));

/**
 * Runs the engine until SIGTERM or SIGINT (a second signal aborts generations in flight at once).
 * Human-readable progress goes to stderr; with `--json`, `listening`, `ready` and `stopped` events
 * go to stdout as JSON lines (and `standby` first, on standby). On standby (`--standby`) it maps
 * the model and waits for a line `start` on stdin; stdin's end or a signal meanwhile ends it (0).
 * @returns exit status: 0 after a clean stop, 1 on bad options or when the model cannot be loaded
 */
export async function engineCommand(args: string[]): Promise<number> {
  let opts: EngineOptions;
  try {
    opts = parseEngineArgs(args);
  } catch (err) {
    return usageFailure('magus engine', ENGINE_USAGE, err);
  }
  const log = (line: string): void => {
    process.stderr.write(`magus engine: ${line}\n`);
  };
  try {
    await access(opts.model, constants.R_OK);
  } catch (err) {
    log(`cannot read the model: ${message(err)}`);
    return 1;
  }
  const emit = (event: Record<string, unknown>): void => {
    if (opts.json) process.stdout.write(`${JSON.stringify(event)}\n`);
  };

  const standby = opts.standby ? standbyUntilStart(opts.warm, () => emit({ event: 'standby' }), log) : undefined;
  let engine: RunningEngine;
  try {
    engine = await startEngine(opts, log, standby?.standby);
  } catch (err) {
    if (standby?.ended()) {
      log('standby ended before it was started');
      return 0;
    }
    log(`cannot ${opts.standby ? 'load the model or listen' : 'listen'} on ${opts.host}:${opts.port}: ${message(err)}`);
    return 1;
  } finally {
    standby?.dispose();
  }
  log(`listening on ${engine.url}; loading ${opts.model} …`);
  emit({ event: 'listening', url: engine.url });

  let signals = 0;
  let onSignal: (signal: NodeJS.Signals) => void = () => undefined;
  const signalled = new Promise<void>((resolve) => {
    onSignal = (signal) => {
      if (++signals === 1) {
        log(`${signal}: stopping; generations in flight have ${opts.graceMs} ms to finish`);
        resolve();
      } else {
        log(`${signal} again: aborting generations in flight`);
        engine.core.abortInFlight();
      }
    };
  });
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);
  try {
    const outcome = await Promise.race([
      engine.loaded.then(
        (info) => ({ info }),
        (err: unknown) => ({ err }),
      ),
      signalled.then(() => ({})),
    ]);
    if ('err' in outcome) {
      log(`cannot load ${opts.model}: ${message(outcome.err)}`);
      await engine.stop();
      return 1;
    }
    if ('info' in outcome) {
      const { info } = outcome;
      log(`ready: ${info.model}, ${info.slots} slot(s) of ${info.contextSize} tokens, chat template: ${info.chatTemplate.note} (loaded in ${info.loadMs} ms)`);
      emit({ event: 'ready', ...info });
      await signalled;
    }
    await engine.stop();
    log('stopped');
    emit({ event: 'stopped' });
    return 0;
  } finally {
    process.off('SIGINT', onSignal);
    process.off('SIGTERM', onSignal);
  }
}

/**
 * A standby's go: a line `start` on stdin. Stdin's end (whoever started it is gone, or chose
 * another) or SIGTERM/SIGINT meanwhile ends the standby instead.
 */
function standbyUntilStart(warm: boolean, waiting: () => void, log: (line: string) => void): { standby: Standby; ended(): boolean; dispose(): void } {
  let ended = false;
  let end: () => void = () => undefined;
  const lines = createInterface({ input: process.stdin });
  const go = new Promise<void>((start, fail) => {
    end = () => {
      ended = true;
      fail(new Error('standby ended'));
    };
    lines.on('line', (line) => {
      if (line.trim() === 'start') start();
    });
    lines.once('close', end);
  });
  go.catch(() => undefined);
  const onSignal = () => end();
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);
  return {
    standby: {
      go,
      warm,
      waiting: () => {
        log(`on standby: the model is mapped${warm ? ' and its context made' : ''}; a line "start" on stdin starts serving`);
        waiting();
      },
    },
    ended: () => ended,
    dispose: () => {
      process.off('SIGINT', onSignal);
      process.off('SIGTERM', onSignal);
      lines.removeAllListeners('close');
      lines.close();
    },
  };
}
