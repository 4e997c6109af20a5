/** The pool's status in words, for the Temporal UI. */
import { at } from '../visibility';
import type { PoolInput, PoolPhase, PoolStatus } from './definitions';

/**
 * The pool's state in words, for the Temporal UI's "Current Details" (Markdown). `onLoad`: it
 * scales on requests in flight or queued (state.ts, "Scaling"), not on its leases.
 */
export function poolDetails(input: PoolInput, phase: PoolPhase, s: PoolStatus, onLoad = false): string {
  const live = s.instances.filter((i) => i.phase !== 'stopping' && !i.retiring);
  const leases = s.live ?? s.instances.reduce((n, i) => n + i.leases, 0);
  const sizedBy = input.resource ? `sized by Dllama \`${input.resource.name}\` (generation ${input.resource.generation})` : "sized by the gateway's defaults";
  const lines = [
    `**${phase}** · model \`${input.namespace}/${input.model}\` · ${live.length} of ${input.minInstances}..${input.maxInstances} instances · ${
      onLoad
        ? `scales on load (${plural(input.leasesPerInstance, 'request')} in flight or queued per instance) · ${plural(leases, 'live conversation')}`
        : `${plural(leases, 'lease')} (${input.leasesPerInstance} per instance)`
    } · ${s.waiting} waiting`,
    sizedBy,
  ];
  const retiring = s.instances.filter((i) => i.retiring && i.phase === 'draining');
  if (retiring.length > 0)
    lines.push(
      `**rolling out**: ${plural(retiring.length, 'instance')} being replaced draining, ${plural(
        retiring.reduce((n, i) => n + (i.inFlight ?? 0), 0),
        'answer',
      )} in flight on them`,
    );
  if (s.lastError) lines.push(`last error: ${s.lastError}`);
  if (s.nextStartAt !== undefined && s.startFailures)
    lines.push(`${plural(s.startFailures, 'failed start')} in a row; next start not before ${at(s.nextStartAt)}`);
  const list = s.instances.map(
    (i) =>
      `- \`${i.id}\` ${i.restarting ? `**restarting** (${i.restarting})` : i.phase}${s.live === undefined ? `, ${plural(i.leases, 'lease')}` : ''}${i.inFlight !== undefined ? `, ${i.inFlight} in flight` : ''}${i.revision ? `, revision \`${i.revision}\`` : ''}${i.retiring ? ` — ${i.retiring}` : ''}${restartsText(i)}`,
  );
  return [lines.join('  \n'), ...(list.length > 0 ? [list.join('\n')] : [])].join('\n\n');
}

/** `; restarted 2 times, last: node 1 (worker) killed by SIGKILL` once it restarted in place and serves again. */
const restartsText = (i: PoolStatus['instances'][number]): string =>
  i.restarts && !i.restarting ? `; restarted ${i.restarts === 1 ? 'once' : `${i.restarts} times`}${i.lastRestart ? `, last: ${i.lastRestart}` : ''}` : '';

const plural = (n: number, what: string): string => `${n} ${what}${n === 1 ? '' : 's'}`;
