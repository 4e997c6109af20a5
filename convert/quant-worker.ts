/**
 * Worker-thread entry of {@link QuantPool} (pool.ts): encodes one chunk per message. The input
 * buffer arrives transferred (or shared) and the output goes back transferred, or is written into
 * the shared output buffer the request names, so no bytes are copied.
 * Errors are caught and returned with the request id; the worker stays usable.
 */
import { parentPort } from 'node:worker_threads';
import { encodeChunk, encodedSize, dtypeSize } from './quant';
import type { QuantFlavor, SourceDType, WeightsFormat } from './types';

/** Pool → worker. */
export interface EncodeRequest {
  id: number;
  dtype: SourceDType;
  bytes: Uint8Array;
  format: WeightsFormat;
  flavor: QuantFlavor;
  label?: string;
  elementOffset?: number;
  /** A view of shared memory to encode into (from its start), instead of a fresh buffer. */
  out?: Uint8Array;
}

/** Worker → pool: the output (transferred), or how many bytes of the request's `out` it filled. */
export type EncodeResponse =
  | { id: number; ok: true; out: Uint8Array }
  | { id: number; ok: true; written: number }
  | { id: number; ok: false; error: { name: string; message: string; code?: string; stack?: string } };

function handle(req: EncodeRequest): { response: EncodeResponse; transfer: ArrayBuffer[] } {
  try {
    const elements = req.bytes.byteLength / dtypeSize(req.dtype);
    const size = encodedSize(req.format, Number.isInteger(elements) ? elements : 0, req.label);
    const opts = { flavor: req.flavor, label: req.label, elementOffset: req.elementOffset };
    if (req.out) {
      if (req.out.length < size) throw new RangeError(`${req.label ?? 'chunk'}: ${size} encoded bytes do not fit the ${req.out.length}-byte output buffer`);
      encodeChunk({ dtype: req.dtype, bytes: req.bytes }, req.format, req.out.subarray(0, size), opts);
      return { response: { id: req.id, ok: true, written: size }, transfer: [] };
    }
    const out = new Uint8Array(size);
    encodeChunk({ dtype: req.dtype, bytes: req.bytes }, req.format, out, opts);
    return { response: { id: req.id, ok: true, out }, transfer: [out.buffer] };
  } catch (err) {
    const e = err as Error & { code?: unknown };
    const error = { name: e.name ?? 'Error', message: e.message ?? String(err), stack: e.stack, ...(typeof e.code === 'string' ? { code: e.code } : {}) };
    return { response: { id: req.id, ok: false, error }, transfer: [] };
  }
}

if (parentPort) {
  const port = parentPort;
  port.on('message', (req: EncodeRequest) => {
    const { response, transfer } = handle(req);
    port.postMessage(response, transfer);
  });
}
