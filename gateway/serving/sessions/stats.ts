/** The session broker's counters for /metrics: each collaborator counts what it does here. */
import type { SessionStats } from './types';

export class SessionCounters {
  warmHits = 0;
  coldStarts = 0;
  firstTurns = 0;
  moves = 0;
  renewals = 0;
  givenBack = 0;
  staleViewPicks = 0;
  refusedForPendingStarts = 0;
  queueMoves = 0;
  refusedForQueueWait = 0;
  orphansAdopted = 0;
  orphansSwept = 0;

  /** The counters with the one gauge kept elsewhere (sessions waiting to start: starts.ts). */
  snapshot(pendingSessionStarts: number): SessionStats {
    return { ...this, pendingSessionStarts };
  }
}
