/**
 * `npm run bench:nats-floor`: what each piece of the serving path's NATS design costs on this
 * machine, with nothing of magus around it. A bare `node:http` server (this process) answers
 * each request by one of these paths to a stub engine, and the load client (a child:
 * bench/gateway-client.ts) measures what that adds over calling the stub directly:
 *
 *   proxy                     server → stub over HTTP: one more process, no NATS
 *   core                      server → NATS → bridge → stub; the answer back on core NATS
 *   core, answers stored      the same, the answer captured by a memory stream (MAGUS_RESPONSES)
 *   queue in memory           the request through a JetStream work queue in memory, PubAck awaited
 *   queue on file             the same on file (MAGUS_REQUESTS)
 *   queue on file, stored     both: the data plane's path (ARCHITECTURE.md, "Data plane"),
 *                             bench:gateway's "design floor"
 *
 * Concurrency 1, the paths in alternating blocks with the direct path, after a warm-up at
 * concurrency 8. The bridge (bench/nats-floor-bridge.ts) and stub run in a child; nats-server
 * is the one `magus dev` starts. Environment: BENCH_ROUNDS (default 6) blocks per path,
 * BENCH_BLOCK (default 400) requests per block.
 */
import { createServer, Agent, request } from 'node:http';
import type { AddressInfo } from 'node:net';
import { cpus, loadavg } from 'node:os';
import { connect, nuid } from 'nats';
import { startServices } from '../workers/dev/services';
import { ask, child, latencies, load, p50, p99, signed } from './common';
import type { LoadSpec } from './gateway-client';
import { CAPTURED_PREFIX, CORE_SUBJECT, queueSubject, type FloorCommand, type FloorReply, type FloorRequest, type QueueKind } from './nats-floor-bridge';

interface Path {
  name: string;
  /** Where the request goes: the stub over HTTP, core NATS, or a work queue. */
  via: 'http' | 'core' | QueueKind;
  stored: boolean;
}
const PATHS: Path[] = [
  { name: 'proxy', via: 'http', stored: false },
  { name: 'core', via: 'core', stored: false },
  { name: 'core, answers stored', via: 'core', stored: true },
  { name: 'queue in memory', via: 'memory', stored: false },
  { name: 'queue on file', via: 'file', stored: false },
  { name: 'queue on file, stored', via: 'file', stored: true },
];
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? '6');
const BLOCK = Number(process.env.BENCH_BLOCK ?? '400');

async function main(): Promise<void> {
  const load0 = loadavg();
  const services = await startServices({ services: ['nats'] });
  const natsUrl = services.endpoints.nats!.servers;
  const bridge = child('nats-floor-bridge.ts');
  const client = child('gateway-client.ts');
  const nc = await connect({ servers: natsUrl, name: 'bench-floor-server', noAsyncTraces: true });
  try {
    const { engineUrl } = await ask<Extract<FloorReply, { engineUrl: string }>>(bridge, { type: 'start', nats: natsUrl } satisfies FloorCommand);
    const js = nc.jetstream();
    // One wildcard subscription per answer prefix; answers find their request by the last token.
    const waiting = new Map<string, (answer: string) => void>();
    const inboxes = { core: `_FLOOR.${nuid.next()}`, stored: `${CAPTURED_PREFIX}.${nuid.next()}` };
    for (const inbox of Object.values(inboxes)) {
      const sub = nc.subscribe(`${inbox}.*`);
      void (async () => {
        for await (const m of sub) {
          const id = m.subject.slice(m.subject.lastIndexOf('.') + 1);
          waiting.get(id)?.(m.string());
          waiting.delete(id);
        }
      })();
    }
    const agent = new Agent({ keepAlive: true });
    let path = PATHS[0]!;
    const server = createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on('data', (c: Buffer) => chunks.push(c));
      req.on('end', () => {
        const body = Buffer.concat(chunks).toString('utf8');
        const send = (text: string) => res.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) }).end(text);
        const fail = () => res.writeHead(502).end();
        if (path.via === 'http') {
          const out = request(`${engineUrl}/v1/chat/completions`, { method: 'POST', agent, headers: { 'content-type': 'application/json' } }, (r) => {
            let text = '';
            r.setEncoding('utf8')
              .on('data', (d: string) => (text += d))
              .on('end', () => send(text));
          });
          out.on('error', fail).end(body);
          return;
        }
        const id = nuid.next();
        waiting.set(id, send);
        const payload = JSON.stringify({
          replyTo: `${path.stored ? inboxes.stored : inboxes.core}.${id}`,
          body: JSON.parse(body) as unknown,
        } satisfies FloorRequest);
        if (path.via === 'core') nc.publish(CORE_SUBJECT, payload);
        else js.publish(queueSubject(path.via), payload, { msgID: id }).catch(fail);
      });
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1/chat/completions`;
    const direct = `${engineUrl}/v1/chat/completions`;
    const spec = (target: string, requests: number, concurrency = 1): LoadSpec => ({
      url: target,
      token: 'none',
      model: 'stub',
      concurrency,
      requests,
      stream: false,
      prompt: 'the floor',
      expectText: 'the floor',
      sessionIds: Array.from({ length: concurrency }, (_, i) => `floor-${i}`),
    });

    process.stderr.write('warming up');
    await load(client, spec(direct, 5000, 8));
    for (const p of PATHS) {
      path = p;
      await load(client, spec(url, 5000, 8));
      process.stderr.write('.');
    }
    const added = new Map<Path, { p50: number[]; p99: number[] }>(PATHS.map((p) => [p, { p50: [], p99: [] }]));
    for (let round = 0; round < ROUNDS; round++) {
      for (const p of PATHS) {
        const d = latencies([await load(client, spec(direct, BLOCK))]);
        path = p;
        const g = latencies([await load(client, spec(url, BLOCK))]);
        added.get(p)!.p50.push(p50(g) - p50(d));
        added.get(p)!.p99.push(p99(g) - p99(d));
      }
      process.stderr.write('.');
    }
    process.stderr.write('\n');
    server.close();
    const out = [
      `bench:nats-floor — ${cpus().length} CPUs, load ${load0.map((l) => l.toFixed(2)).join(' ')} → ${loadavg()
        .map((l) => l.toFixed(2))
        .join(' ')}`,
      `added over calling the stub directly at concurrency 1, ms; ${ROUNDS} blocks of ${BLOCK} requests per path, median of the blocks`,
      '',
      `${'path'.padEnd(24)}${'p50'.padStart(8)}${'p99'.padStart(8)}   p50 of each block`,
      ...PATHS.map((p) => {
        const a = added.get(p)!;
        return `${p.name.padEnd(24)}${signed(p50(a.p50)).padStart(8)}${signed(p50(a.p99)).padStart(8)}   ${a.p50.map((x) => signed(x)).join(' ')}`;
      }),
    ];
    console.log(out.join('\n'));
  } finally {
    await ask(bridge, { type: 'stop' } satisfies FloorCommand).catch(() => undefined);
    bridge.kill();
    client.kill();
    await nc.close();
    await services.stop();
  }
}

main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});
