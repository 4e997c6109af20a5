// Lint fixture: workflow code reading a file must be rejected.
import { readFileSync } from 'fs';

export function bad(): string {
  return readFileSync('/etc/hostname', 'utf8');
}
