// Lint fixture: product code importing a test helper.
import { isolation } from '../../../../test/harness';

export const iso = isolation;
