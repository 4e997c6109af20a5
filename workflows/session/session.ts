/**
 * `session`: one per conversation, under the entry-lease protocol (ARCHITECTURE.md, "Data plane",
 * "The entry-lease protocol"). The conversation's lease is its `magus_sessions` entry, which the
 * gateway created before starting this workflow and renews and moves itself; the session enforces
 * its expiry and nothing else, so the Temporal UI lists every conversation (its kind, model and
 * phase come as search attributes in the gateway's start request: no upsert) and no turn costs a
 * workflow event.
 *
 * The gateway starts it delayed to the entry's expiry (definitions.ts `sessionStart`), so its first
 * task is a look (`expireSession`, a local activity); one started without a delay sleeps until then
 * first. Renewed, it sleeps again; expired, the entry is deleted with compare-and-swap (a renewal
 * landing first wins) and the session ends; gone (moved away or removed by someone else), it ends.
 * It never signals the pool and takes no signal, update or query. A conversation that lives one
 * TTL costs one workflow task and 7 history events, each further TTL 6
 * (`test/serving-entries.int.test.ts` counts them).
 */
import { continueAsNew, proxyLocalActivities, setCurrentDetails, sleep, upsertSearchAttributes, workflowInfo } from '@temporalio/workflow';
import type { ServingActivities } from '../../activities/serving';
import { at } from '../visibility';
import type { SessionInput, SessionPhase } from './definitions';

const { expireSession } = proxyLocalActivities<ServingActivities>({ startToCloseTimeout: '30s', retry: { initialInterval: '1s', maximumInterval: '10s' } });

export async function session(input: SessionInput): Promise<void> {
  const model = `${input.namespace}/${input.model}`;
  let expiresAt = input.entry.expiresAt;
  const show = (what: SessionPhase) =>
    setCurrentDetails(
      `**${what}** · a conversation on model \`${model}\`  \n${what === 'ended' ? '' : `looks at its lease at ${at(expiresAt)} (TTL ${Math.round(input.ttlMs / 1000)} s after the last renewal)`}`,
    );
  show('serving');
  for (;;) {
    const wait = expiresAt - Date.now();
    if (wait > 0) await sleep(wait);
    const r = await expireSession({ key: input.key });
    if ('ended' in r) break;
    expiresAt = r.expiresAt;
    show('serving');
    // A conversation alive for thousands of TTLs: a new run (6 events per TTL).
    if (workflowInfo().continueAsNewSuggested) await continueAsNew<typeof session>({ ...input, entry: { expiresAt } });
  }
  upsertSearchAttributes({ MagusPhase: ['ended'] });
  show('ended');
}
