/** Sizes as people read them, the same on a terminal (`magus model pull`) and in the Temporal UI. */
const UNITS = ['B', 'KB', 'MB', 'GB', 'TB'];

/** `1536` → `1.5 KB` (decimal units, one decimal place above bytes). */
export function formatBytes(n: number): string {
  let i = 0;
  while (n >= 1000 && i < UNITS.length - 1) {
    n /= 1000;
    i++;
  }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${UNITS[i]}`;
}
