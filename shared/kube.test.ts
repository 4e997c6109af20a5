import { instanceSpecOf, type DllamaResource } from './kube';

const dllama = (spec: Partial<DllamaResource['spec']> = {}, generation = 1): Pick<DllamaResource, 'metadata' | 'spec'> => ({
  metadata: { name: 'd', namespace: 'ns', uid: 'u1', generation },
  spec: {
    model: 'm',
    engine: 'llamacpp',
    nodesPower: 0,
    replicas: 1,
    minReplicas: 0,
    maxReplicas: 2,
    leasesPerInstance: 4,
    idleTimeout: '10m',
    resources: { requests: { cpu: '1', memory: '1Gi' } },
    ...spec,
  },
});

/** The digest of `dllama()` as magus made it before `resumeSlots` was added to what shapes an instance. */
const PRE_RESUME_SLOTS_DIGEST = '1d7d4ea44b37efd1';

describe("instanceSpecOf: what shapes a Dllama's instances", () => {
  it('is the same for a change that only sizes or times the pool, whatever order its maps were written in', () => {
    const base = instanceSpecOf(dllama());
    expect(base.digest).toMatch(/^[0-9a-f]{16}$/);
    expect(base).toMatchObject({ uid: 'u1', generation: 1 });
    const sized = instanceSpecOf(dllama({ replicas: 3, minReplicas: 1, maxReplicas: 5, idleTimeout: '1m', drainTimeout: '30s' }, 2));
    expect(sized).toEqual({ ...base, generation: 2 });
    expect(instanceSpecOf(dllama({ resources: { requests: { memory: '1Gi', cpu: '1' } } })).digest).toBe(base.digest);
  });

  it('is the one a Dllama had before a field was added, while that field is unset (an upgrade replaces no instance)', () => {
    // The digest of this spec before `resumeSlots` was added.
    expect(instanceSpecOf(dllama()).digest).toBe(PRE_RESUME_SLOTS_DIGEST);
  });

  it('differs for each field an instance is built from', () => {
    const base = instanceSpecOf(dllama()).digest;
    const changes: Partial<DllamaResource['spec']>[] = [
      { engine: 'dllama' },
      { nodesPower: 1 },
      { autoNodes: true },
      { leasesPerInstance: 8 },
      { resumeSlots: 2 },
      { resources: { requests: { cpu: '2', memory: '1Gi' } } },
      { nodeSelector: { pool: 'gpu' } },
      { tolerations: [{ key: 'k', operator: 'Exists' }] },
      { images: { magus: 'magus:v2' } },
      { images: { dllama: 'dllama:v2' } },
    ];
    const digests = changes.map((c) => instanceSpecOf(dllama(c)).digest);
    expect(new Set([base, ...digests]).size).toBe(changes.length + 1);
  });
});
