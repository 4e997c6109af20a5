/**
 * `npm run bench:stream-kills`: does a replicated JetStream stream keep every message it
 * acknowledged while its leaders are SIGKILLed and restarted the way bench:chaos kills them? With
 * nothing of magus around it: a private 3-node cluster (test/harness/nats-cluster.ts), one R3
 * stream, a publisher that sends numbered messages as a bridge sends frames (published again until
 * the stream acknowledges each), and a killer that, every `KILLS_EVERY_S` seconds, SIGKILLs the
 * stream's leader and restarts it 5 s later (waiting for its /healthz), as bench:chaos does.
 * At the end every node is back and healthy, and the stream is read whole: a message acknowledged
 * but not there was lost by the stream.
 *
 * Why: after bench:chaos's leader kills, take-overs found frames of `MAGUS_RESPONSES` (a memory
 * stream) gone whose bridge had been told they were stored (dataplane/README.md, "Resume, do not
 * restart"). A memory replica comes back from a SIGKILL empty; Raft assumes stable storage.
 *
 * Environment: KILLS_STORAGE (`memory`, the default, as `MAGUS_RESPONSES`; or `file`), KILLS
 * (default 12), KILLS_EVERY_S (default 10), KILLS_RATE (messages/s, default 400).
 */
import { randomBytes } from 'node:crypto';
import { connect, RetentionPolicy, StorageType, type JetStreamClient, type NatsConnection } from 'nats';
import { startNatsCluster, type TestNatsCluster } from '../test/harness/nats-cluster';
import { sleep } from '../test/harness/wait';

const STORAGE = process.env.KILLS_STORAGE === 'file' ? StorageType.File : StorageType.Memory;
const KILLS = Number(process.env.KILLS ?? 12);
const EVERY_MS = Number(process.env.KILLS_EVERY_S ?? 10) * 1000;
const RATE = Number(process.env.KILLS_RATE ?? 400);
const DOWN_MS = 5_000;
const STREAM = `KILLS_${randomBytes(3).toString('hex').toUpperCase()}`;

const t0 = Date.now();
const log = (line: string) => console.log(`${((Date.now() - t0) / 1000).toFixed(1).padStart(6)} s  ${line}`);

/** Publishes message `i` until the stream acknowledges it; resolves with when it was acknowledged. */
async function publishUntilStored(js: JetStreamClient, i: number, stop: () => boolean): Promise<number | undefined> {
  const data = new TextEncoder().encode(JSON.stringify({ i, pad: 'x'.repeat(120) }));
  while (!stop()) {
    try {
      await js.publish(`kills.${i}`, data, { timeout: 1_000 });
      return Date.now();
    } catch {
      await sleep(100); // no leader yet, or its server went away: again, as a bridge publishes a frame again
    }
  }
  return undefined;
}

async function readAll(nc: NatsConnection): Promise<Map<number, number>> {
  const js = nc.jetstream();
  const consumer = await js.consumers.get(STREAM, { filterSubjects: 'kills.>' });
  const stored = new Map<number, number>(); // i → stream seq
  const info = await (await nc.jetstreamManager()).streams.info(STREAM);
  if (info.state.messages === 0) return stored;
  const messages = await consumer.consume({ max_messages: 1_000 });
  for await (const m of messages) {
    const { i } = JSON.parse(new TextDecoder().decode(m.data)) as { i: number };
    if (!stored.has(i)) stored.set(i, m.seq);
    if (m.seq >= info.state.last_seq) break;
  }
  await messages.close();
  return stored;
}

async function main(): Promise<void> {
  log(`bench:stream-kills: ${STORAGE} storage, R3, ${KILLS} leader kills every ${EVERY_MS / 1000} s (each back after ${DOWN_MS / 1000} s), ${RATE} messages/s`);
  const cluster: TestNatsCluster = await startNatsCluster({ syncInterval: '2m' });
  const nc = await connect({ servers: cluster.servers, name: 'stream-kills', maxReconnectAttempts: -1, reconnectTimeWait: 250 });
  try {
    const jsm = await nc.jetstreamManager();
    for (let tries = 0; ; tries++) {
      try {
        await jsm.streams.add({ name: STREAM, subjects: ['kills.>'], storage: STORAGE, num_replicas: 3, retention: RetentionPolicy.Limits });
        break;
      } catch (err) {
        if (tries > 60) throw err;
        await sleep(500); // a cluster just started may not have every peer in its meta group yet
      }
    }
    const js = nc.jetstream();
    let stopping = false;
    const acked = new Map<number, number>(); // i → when acknowledged
    const inFlight = new Set<Promise<void>>();
    let next = 0;
    const publisher = (async () => {
      const start = Date.now();
      while (!stopping) {
        const due = Math.floor(((Date.now() - start) / 1000) * RATE);
        while (next < due && inFlight.size < 2_000) {
          const i = next++;
          const p = publishUntilStored(js, i, () => stopping).then((at) => {
            if (at !== undefined) acked.set(i, at);
            inFlight.delete(p);
          });
          inFlight.add(p);
        }
        await sleep(10);
      }
    })();
    const kills: { at: number; node: string }[] = [];
    for (let k = 0; k < KILLS; k++) {
      await sleep(EVERY_MS - DOWN_MS);
      const leader = (await jsm.streams.info(STREAM).catch(() => undefined))?.cluster?.leader;
      if (!leader) {
        log('no leader to kill: skipped');
        continue;
      }
      await cluster.kill(leader);
      kills.push({ at: Date.now(), node: leader });
      log(`kill ${k + 1}: leader ${leader} SIGKILLed (${acked.size} acknowledged so far)`);
      await sleep(DOWN_MS);
      await cluster.restart(leader);
      log(`  ${leader} back and healthy`);
    }
    await sleep(3_000);
    stopping = true;
    await publisher;
    await Promise.all(inFlight);
    log(`publishing stopped: ${acked.size} of ${next} acknowledged`);
    // Every node up; give the stream a leader and its replicas time to be current.
    for (let tries = 0; tries < 60; tries++) {
      const info = await jsm.streams.info(STREAM).catch(() => undefined);
      if (info?.cluster?.leader && (info.cluster.replicas ?? []).every((r) => r.current)) break;
      await sleep(500);
    }
    log('reading the stream back');
    const stored = await readAll(nc);
    const lost = [...acked.keys()].filter((i) => !stored.has(i)).sort((a, b) => a - b);
    const ranges: string[] = [];
    for (let j = 0; j < lost.length;) {
      let e = j;
      while (e + 1 < lost.length && lost[e + 1] === lost[e]! + 1) e++;
      const at = acked.get(lost[j]!)!;
      const after = kills.filter((x) => x.at <= at + DOWN_MS * 2).at(-1);
      ranges.push(
        `${lost[j]}${e > j ? `–${lost[e]}` : ''} (${e - j + 1}, acknowledged ${((at - t0) / 1000).toFixed(1)} s${after ? `, near kill of ${after.node} at ${((after.at - t0) / 1000).toFixed(1)} s` : ''})`,
      );
      j = e + 1;
    }
    log(
      `${acked.size} acknowledged, ${stored.size} distinct stored, ${lost.length} acknowledged but lost${lost.length ? `: ${ranges.slice(0, 20).join('; ')}` : ''}`,
    );
    console.log(`stream-kills: ${STORAGE}, ${kills.length} leader kills, ${acked.size} acknowledged, ${lost.length} lost`);
  } finally {
    await nc.close().catch(() => undefined);
    await cluster.stop();
  }
}

main().then(
  () => process.exit(0),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);
