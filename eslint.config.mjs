// @ts-check
import js from '@eslint/js';
import tseslint from 'typescript-eslint';
import { builtinModules } from 'node:module';
import prettier from 'eslint-config-prettier';

/**
 * The workflow import boundary: workflow code is replayed deterministically inside Temporal's
 * sandbox, so it may not reach I/O. Activities may be imported for their types only.
 * Exported so that a test can prove the rule fires (test/lint.test.ts).
 */
/**
 * The rooms (top-level folders) from the bottom up, and the rooms each may not import: a room
 * imports only rooms below it (ARCHITECTURE.md, "Rooms"). Product code never
 * imports tests or benchmarks; tests (`*.test.ts`) may import anything.
 */
export const ROOMS_ABOVE = {
  shared: ['platform', 'convert', 'kube', 'workflows', 'dataplane', 'engine', 'activities', 'controller', 'gateway', 'workers'],
  platform: ['convert', 'kube', 'workflows', 'dataplane', 'engine', 'activities', 'controller', 'gateway', 'workers'],
  convert: ['kube', 'workflows', 'dataplane', 'engine', 'activities', 'controller', 'gateway', 'workers'],
  // The Kubernetes API (kube/: watches, CRDs, resource status, Events) is for the activities, the
  // controller and the workers that run them.
  kube: ['convert', 'workflows', 'dataplane', 'engine', 'activities', 'controller', 'gateway', 'workers'],
  // The rooms above convert that have no use for conversion may not import it either: the serving
  // path and the controller do not load the converter, and workflow code does no I/O.
  workflows: ['platform', 'convert', 'kube', 'dataplane', 'engine', 'controller', 'gateway', 'workers'],
  dataplane: ['convert', 'kube', 'workflows', 'engine', 'activities', 'controller', 'gateway', 'workers'],
  engine: ['convert', 'kube', 'workflows', 'dataplane', 'activities', 'controller', 'gateway', 'workers'],
  // Activities take nothing of workflows/ (what both need, e.g. the reports the workflows' queries
  // give, lives in shared/): the one tie between them is the workflows' type-only import of
  // activities, which Temporal's proxyActivities needs.
  activities: ['workflows', 'controller', 'gateway', 'workers'],
  controller: ['convert', 'gateway', 'workers'],
  gateway: ['convert', 'kube', 'engine', 'activities', 'controller', 'workers'],
  workers: [],
};

/** The import patterns `room` may not use: the rooms above it, tests and benchmarks. */
const roomPatterns = (room) =>
  [...ROOMS_ABOVE[room], 'test', 'bench'].map((other) => ({
    // A relative path that climbs out of its room into `other` (not a file of that name inside a
    // room below, e.g. shared/kube.ts against the kube/ room).
    regex: `^(\\.\\./)+${other}(/|$)`,
    message:
      other === 'test' || other === 'bench'
        ? `Product code must not import ${other}/.`
        : `${room}/ must not import ${other}/: a room imports only the rooms below it (eslint.config.mjs ROOMS_ABOVE).`,
  }));

/**
 * The room boundaries, one config per room but workflows (whose boundary below adds them).
 * Lint fixtures under `test/lint-fixtures/rooms/<room>/` stand for files of that room
 * (test/lint.test.ts proves the rule fires).
 */
export const roomBoundaries = Object.keys(ROOMS_ABOVE)
  .filter((room) => room !== 'workflows')
  .map((room) => ({
    files: [`${room}/**/*.ts`, `test/lint-fixtures/rooms/${room}/**/*.ts`],
    ignores: ['**/*.test.ts'],
    rules: { '@typescript-eslint/no-restricted-imports': ['error', { patterns: roomPatterns(room) }] },
  }));

export const workflowBoundary = {
  files: ['workflows/**/*.ts', 'test/lint-fixtures/workflows/**/*.ts'],
  rules: {
    '@typescript-eslint/no-restricted-imports': [
      'error',
      {
        paths: [...builtinModules.filter((m) => !m.startsWith('_')).flatMap((m) => [m, `node:${m}`]), 'nats', 'fastify'].map((name) => ({
          name,
          message: 'Workflow code must not do I/O: no Node builtins, nats or fastify.',
        })),
        patterns: [
          { group: ['node:*'], message: 'Workflow code must not import Node builtins.' },
          { group: ['@kubernetes/*', '@aws-sdk/*'], message: 'Workflow code must not import Kubernetes or S3 clients.' },
          { group: ['fastify/*', 'nats/*'], message: 'Workflow code must not do I/O.' },
          {
            group: ['**/activities', '**/activities/**'],
            allowTypeImports: true,
            message: 'Workflows import activities as types only: `import type * as activities from ...`.',
          },
          ...roomPatterns('workflows'),
        ],
      },
    ],
  },
};

export default tseslint.config(
  { ignores: ['dist/**', 'node_modules/**', 'coverage/**', 'test-results/**', 'test/lint-fixtures/**'] },
  js.configs.recommended,
  ...tseslint.configs.recommendedTypeChecked,
  {
    languageOptions: {
      parserOptions: { projectService: { allowDefaultProject: ['*.mjs', '*.js', 'bin/*.js'] }, tsconfigRootDir: import.meta.dirname },
    },
    rules: {
      '@typescript-eslint/no-floating-promises': 'error',
      '@typescript-eslint/no-misused-promises': 'error',
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_', varsIgnorePattern: '^_' }],
      '@typescript-eslint/consistent-type-imports': ['error', { fixStyle: 'inline-type-imports' }],
    },
  },
  { files: ['**/*.mjs', '**/*.js'], ...tseslint.configs.disableTypeChecked },
  {
    files: ['**/*.js'],
    languageOptions: {
      sourceType: 'commonjs',
      globals: { require: 'readonly', module: 'writable', __dirname: 'readonly', process: 'readonly', console: 'readonly' },
    },
    rules: { '@typescript-eslint/no-require-imports': 'off' },
  },
  workflowBoundary,
  ...roomBoundaries,
  // Layout is prettier's (.prettierrc.json; `npm run lint` checks it): no lint rule argues with it.
  prettier,
);
