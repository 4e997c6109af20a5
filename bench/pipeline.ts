/**
 * `npm run bench:pipeline`: the model pipeline moving a ~1 GB checkpoint (4 safetensors shards)
 * from the fixture hub into S3 (MinIO), against a plain baseline in the same run: one streamed
 * copy of the same files from the fixture hub to a local file. Reports MB/s and CPU seconds (this
 * process — workers and hub — plus the servers), and the orchestration overhead: the part of the
 * workflow's wall time during which no activity was running.
 *
 * BENCH_DIR (default ~/.cache/magus/bench) keeps the generated model between runs.
 */
import { CreateBucketCommand, S3Client } from '@aws-sdk/client-s3';
import { Client, Connection } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import { DefaultLogger, Runtime } from '@temporalio/worker';
import { createWriteStream, existsSync, mkdirSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { resolveUrl, startDemoHub } from '../workers/dev/hub';
import { writeTinyModel, type TinyModelOptions } from '../workers/dev/tiny-model';
import { cpuOf } from './common';
import { startServices } from '../workers/dev/services';
import { startWorkers } from '../workers/worker';
import { modelWorkflowId, progressQuery } from '../workflows/model/definitions';
import { modelPipeline } from '../workflows/model/pipeline';

const MODEL: TinyModelOptions = {
  seed: 7,
  dtype: 'F16',
  shards: 4,
  hiddenSize: 2048,
  intermediateSize: 5632,
  numLayers: 8,
  numHeads: 16,
  numKvHeads: 4,
  vocabSize: 32000,
};
const REPO = 'bench/llama-1g';
const EventType = temporal.api.enums.v1.EventType;

const selfCpu = () => {
  const u = process.cpuUsage();
  return (u.user + u.system) / 1e6;
};
const ms = (t?: { seconds?: unknown; nanos?: number | null } | null) => Number(t?.seconds ?? 0) * 1000 + (t?.nanos ?? 0) / 1e6;

async function main(): Promise<void> {
  Runtime.install({ logger: new DefaultLogger('WARN') });
  const root = process.env.BENCH_DIR ?? join(homedir(), '.cache', 'magus', 'bench');
  const modelDir = join(root, 'llama-1g-4shards');
  if (!existsSync(join(modelDir, '.complete'))) {
    rmSync(modelDir, { recursive: true, force: true });
    mkdirSync(modelDir, { recursive: true });
    await writeTinyModel(modelDir, MODEL);
    writeFileSync(join(modelDir, '.complete'), '');
  }
  const files = readdirSync(modelDir).filter((f) => !f.startsWith('.'));
  const bytes = files.reduce((n, f) => n + statSync(join(modelDir, f)).size, 0);

  const services = await startServices({ services: ['temporal', 'nats', 's3'] });
  const hub = await startDemoHub();
  const commit = await hub.addRepo({ id: REPO, dir: modelDir });
  const e = services.endpoints;
  try {
    const serverCpu = () => services.pids.reduce((n, pid) => n + cpuOf(pid), 0);

    // Baseline: each file streamed from the fixture hub into a local file, one after another.
    const out = join(root, 'baseline');
    mkdirSync(out, { recursive: true });
    let cpu0 = selfCpu();
    let t0 = performance.now();
    for (const f of commit.files) {
      const res = await fetch(resolveUrl(hub.url, REPO, commit.sha, f.path));
      await pipeline(Readable.fromWeb(res.body as never), createWriteStream(join(out, f.path.replace(/\//g, '_'))));
    }
    const baseSec = (performance.now() - t0) / 1000;
    const baseCpu = selfCpu() - cpu0;
    rmSync(out, { recursive: true, force: true });

    // The pipeline: hub → S3 through the workflow, with an in-process worker.
    process.env.AWS_ACCESS_KEY_ID = e.s3!.accessKeyId;
    process.env.AWS_SECRET_ACCESS_KEY = e.s3!.secretAccessKey;
    const s3 = new S3Client({ endpoint: e.s3!.endpoint, region: e.s3!.region, forcePathStyle: true });
    await s3.send(new CreateBucketCommand({ Bucket: 'bench' }));
    const workers = await startWorkers({
      temporal: { address: e.temporal!.address, namespace: 'default' },
      taskQueue: 'bench-control',
      nats: { servers: e.nats!.servers },
      s3: { endpoint: e.s3!.endpoint, region: e.s3!.region, bucket: 'bench', forcePathStyle: true },
      natsPrefix: 'BENCH',
      modelCacheDir: join(root, 'models'),
      convertThreads: 2,
      transferPartSize: undefined,
      s3TraceFile: undefined,
      // The bench's hub and its CDN, on loopback.
      hubAllowNetworks: [new URL(hub.url).hostname, new URL(hub.cdnUrl).hostname],
    });
    const connection = await Connection.connect({ address: e.temporal!.address });
    const client = new Client({ connection });
    cpu0 = selfCpu();
    const srv0 = serverCpu();
    t0 = performance.now();
    const handle = await client.workflow.start(modelPipeline, {
      workflowId: modelWorkflowId('default', 'bench'),
      taskQueue: 'bench-control',
      args: [{ namespace: 'default', name: 'bench', spec: { source: { repo: REPO, hubUrl: hub.url }, artifacts: [{ format: 'gguf', weights: 'q40' }] } }],
    });
    for (;;) {
      const p = await handle.query(progressQuery);
      if (p.phase === 'ready' || p.phase === 'failed') {
        if (p.phase === 'failed') throw new Error(`pipeline failed: ${JSON.stringify(p.failure)}`);
        break;
      }
      await new Promise((r) => setTimeout(r, 100));
    }
    const totalSec = (performance.now() - t0) / 1000;
    const cpu = selfCpu() - cpu0;
    const srvCpu = serverCpu() - srv0;

    // From the history: transfer window, and wall time with no activity running.
    const events = (await handle.fetchHistory()).events ?? [];
    const scheduled = new Map<string, string>();
    const started = new Map<string, number>();
    const intervals: { type: string; start: number; end: number }[] = [];
    for (const ev of events) {
      const at = ms(ev.eventTime);
      if (ev.eventType === EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
        scheduled.set(String(ev.eventId), ev.activityTaskScheduledEventAttributes?.activityType?.name ?? '');
      if (ev.eventType === EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED) started.set(String(ev.activityTaskStartedEventAttributes?.scheduledEventId), at);
      if (ev.eventType === EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED) {
        const id = String(ev.activityTaskCompletedEventAttributes?.scheduledEventId);
        intervals.push({ type: scheduled.get(id) ?? '', start: started.get(id) ?? at, end: at });
      }
    }
    const wfStart = ms(events[0]?.eventTime);
    const wfReady = Math.max(...intervals.map((i) => i.end));
    const busy = [...intervals]
      .sort((a, b) => a.start - b.start)
      .reduce<{ end: number; sum: number }>((acc, i) => (i.end <= acc.end ? acc : { end: i.end, sum: acc.sum + i.end - Math.max(i.start, acc.end) }), {
        end: 0,
        sum: 0,
      }).sum;
    const transfers = intervals.filter((i) => i.type === 'transferFile');
    const transferSec = (Math.max(...transfers.map((i) => i.end)) - Math.min(...transfers.map((i) => i.start))) / 1000;
    const convert = intervals.find((i) => i.type === 'convertArtifact');

    const mb = bytes / 1e6;
    console.log(`model: ${mb.toFixed(0)} MB in ${files.length} files (${commit.files.filter((f) => f.path.endsWith('.safetensors')).length} shards)`);
    console.log(
      `baseline  fixture hub → local file (streamed, sequential): ${(mb / baseSec).toFixed(0)} MB/s, ${baseSec.toFixed(2)} s, ${baseCpu.toFixed(2)} CPU s`,
    );
    console.log(
      `pipeline  fixture hub → S3 (transfer phase, 4 files at a time): ${(mb / transferSec).toFixed(0)} MB/s, ${transferSec.toFixed(2)} s = ${((baseSec / transferSec) * 100).toFixed(0)}% of the baseline's throughput`,
    );
    console.log(
      `          whole pipeline incl. GGUF Q4_0 conversion (${((convert!.end - convert!.start) / 1000).toFixed(2)} s): ${totalSec.toFixed(2)} s; CPU ${cpu.toFixed(2)} s in this process + ${srvCpu.toFixed(2)} s in the servers`,
    );
    console.log(`orchestration overhead (workflow start → ready with no activity running): ${(wfReady - wfStart - busy).toFixed(0)} ms`);
    await workers.shutdown();
    await connection.close();
    s3.destroy();
  } finally {
    await hub.stop();
    await services.stop();
  }
}

main().then(
  () => process.exit(0),
  (err) => {
    console.error(err);
    process.exit(1);
  },
);
