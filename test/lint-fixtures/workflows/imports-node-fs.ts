// Lint fixture: the node: prefix does not get around the boundary.
import { readFile } from 'node:fs/promises';

export async function bad(): Promise<string> {
  return readFile('/etc/hostname', 'utf8');
}
