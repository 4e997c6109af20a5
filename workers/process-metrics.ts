/**
 * The process's own gauges, in the names Prometheus' client libraries use, appended to every
 * magus server's `/metrics` (gateway, worker, controller, bridge): resident memory, the V8 heap
 * (used and reserved), memory held outside it, open file descriptors and the start time. A leak
 * shows as a heap that keeps growing after garbage collection; RSS alone also moves with V8's
 * own sizing of its heap.
 */
import { readdirSync } from 'node:fs';

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
  return gauge('magus_worker_cached_workflows', 'Workflows the Temporal SDK keeps cached in this process (their state is in the workflow threads, outside the heap gauges above).', count);
}

export function processMetricsText(): string {
  const m = process.memoryUsage();
  return (
    gauge('process_resident_memory_bytes', 'Resident memory size in bytes.', m.rss) +
    gauge('nodejs_heap_size_used_bytes', 'V8 heap in use, in bytes (garbage not yet collected included).', m.heapUsed) +
    gauge('nodejs_heap_size_total_bytes', 'V8 heap reserved, in bytes.', m.heapTotal) +
    gauge('nodejs_external_memory_bytes', 'Memory of objects outside the V8 heap bound to JavaScript ones (buffers), in bytes.', m.external) +
    gauge('process_open_fds', 'Open file descriptors.', openFds()) +
    gauge('process_start_time_seconds', 'Start time of the process since the Unix epoch, in seconds.', startTimeSeconds)
  );
}
