/**
 * The process's own gauges, in the names Prometheus' client libraries use, appended to every
 * magus server's `/metrics` (gateway, worker, controller, bridge): resident memory, the V8 heap
 * (used and reserved), memory held outside it, open file descriptors, the start time and the
 * event loop's delay (what a request waits behind a GC pause or long synchronous work). A leak
 * shows as a heap that keeps growing after garbage collection; RSS alone also moves with V8's
 * own sizing of its heap.
 */
import { readdirSync } from 'node:fs';
import { monitorEventLoopDelay } from 'node:perf_hooks';

const startTimeSeconds = Math.round((Date.now() - performance.now()) / 1000);

function gauge(name: string, help: string, value: number | undefined): string {
  return `# HELP ${name} ${help}\n# TYPE ${name} gauge\n${value === undefined ? '' : `${name} ${value}\n`}`;
}

function openFds(): number | undefined {
  try {
    return readdirSync('/proc/self/fd').length - 1; // less the one this read opened
  } catch {
    return undefined; // not Linux
  }
}

/** `magus_worker_cached_workflows`, for a process that runs Temporal workers (magus worker, magus dev). */
export function cachedWorkflowsMetricsText(count: number | undefined): string {
  return gauge(
    'magus_worker_cached_workflows',
    'Workflows the Temporal SDK keeps cached in this process (their state is in the workflow threads, outside the heap gauges above).',
    count,
  );
}

/** How long one window of the event-loop delay gauges is. */
const LOOP_WINDOW_MS = 30_000;
let loop: { histogram: ReturnType<typeof monitorEventLoopDelay>; last: { p99: number; max: number } | undefined } | undefined;

/**
 * The event loop's delay (how late a 10-ms timer fired: garbage collection pauses and long
 * synchronous work) over the last completed 30-s window; measured from the first scrape on.
 */
function loopDelay(): { p99: number; max: number } | undefined {
  if (!loop) {
    const histogram = monitorEventLoopDelay({ resolution: 10 });
    histogram.enable();
    loop = { histogram, last: undefined };
    setInterval(() => {
      loop!.last = { p99: histogram.percentile(99) / 1e9, max: histogram.max / 1e9 };
      histogram.reset();
    }, LOOP_WINDOW_MS).unref();
  }
  return loop.last;
}

export function processMetricsText(): string {
  const m = process.memoryUsage();
  const delay = loopDelay();
  return (
    gauge('process_resident_memory_bytes', 'Resident memory size in bytes.', m.rss) +
    gauge('nodejs_heap_size_used_bytes', 'V8 heap in use, in bytes (garbage not yet collected included).', m.heapUsed) +
    gauge('nodejs_heap_size_total_bytes', 'V8 heap reserved, in bytes.', m.heapTotal) +
    gauge('nodejs_external_memory_bytes', 'Memory of objects outside the V8 heap bound to JavaScript ones (buffers), in bytes.', m.external) +
    gauge('process_open_fds', 'Open file descriptors.', openFds()) +
    gauge('process_start_time_seconds', 'Start time of the process since the Unix epoch, in seconds.', startTimeSeconds) +
    gauge(
      'nodejs_eventloop_delay_p99_seconds',
      'Event loop delay, 99th percentile over the last completed 30-s window (empty until one completed).',
      delay?.p99,
    ) +
    gauge(
      'nodejs_eventloop_delay_max_seconds',
      'Event loop delay, longest over the last completed 30-s window: a garbage collection pause or long synchronous work shows here.',
      delay?.max,
    )
  );
}
