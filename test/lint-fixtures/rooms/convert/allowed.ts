// Lint fixture: a conversion file importing the rooms below it (shared, platform).
import { WEIGHTS_FORMATS } from '../../../../shared/weights';
import { UsageError } from '../../../../platform/cli';

export const formats = (): string => WEIGHTS_FORMATS.join(', ');
export const usage = (message: string): Error => new UsageError(message);
