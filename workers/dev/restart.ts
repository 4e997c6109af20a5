/**
 * What a restart of `magus dev` clears before anything serves: the running workflows of a magus
 * whose histories this one does not replay, and the pools and sessions of the previous run's
 * engines (which died with it).
 */
import { natsConnectAuth } from '../../dataplane/roles';
import { existsSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { CustomObjectsApi, type KubeConfig } from '@kubernetes/client-node';
import { Client, Connection } from '@temporalio/client';
import { connect } from 'nats';
import { dataPlaneNames } from '../../dataplane';
import { natsServerList } from '../../platform/config';
import { CRD_GROUP, CRD_VERSION, WORKFLOWS_REPLAY_FROM } from '../../shared/constants';
import { Plural } from '../../shared/kube';
import type { loadConfig } from '../config';

const say = (line: string) => process.stderr.write(`magus dev: ${line}\n`);

/** The file in dev's state folder that says which workflow code wrote its histories. */
const REPLAY_STAMP = 'workflows-replay-from';

/**
 * A state folder written by a magus whose workflow histories this code does not replay (before
 * the {@link WORKFLOWS_REPLAY_FROM} baseline, or stamped with another): its running executions
 * would fail every workflow task with a nondeterminism error. They are terminated before any
 * worker starts (their histories stay for the UI); the models' files in S3 and the registry stay,
 * so the pipeline dev starts again finds its work done. Then the state is stamped.
 */
export async function retireUnreplayable(cfg: ReturnType<typeof loadConfig>, dataDir: string): Promise<void> {
  const stamp = join(dataDir, REPLAY_STAMP);
  const was = existsSync(stamp) ? readFileSync(stamp, 'utf8').trim() : undefined;
  if (was === WORKFLOWS_REPLAY_FROM) return;
  const connection = await Connection.connect({ address: cfg.temporal.address });
  let terminated = 0;
  try {
    const client = new Client({ connection, namespace: cfg.temporal.namespace });
    for await (const w of client.workflow.list({ query: `ExecutionStatus = 'Running'` })) {
      await client.workflow
        .getHandle(w.workflowId, w.runId)
        .terminate(
          `written by a magus whose workflows this one does not replay (state ${was ? `from ${was}` : 'from before the first release'}; this code replays from ${WORKFLOWS_REPLAY_FROM})`,
        )
        .then(() => terminated++)
        .catch(() => undefined); // ended meanwhile
    }
  } finally {
    await connection.close();
  }
  if (terminated > 0) say(`${terminated} workflow(s) of an older magus ended: their histories do not replay on this version (models and their files stay)`);
  writeFileSync(`${stamp}.tmp`, `${WORKFLOWS_REPLAY_FROM}\n`);
  renameSync(`${stamp}.tmp`, stamp);
}

/** Workflow types that hold engines of this machine's local runtime (workflows/index.ts). */
const SERVING_WORKFLOWS = ['dllamaPool', 'session'] as const;

/**
 * An earlier run's engines died with it, but its pools and sessions still lease them, and
 * `magus_pools` / `magus_sessions` still route conversations to them: a turn sent there would
 * wait for the gateway's deadline until each pool noticed (its next health check). So before
 * anything serves, those workflows are terminated (their histories stay; the next conversation
 * starts them again, as on a first run) and the two buckets emptied. The models, their
 * pipelines and the registry stay. Not while `Dllama` resources exist (see below).
 */
export async function forgetEngines(cfg: ReturnType<typeof loadConfig>, kc: KubeConfig | undefined): Promise<void> {
  // A pool a `Dllama` sizes is started again only on a new generation of it: those pools stay,
  // and find their engines gone at their next health check.
  if (kc) {
    const dllamas = (await kc.makeApiClient(CustomObjectsApi).listClusterCustomObject({ group: CRD_GROUP, version: CRD_VERSION, plural: Plural.dllama })) as {
      items?: unknown[];
    };
    const count = (dllamas.items ?? []).length;
    if (count > 0) {
      say(`${count} Dllama resource(s): their pools stay, and notice at their next health check that the engines of the previous run are gone`);
      return;
    }
  }
  const connection = await Connection.connect({ address: cfg.temporal.address });
  let terminated = 0;
  try {
    const client = new Client({ connection, namespace: cfg.temporal.namespace });
    const query = `ExecutionStatus = 'Running' AND (${SERVING_WORKFLOWS.map((t) => `WorkflowType = '${t}'`).join(' OR ')})`;
    for await (const w of client.workflow.list({ query })) {
      await client.workflow
        .getHandle(w.workflowId, w.runId)
        .terminate('magus dev restarted: the engines of its previous run are gone')
        .then(() => terminated++)
        .catch(() => undefined); // ended meanwhile
    }
  } finally {
    await connection.close();
  }
  const nc = await connect({
    servers: natsServerList(cfg.nats.servers),
    name: 'magus-dev-restart',
    ...natsConnectAuth(cfg.nats.credentials, [], () => undefined),
  });
  let purged = 0;
  try {
    const jsm = await nc.jetstreamManager();
    const names = dataPlaneNames(cfg.natsPrefix);
    for (const bucket of [names.poolsBucket, names.sessionsBucket]) {
      // A KV bucket is the stream KV_<bucket>; none on a first run.
      purged += await jsm.streams.purge(`KV_${bucket}`).then(
        (r) => r.purged,
        () => 0,
      );
    }
  } finally {
    await nc.close();
  }
  if (terminated + purged > 0)
    say(
      `the engines of the previous run are gone: ${terminated} pool and session workflow(s) of theirs ended, ${purged} routing entr${purged === 1 ? 'y' : 'ies'} removed`,
    );
}
