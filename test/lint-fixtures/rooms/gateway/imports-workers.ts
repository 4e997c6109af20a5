// Lint fixture: a gateway file reaching up into workers/ (an entry point's configuration).
import { loadConfig } from '../../../../workers/config';

export const address = (): string => loadConfig().temporal.address;
