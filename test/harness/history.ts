/**
 * A workflow history as searchable text: the JSON with every payload's `data` decoded from
 * base64, so a scan for a secret sees inputs, results, heartbeats and signals as they were sent.
 */
export function historyText(history: unknown): string {
  const decode = (v: unknown): unknown => {
    if (Array.isArray(v)) return v.map(decode);
    if (v && typeof v === 'object') {
      const o = v as Record<string, unknown>;
      const out: Record<string, unknown> = {};
      for (const [k, val] of Object.entries(o)) {
        out[k] = k === 'data' && typeof val === 'string' && 'metadata' in o ? Buffer.from(val, 'base64').toString('utf8') : decode(val);
      }
      return out;
    }
    return v;
  };
  return JSON.stringify(decode(JSON.parse(JSON.stringify(history))));
}
