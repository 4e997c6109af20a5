/** @type {import('jest').Config} */
// Two projects: `unit` (pure code, no servers) and `integration` (*.int.test.ts: the global
// setup starts real Temporal, NATS, S3 and Kubernetes servers on loopback ports).
// ESM-only dependencies (the Kubernetes client and its OIDC helpers) are compiled to CommonJS
// by swc like our own TypeScript; everything else in node_modules is loaded as is.
const esmDeps = ['@kubernetes/client-node', 'openid-client', 'oauth4webapi', 'jose', 'cookie'];
const common = {
  testEnvironment: 'node',
  rootDir: __dirname,
  roots: [
    '<rootDir>/test',
    '<rootDir>/shared',
    '<rootDir>/platform',
    '<rootDir>/convert',
    '<rootDir>/kube',
    '<rootDir>/workflows',
    '<rootDir>/dataplane',
    '<rootDir>/engine',
    '<rootDir>/activities',
    '<rootDir>/controller',
    '<rootDir>/gateway',
    '<rootDir>/workers',
  ],
  transform: { '^.+\\.(t|j|mj)s$': ['@swc/jest', { jsc: { target: 'es2022' }, module: { type: 'commonjs' } }] },
  transformIgnorePatterns: [`/node_modules/(?!(${esmDeps.join('|')})/)`],
  moduleFileExtensions: ['ts', 'js', 'mjs', 'json'],
};
module.exports = {
  testTimeout: 120000,
  maxWorkers: 2,
  projects: [
    { ...common, displayName: 'unit', testMatch: ['**/*.test.ts'], testPathIgnorePatterns: ['\\.int\\.test\\.ts$', '/node_modules/'] },
    {
      ...common,
      displayName: 'integration',
      testMatch: ['**/*.int.test.ts'],
      globalSetup: '<rootDir>/test/harness/global-setup.ts',
      globalTeardown: '<rootDir>/test/harness/global-teardown.ts',
      setupFiles: ['<rootDir>/test/harness/setup-file.ts'],
    },
  ],
};
