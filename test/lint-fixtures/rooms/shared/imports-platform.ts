// Lint fixture: shared/ (workflow-safe, imports nothing) reaching into platform/.
import { processMetricsText } from '../../../../platform/process-metrics';

export const text = processMetricsText;
