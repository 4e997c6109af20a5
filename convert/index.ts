/**
 * The conversion room's public surface: what the rest of magus uses of convert/. Product code in
 * other rooms imports from here, except where loading the whole converter would burden a process
 * that never converts; those import the one light module they need (README.md, "Imports").
 *
 * Everything here is pure of Temporal: I/O goes through {@link ByteSource}s, local files and
 * {@link OutputTarget}s, and every failure caused by the input is a {@link ConvertError}.
 */

// Converting: a Hugging Face checkpoint → GGUF or distributed-llama; a GGUF → distributed-llama.
export { convertModel, CONVERTER_VERSION, OUTPUT_FORMATS, type ConvertOptions, type ConvertProgress, type ConvertResult, type Output } from './convert';
export { convertGgufToDllama } from './gguf-dllama';

// The model: `config.json` or a GGUF header → a validated spec and its tensor plans.
export { parseModelSpec, planTensors, type ModelSpec, type OutputFormat, type PlannedTensor } from './arch';
export { specFromGguf } from './gguf-spec';
export { ggufRopeFreqs } from './gguf-dequant';

// Reading GGUF files: headers, and a repository's GGUF checked before it is published as is.
export { readGguf, type GgufFile, type GgufTensorEntry } from './gguf-reader';
export { readGgufSource, type GgufSource } from './gguf-source';

// Where bytes come from and go to: implemented outside the room for S3 (activities/storage).
export type { ByteSource, CheckpointFiles } from './types';
export type { ByteSink, OutputTarget } from './atomic-file';
export { target } from './safetensors';

// Errors.
export { ConvertError, isConvertError, type ConvertErrorCode } from './errors';
