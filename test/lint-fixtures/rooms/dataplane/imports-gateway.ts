// Lint fixture: the data plane reaching up into the gateway.
import { errors } from '../../../../gateway/plugins/errors';

export const e = errors;
