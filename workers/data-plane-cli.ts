/**
 * What the CLI modes that work on one bucket of the data plane share (`magus keys`, `magus
 * usage`): where NATS is (`MAGUS_NATS_URL` and `MAGUS_NATS_PREFIX`, else the running `magus
 * dev`), the bucket bound, and one clear line and exit 1 when either is not there; and their
 * tables.
 */
import { natsConnectAuth } from '../dataplane/roles';
import { connect, type KV, type NatsConnection } from 'nats';
import { dataPlaneNames, JsApiError, jsErrorCode, type DataPlaneNames } from '../dataplane';
import { natsServerList } from '../platform/config';
import { loadConfig, useDevConnection } from './config';

/**
 * Runs `work` on the bucket `bucketOf` names, as `tool` (`magus keys`): its exit code, or 1 with
 * a line naming the address when NATS cannot be reached, or the bucket and `whenMissing` (what
 * declares it) when it is not there.
 */
export async function onDataPlaneBucket(
  tool: string,
  bucketOf: (names: DataPlaneNames) => string,
  whenMissing: string,
  work: (kv: KV, at: { nc: NatsConnection; names: DataPlaneNames }) => Promise<number>,
): Promise<number> {
  // magus keys and magus usage: the controller's rights (keys, the ledger) are theirs.
  const dev = useDevConnection(process.env, 'controller');
  const cfg = loadConfig();
  let nc: NatsConnection;
  try {
    nc = await connect({
      servers: natsServerList(cfg.nats.servers),
      name: tool.replace(/ /g, '-'),
      reconnect: false,
      timeout: 5000,
      ...natsConnectAuth(cfg.nats.credentials, natsServerList(cfg.nats.servers), () => undefined),
    });
  } catch (err) {
    const where = dev?.taken.includes('MAGUS_NATS_URL')
      ? `the running magus dev's NATS (${cfg.nats.servers})`
      : `NATS at ${cfg.nats.servers}${process.env.MAGUS_NATS_URL ? '' : ' (the default: MAGUS_NATS_URL is unset and no magus dev runs)'}`;
    process.stderr.write(`${tool}: cannot reach ${where}: ${(err as Error).message}\n`);
    return 1;
  }
  try {
    const names = dataPlaneNames(cfg.natsPrefix);
    const bucket = bucketOf(names);
    let kv: KV;
    try {
      kv = await nc.jetstream().views.kv(bucket, { bindOnly: true });
      await kv.status(); // binding does not look for the bucket: this fails when it is missing
    } catch (err) {
      if (jsErrorCode(err) !== JsApiError.streamNotFound) throw err;
      process.stderr.write(`${tool}: NATS at ${cfg.nats.servers} has no ${bucket} bucket: ${whenMissing}\n`);
      return 1;
    }
    return await work(kv, { nc, names });
  } finally {
    await nc.close();
  }
}

/** Lines of cells, each column as wide as its widest cell: `right` ones (numbers) aligned right; no trailing blanks. */
export function alignedLines(lines: readonly (readonly string[])[], right: ReadonlySet<number>): string {
  const widths = lines[0]!.map((_, i) => Math.max(...lines.map((l) => l[i]!.length)));
  const line = (l: readonly string[]) =>
    l
      .map((c, i) => (right.has(i) ? c.padStart(widths[i]!) : c.padEnd(widths[i]!)))
      .join('  ')
      .trimEnd();
  return `${lines.map(line).join('\n')}\n`;
}
