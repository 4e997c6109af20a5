/**
 * The CRDs' admission, fuzzed: seeded random `Model` and `Dllama` specs — mostly near a valid one
 * (a field dropped, retyped, out of range, a nasty string), some wild — created on the real
 * kube-apiserver. Each is either refused (422, a message naming the field it broke) or accepted;
 * an accepted one goes through what the controller makes of it (`modelSpecOf` and the pipeline's
 * `validateModelSpec`; `poolResourceOf` and the pool's size rule), which must end in a spec or a
 * reason, never a throw, and must not let through what admission promised to refuse. The seed is
 * fixed (`MAGUS_FUZZ_SEED=random` explores; the seed is printed and replays a run).
 */
import { randomInt } from 'node:crypto';
import { CoreV1Api, CustomObjectsApi } from '@kubernetes/client-node';
import { installCrds } from '../kube/crds';
import { mulberry32 } from '../workers/dev/tiny-model';
import { poolResourceOf } from '../controller/dllama-reconciler';
import { modelSpecOf } from '../controller/model-reconciler';
import { validateModelSpec } from '../shared/model';
import { Plural, type DllamaResource, type ModelResource } from '../shared/kube';
import { isolation } from './harness';
import { kubeConfig } from './harness/kube';

const SEED = process.env.MAGUS_FUZZ_SEED === 'random' ? randomInt(2 ** 31) : Number(process.env.MAGUS_FUZZ_SEED ?? 20261124);
const CASES = Number(process.env.MAGUS_FUZZ_CASES ?? 120);
const iso = isolation();
const custom = kubeConfig().makeApiClient(CustomObjectsApi);
const group = 'magus.dev';
const version = 'v1alpha1';

type Rand = () => number;
const pick = <T>(r: Rand, xs: readonly T[]): T => xs[Math.floor(r() * xs.length)]!;
/** A nasty value of its own (never one shared with other cases, which an edit would change). */
const nasty = (r: Rand): unknown => structuredClone(pick(r, NASTY));

/** Values that break things: wrong types, edges of ranges, strings no schema author thought of. */
const NASTY: unknown[] = [
  null,
  true,
  -1,
  0,
  1.5,
  2 ** 31,
  2 ** 53,
  -(2 ** 53),
  '',
  ' ',
  'a'.repeat(300),
  '../../etc/passwd',
  'org/repo\u0000x',
  'ünïcødé/🦙',
  '${x}',
  '1h',
  '-5m',
  '0s',
  [],
  {},
  [1, 'a'],
  { $ref: '#' },
];

function validModel(r: Rand): Record<string, unknown> {
  return {
    source: {
      repo: pick(r, ['org/model', 'TinyLlama/TinyLlama-1.1B-Chat-v1.0', 'a/b']),
      ...(r() < 0.5 ? { revision: pick(r, ['main', 'v1.0', 'a'.repeat(40)]) } : {}),
    },
    artifacts: [{ format: pick(r, ['gguf', 'dllama']), weights: pick(r, ['q40', 'q80', 'f16', 'f32']) }],
    ...(r() < 0.5 ? { contextLength: pick(r, [128, 4096, 131072]) } : {}),
    ...(r() < 0.3 ? { deletionPolicy: pick(r, ['Retain', 'Delete']) } : {}),
  };
}

function validDllama(r: Rand): Record<string, unknown> {
  const engine = pick(r, ['dllama', 'llamacpp']);
  const max = 1 + Math.floor(r() * 4);
  return {
    model: 'org-model',
    engine,
    nodesPower: engine === 'llamacpp' ? 0 : Math.floor(r() * 3),
    replicas: 0,
    minReplicas: 0,
    maxReplicas: max,
    leasesPerInstance: 1 + Math.floor(r() * 8),
    idleTimeout: pick(r, ['10m', '30s', '1h']),
  };
}

/** A copy of `spec` with one to three random edits at random paths. */
function mutate(r: Rand, spec: Record<string, unknown>): Record<string, unknown> {
  const out = structuredClone(spec);
  for (let n = 1 + Math.floor(r() * 3); n > 0; n--) {
    // Walk down to a random object in the tree.
    let node: Record<string, unknown> = out;
    for (let depth = 0; depth < 3; depth++) {
      const kids = Object.entries(node).filter(([, v]) => typeof v === 'object' && v !== null);
      if (kids.length === 0 || r() < 0.4) break;
      const [, v] = pick(r, kids);
      const next: unknown = Array.isArray(v) ? v[0] : v;
      if (typeof next !== 'object' || next === null) break; // an array of scalars: edit its parent
      node = next as Record<string, unknown>;
    }
    const keys = Object.keys(node);
    const roll = r();
    if (roll < 0.25 && keys.length > 0) delete node[pick(r, keys)];
    else if (roll < 0.85 && keys.length > 0) node[pick(r, keys)] = nasty(r);
    else node[pick(r, ['extra', 'Repo', 'replicas', 'weights', '__proto__x'])] = nasty(r);
  }
  return out;
}

interface Outcome {
  plural: string;
  spec: unknown;
  verdict: 'refused' | 'accepted';
  message?: string;
  controller?: string;
}

async function admit(
  plural: string,
  kind: string,
  name: string,
  spec: unknown,
): Promise<{ ok: true; obj: unknown } | { ok: false; code: number; message: string }> {
  try {
    const obj: unknown = await custom.createNamespacedCustomObject({
      group,
      version,
      namespace: iso.namespace,
      plural,
      body: { apiVersion: `${group}/${version}`, kind, metadata: { name }, spec },
    });
    return { ok: true, obj };
  } catch (err) {
    const e = err as { code?: number; body?: unknown };
    const body = typeof e.body === 'string' ? (JSON.parse(e.body) as { message?: string }) : (e.body as { message?: string } | undefined);
    return { ok: false, code: e.code ?? 0, message: body?.message ?? String(err) };
  }
}

beforeAll(async () => {
  const kc = kubeConfig();
  await installCrds(kc); // a no-op when another file installed them
  await kc.makeApiClient(CoreV1Api).createNamespace({ body: { metadata: { name: iso.namespace } } });
});

test(`random Model and Dllama specs: refused naming a field, or accepted and turned by the controller into a spec or a reason (seed ${SEED})`, async () => {
  process.stdout.write(`crds fuzz: seed ${SEED} (MAGUS_FUZZ_SEED=${SEED} replays it), ${CASES} specs\n`);
  const outcomes: Outcome[] = [];
  const problems: string[] = [];
  for (let i = 0; i < CASES; i++) {
    const u32 = mulberry32(SEED + i * 7919); // one generator per case: a case replays on its own
    const r: Rand = () => u32() / 2 ** 32;
    const model = r() < 0.5;
    const base = model ? validModel(r) : validDllama(r);
    const spec = r() < 0.1 ? nasty(r) : r() < 0.15 ? base : mutate(r, base);
    const where = `case ${i} (seed ${SEED}): ${JSON.stringify(spec).slice(0, 300)}`;
    if (i % 20 === 0) process.stdout.write(`crds fuzz: case ${i}\n`);
    const plural = model ? Plural.model : Plural.dllama;
    const answer = await admit(plural, model ? 'Model' : 'Dllama', `fuzz-${i}`, spec);
    if (!answer.ok) {
      outcomes.push({ plural, spec, verdict: 'refused', message: answer.message });
      // Refused as invalid (never a 500), with a message that names the field that broke.
      if (answer.code !== 422 && answer.code !== 400) problems.push(`${where}: refused with ${answer.code}: ${answer.message}`);
      else if (!/spec|Invalid value|Required value|Unsupported value|must|should/.test(answer.message))
        problems.push(`${where}: a refusal that names nothing: ${answer.message}`);
      continue;
    }
    // Accepted: the controller's reading of it ends in a spec or a reason, never a throw.
    try {
      if (model) {
        const m = answer.obj as ModelResource;
        const errors = validateModelSpec(modelSpecOf(m));
        outcomes.push({ plural, spec, verdict: 'accepted', controller: errors.length === 0 ? 'valid' : `refused: ${errors.join('; ')}` });
      } else {
        const d = answer.obj as DllamaResource;
        const p = poolResourceOf(d);
        // The pool never takes min > max or less than one lease (CEL and the schema promise it).
        const sane =
          p.maxInstances >= 1 &&
          p.minInstances >= 0 &&
          p.minInstances <= p.maxInstances &&
          p.leasesPerInstance >= 1 &&
          Number.isFinite(p.idleTimeoutMs) &&
          p.idleTimeoutMs >= 0;
        if (!sane) problems.push(`${where}: admitted, but the pool would get ${JSON.stringify(p)}`);
        outcomes.push({ plural, spec, verdict: 'accepted', controller: sane ? 'valid' : 'insane sizes' });
      }
    } catch (err) {
      problems.push(`${where}: the controller threw ${(err as Error).stack ?? String(err)}`);
    }
  }
  const count = (f: (o: Outcome) => boolean) => outcomes.filter(f).length;
  process.stdout.write(
    `crds fuzz: ${count((o) => o.verdict === 'refused')} refused, ${count((o) => o.verdict === 'accepted' && o.controller === 'valid')} accepted and valid, ` +
      `${count((o) => o.verdict === 'accepted' && o.controller !== 'valid')} accepted and given a reason by the controller\n`,
  );
  expect(problems).toEqual([]);
  // The campaign reached both sides: refusals and acceptances of each kind.
  for (const plural of [Plural.model, Plural.dllama]) {
    expect(count((o) => o.plural === plural && o.verdict === 'refused')).toBeGreaterThan(0);
    expect(count((o) => o.plural === plural && o.verdict === 'accepted')).toBeGreaterThan(0);
  }
}, 300_000);
