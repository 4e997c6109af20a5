/**
 * Deterministic synthetic Hugging Face checkpoints for tests, benchmarks, `magus model tiny` (a
 * small model to try magus with) and `magus dev` when its demo model cannot be had, plus a small
 * safetensors writer (also used to craft malformed files). By kind: `model.ts`
 * ({@link writeTinyModel}: the repository's files), `layout.ts` (shape, tensors, seeded weights),
 * `tokenizer.ts` (byte-level BPE and chat template), `safetensors.ts` (the writer).
 */
export { writeTinyModel, type TinyModel } from './model';
export {
  mulberry32,
  tinyModelLayout,
  tinyModelTensors,
  tinyTensorData,
  tinyTensorValues,
  type TinyModelLayout,
  type TinyModelOptions,
  type TinyTensor,
} from './layout';
export { gpt2ByteChars } from './tokenizer';
export { encodeRawHeader, encodeSafetensors, encodeSafetensorsHeader, encodeValues, writeSafetensorsFile, type SafetensorsEntry } from './safetensors';
