/** Every workflow a magus worker registers (the worker bundles this module). */
export { modelPipeline } from './model/pipeline';
export { dllamaPool } from './pool/pool';
export { session } from './session/session';
