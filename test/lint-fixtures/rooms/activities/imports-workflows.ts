// Lint fixture: an activity importing a workflow's definitions (its types belong in shared/).
import type { PoolInput } from '../../../../workflows/pool/definitions';

export const pool = (p: PoolInput): string => p.model;
