/** podman as scripts/images runs it (its storage driver and `images/containers.conf`), for the tests that run its images. */
import { execFile } from 'node:child_process';
import { join } from 'node:path';
import { promisify } from 'node:util';

const run = promisify(execFile);
const env = { ...process.env, CONTAINERS_CONF: join(__dirname, '..', '..', 'images', 'containers.conf') };

export const podman = (...args: string[]) => run('podman', ['--storage-driver', 'overlay', ...args], { env, maxBuffer: 16 * 2 ** 20 });
