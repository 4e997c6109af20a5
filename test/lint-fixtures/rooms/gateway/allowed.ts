// Lint fixture: a gateway file importing rooms below it (dataplane, shared).
import { dataPlaneNames } from '../../../../dataplane';
import { TaskQueue } from '../../../../shared/constants';

export const names = (): string => `${dataPlaneNames('x').requestStream} ${TaskQueue.control}`;
