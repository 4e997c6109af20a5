/**
 * Worker-thread entry of {@link QuantPool} (pool.ts): encodes one chunk per message. The input
 * buffer arrives transferred and the output goes back transferred, so no bytes are copied.
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
}

/** Worker → pool. */
export type EncodeResponse =
  | { id: number; ok: true; out: Uint8Array }
  | { id: number; ok: false; error: { name: string; message: string; code?: string; stack?: string } };

function handle(req: EncodeRequest): { response: EncodeResponse; transfer: ArrayBuffer[] } {
  try {
    const elements = req.bytes.byteLength / dtypeSize(req.dtype);
    const out = new Uint8Array(encodedSize(req.format, Number.isInteger(elements) ? elements : 0, req.label));
    encodeChunk({ dtype: req.dtype, bytes: req.bytes }, req.format, out, { flavor: req.flavor, label: req.label, elementOffset: req.elementOffset });
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
