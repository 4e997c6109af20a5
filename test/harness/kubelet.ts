/**
 * A real Kubernetes node on this machine for one test file: Debian's containerd (a private
 * instance: its own root, state, socket and configuration in a temporary folder) and the real
 * kubelet (scripts/dev-services `kubelet`, the cluster's version) registered with a test cluster's
 * kube-apiserver (harness/cluster.ts). Unlike kwok's Nodes, its pods run: their images (imported
 * from podman's store, where scripts/images builds them), init containers, probes, preStop hooks,
 * SIGTERM and the termination grace are the kubelet's own.
 *
 * Pods get addresses on a bridge of the node's own (CNI `bridge` + `host-local`) whose gateway is
 * on this machine: a test's loopback servers are reached from pods through TCP proxies listening
 * on `gateway` (harness/tcp-proxy.ts). Two things this machine needs that a node would not: the
 * pod sandbox image is a 760-KB `pause` built here (gcc, buildah: no registry is reachable), and
 * runc is called through a wrapper that raises a negative `oomScoreAdj` to 0 — root here lacks
 * CAP_SYS_RESOURCE, so the kubelet's -998 for a sandbox fails every pod ("can't get final child's
 * PID from pipe"). Needs root, cgroups and `scripts/node-runtime`'s packages; npm test installs them.
 */
import { CoreV1Api, type KubeConfig } from '@kubernetes/client-node';
import { execFile } from 'node:child_process';
import { chmodSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { writeAdminKubeconfig } from '../../workers/dev/cluster';
import { alive, end, freePort, launch, resolveBinaries, type Proc } from '../../workers/dev/services';
import { podman } from './podman';
import { sleep, until } from './wait';

const run = promisify(execFile);
const PAUSE_IMAGE = 'localhost/magus-pause:1';
const CNI_BIN = '/usr/lib/cni';

export interface KubeletNode {
  /** The Node's name (its `kubernetes.io/hostname` label). */
  name: string;
  /** The pods' gateway on this machine: where a proxy to a loopback server listens for them. */
  gateway: string;
  /** The folder of the pods' container logs (`<namespace>_<pod>_<uid>/<container>/0.log`) while they exist. */
  podLogs: string;
  /** The kubelet's log so far. */
  log(): string;
  /** Stops the kubelet, removes every container it started, stops containerd, removes the bridge and the folder. */
  stop(): Promise<void>;
}

/** The sandbox image: a static `pause` that waits for a signal and reaps orphans. */
const PAUSE_C = `#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction q = {.sa_handler = quit}, r = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGINT, &q, 0); sigaction(SIGTERM, &q, 0); sigaction(SIGCHLD, &r, 0);
  for (;;) pause();
}
`;

const RUNC_WRAPPER = `#!/bin/sh
# root here lacks CAP_SYS_RESOURCE: a negative oom_score_adj cannot be set (runc would fail).
prev=""
for a in "$@"; do
  if [ "$prev" = "--bundle" ] || [ "$prev" = "-b" ]; then sed -i -E 's/"oomScoreAdj":-[0-9]+/"oomScoreAdj":0/' "$a/config.json"; fi
  prev="$a"
done
exec runc "$@"
`;

/** The network namespaces containerd's CRI has made for pod sandboxes (podman's are `netns-…`). */
function netnsOfPods(): string[] {
  try {
    return readdirSync('/var/run/netns').filter((n) => n.startsWith('cni-'));
  } catch {
    return [];
  }
}

/** Unmounts whatever is mounted under `dir` (a kubelet's volumes, containerd's snapshots), deepest first. */
async function unmountUnder(dir: string): Promise<void> {
  const mounts = readFileSync('/proc/self/mounts', 'utf8')
    .split('\n')
    .map((l) => l.split(' ')[1]?.replace(/\\040/g, ' '))
    .filter((m): m is string => m !== undefined && m.startsWith(`${dir}/`))
    .sort((a, b) => b.length - a.length);
  for (const m of mounts) await run('umount', ['-l', m]).catch(() => undefined);
}

/**
 * The pids of a running container's processes on this machine: those whose cgroup names its id
 * (`containerd://<id>`, a pod's `status.containerStatuses[].containerID`).
 */
export function containerProcesses(containerId: string): number[] {
  const id = containerId.replace(/^[a-z]+:\/\//, '');
  return readdirSync('/proc')
    .filter((p) => /^\d+$/.test(p))
    .filter((p) => {
      try {
        return readFileSync(`/proc/${p}/cgroup`, 'utf8').includes(id);
      } catch {
        return false; // gone meanwhile
      }
    })
    .map(Number);
}

/**
 * Starts a node named `name` for the cluster at `server` (its admin `token`; harness/cluster.ts)
 * with `images` (in podman's store) imported, and resolves once the Node is Ready.
 */
export async function startKubeletNode(opts: { kubeConfig: KubeConfig; server: string; token: string; images: string[]; name?: string }): Promise<KubeletNode> {
  const name = opts.name ?? `magus-node-${process.pid}`;
  const dir = mkdtempSync(join(tmpdir(), 'magus-node-'));
  // A /24 and a bridge of this run's own (a bridge's name is at most 15 characters).
  const net = 100 + (process.pid % 150);
  const gateway = `10.244.${net}.1`;
  const bridge = `mgsk${process.pid % 100000}`;
  const procs: Proc<string>[] = [];
  const containerdSock = join(dir, 'containerd.sock');
  const ctr = (...args: string[]) => run('ctr', ['--address', containerdSock, '-n', 'k8s.io', ...args], { maxBuffer: 16 * 2 ** 20 });
  const podLogs = join(dir, 'pod-logs');
  const kubeletLog = join(dir, 'kubelet.log');

  // The network namespaces containerd makes for pod sandboxes (`cni-…`) that exist already: not this node's.
  const netnsBefore = new Set(netnsOfPods());
  const stop = async () => {
    const [containerd, kubelet] = procs;
    if (kubelet) await end(kubelet, 10_000);
    if (containerd && alive(containerd)) {
      const tasks = await ctr('tasks', 'ls', '-q').then(
        (r) => r.stdout.split('\n').filter(Boolean),
        () => [],
      );
      for (const t of tasks) await ctr('tasks', 'kill', '-s', 'KILL', t).catch(() => undefined);
      await sleep(500);
      for (const t of tasks) await ctr('tasks', 'delete', '-f', t).catch(() => undefined);
      await end(containerd, 10_000);
    }
    // Sandboxes killed without the kubelet leave their network namespaces (no CNI DEL): removed here.
    for (const ns of netnsOfPods()) if (!netnsBefore.has(ns)) await run('ip', ['netns', 'delete', ns]).catch(() => undefined);
    await run('ip', ['link', 'del', bridge]).catch(() => undefined);
    await unmountUnder(dir);
    rmSync(dir, { recursive: true, force: true });
  };

  try {
    const { kubelet: kubeletBin } = await resolveBinaries(['kubelet']);
    if (!kubeletBin) throw new Error('scripts/dev-services did not resolve kubelet');

    // The bridge first, with its gateway: proxies can listen there before any pod exists (one of
    // the same name left by a run that was killed goes first).
    await run('ip', ['link', 'del', bridge]).catch(() => undefined);
    await run('ip', ['link', 'add', bridge, 'type', 'bridge']);
    await run('ip', ['addr', 'add', `${gateway}/24`, 'dev', bridge]);
    await run('ip', ['link', 'set', bridge, 'up']);
    const cniDir = join(dir, 'cni');
    mkdirSync(cniDir);
    writeFileSync(
      join(cniDir, '10-magus.conflist'),
      JSON.stringify({
        cniVersion: '0.4.0',
        name: 'magus-pods',
        plugins: [
          {
            type: 'bridge',
            bridge,
            isGateway: true,
            ipMasq: false,
            ipam: { type: 'host-local', ranges: [[{ subnet: `10.244.${net}.0/24`, gateway }]], dataDir: join(dir, 'ipam'), routes: [{ dst: '0.0.0.0/0' }] },
          },
          { type: 'portmap', capabilities: { portMappings: true } },
        ],
      }),
    );
    const runc = join(dir, 'runc');
    writeFileSync(runc, RUNC_WRAPPER);
    chmodSync(runc, 0o755);
    const config = join(dir, 'containerd.toml');
    writeFileSync(
      config,
      [
        'version = 2',
        `root = ${JSON.stringify(join(dir, 'containerd', 'root'))}`,
        `state = ${JSON.stringify(join(dir, 'containerd', 'state'))}`,
        '[grpc]',
        `  address = ${JSON.stringify(containerdSock)}`,
        '[plugins."io.containerd.internal.v1.opt"]',
        `  path = ${JSON.stringify(join(dir, 'containerd', 'opt'))}`,
        '[plugins."io.containerd.grpc.v1.cri"]',
        `  sandbox_image = ${JSON.stringify(PAUSE_IMAGE)}`,
        '  [plugins."io.containerd.grpc.v1.cri".cni]',
        `    bin_dir = ${JSON.stringify(CNI_BIN)}`,
        `    conf_dir = ${JSON.stringify(cniDir)}`,
        '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]',
        '    runtime_type = "io.containerd.runc.v2"',
        '    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]',
        `      BinaryName = ${JSON.stringify(runc)}`,
        '',
      ].join('\n'),
    );
    procs.push(launch('containerd', 'containerd', ['--config', config], dir, {}, 'a node of the test'));
    await until(
      'containerd answering',
      () =>
        ctr('version').then(
          () => true,
          () => false,
        ),
      30_000,
    );

    // The sandbox image, then the test's images, from podman's store.
    writeFileSync(join(dir, 'pause.c'), PAUSE_C);
    await run('gcc', ['-O2', '-static', '-o', join(dir, 'pause'), join(dir, 'pause.c')]);
    const c = (await run('buildah', ['--storage-driver', 'overlay', 'from', 'scratch'])).stdout.trim();
    try {
      await run('buildah', ['--storage-driver', 'overlay', 'copy', c, join(dir, 'pause'), '/pause']);
      await run('buildah', ['--storage-driver', 'overlay', 'config', '--entrypoint', '["/pause"]', c]);
      await run('buildah', ['--storage-driver', 'overlay', 'commit', '-q', c, PAUSE_IMAGE]);
    } finally {
      await run('buildah', ['--storage-driver', 'overlay', 'rm', c]).catch(() => undefined);
    }
    for (const image of [PAUSE_IMAGE, ...opts.images]) {
      const archive = join(dir, 'image.tar');
      await podman('save', '--format', 'oci-archive', '-o', archive, image);
      await ctr('images', 'import', '--base-name', image.replace(/:[^:/]+$/, ''), archive);
      rmSync(archive);
    }

    const kubeletConfig = join(dir, 'kubelet.yaml');
    writeFileSync(
      kubeletConfig,
      JSON.stringify({
        apiVersion: 'kubelet.config.k8s.io/v1beta1',
        kind: 'KubeletConfiguration',
        cgroupDriver: 'cgroupfs',
        containerRuntimeEndpoint: `unix://${containerdSock}`,
        failSwapOn: false,
        authentication: { anonymous: { enabled: true }, webhook: { enabled: false } },
        authorization: { mode: 'AlwaysAllow' },
        address: '127.0.0.1',
        port: await freePort(),
        readOnlyPort: 0,
        healthzPort: 0,
        podLogsDir: podLogs,
        // Nothing evicted for this machine's disk or memory while a test runs.
        evictionHard: { 'memory.available': '1Mi', 'nodefs.available': '0%', 'imagefs.available': '0%' },
        imageGCHighThresholdPercent: 100,
        imageGCLowThresholdPercent: 99,
        resolvConf: '/etc/resolv.conf',
      }),
    );
    const kubeconfig = join(dir, 'kubeconfig');
    writeAdminKubeconfig(kubeconfig, opts.server, opts.token);
    procs.push(
      launch(
        'kubelet',
        kubeletBin,
        ['--config', kubeletConfig, '--kubeconfig', kubeconfig, '--hostname-override', name, '--root-dir', join(dir, 'kubelet'), '--v=2'],
        dir,
        {},
        name,
      ),
    );
    const core = opts.kubeConfig.makeApiClient(CoreV1Api);
    await until(
      `Node ${name} Ready (kubelet log: ${kubeletLog})`,
      async () => {
        const node = await core.readNode({ name }).catch(() => undefined);
        return node?.status?.conditions?.some((x) => x.type === 'Ready' && x.status === 'True') === true;
      },
      90_000,
    );
  } catch (err) {
    const tail = (() => {
      try {
        return readFileSync(kubeletLog, 'utf8').slice(-2000);
      } catch {
        return '';
      }
    })();
    await stop();
    throw Object.assign(err as Error, { message: `${(err as Error).message}${tail ? `\nkubelet log tail:\n${tail}` : ''}` });
  }
  return {
    name,
    gateway,
    podLogs,
    log: () => readFileSync(kubeletLog, 'utf8'),
    stop,
  };
}
