// Lint fixture: the conversion library reaching up into activities/ (the sizing it feeds).
import { DLLAMA_NODE_COUNTS } from '../../../../activities/size/memory';

export const counts = DLLAMA_NODE_COUNTS;
