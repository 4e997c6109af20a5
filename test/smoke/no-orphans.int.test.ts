/**
 * Killing whatever started the servers — `magus dev`, or jest itself — with SIGKILL leaves no
 * server behind: each one runs under `setpriv --pdeathsig KILL`.
 */
import { spawn } from 'node:child_process';
import { existsSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { processRunning, sleep } from '../harness/wait';

test('SIGKILL of the process that started the servers stops every server', async () => {
  const bin = join(__dirname, '..', '..', 'bin', 'magus.js');
  const child = spawn(process.execPath, [bin, 'dev', '--services', 'nats,s3', '--json'], { stdio: ['ignore', 'pipe', 'inherit'] });
  const ready = await new Promise<{ pids: number[]; dataDir: string }>((resolve, reject) => {
    const lines = createInterface({ input: child.stdout });
    lines.once('line', (l) => resolve(JSON.parse(l) as { pids: number[]; dataDir: string }));
    child.once('exit', (code) => reject(new Error(`magus dev exited early with ${code}`)));
  });
  expect(ready.pids).toHaveLength(2);
  for (const pid of ready.pids) expect(processRunning(pid)).toBe(true);

  child.kill('SIGKILL');
  const deadline = Date.now() + 15_000;
  while (ready.pids.some(processRunning) && Date.now() < deadline) await sleep(100);
  expect(ready.pids.filter(processRunning)).toEqual([]);
  // The orphaned data folder is swept by the next start (its owner pid is dead).
  expect(existsSync(ready.dataDir)).toBe(true);
  rmSync(ready.dataDir, { recursive: true, force: true });
}, 60_000);
