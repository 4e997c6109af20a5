// Lint fixture: platform/ (below convert) reaching up into the conversion room.
import { convertModel } from '../../../../convert';

export const convert = convertModel;
