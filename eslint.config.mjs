// @ts-check
import js from '@eslint/js';
import tseslint from 'typescript-eslint';
import { builtinModules } from 'node:module';

/**
 * The workflow import boundary: workflow code is replayed deterministically inside Temporal's
 * sandbox, so it may not reach I/O. Activities may be imported for their types only.
 * Exported so that a test can prove the rule fires (test/lint.test.ts).
 */
export const workflowBoundary = {
  files: ['workflows/**/*.ts', 'test/lint-fixtures/workflows/**/*.ts'],
  rules: {
    '@typescript-eslint/no-restricted-imports': [
      'error',
      {
        paths: [
          ...builtinModules.filter((m) => !m.startsWith('_')).flatMap((m) => [m, `node:${m}`]),
          'nats',
          'fastify',
        ].map((name) => ({ name, message: 'Workflow code must not do I/O: no Node builtins, nats or fastify.' })),
        patterns: [
          { group: ['node:*'], message: 'Workflow code must not import Node builtins.' },
          { group: ['@kubernetes/*', '@aws-sdk/*'], message: 'Workflow code must not import Kubernetes or S3 clients.' },
          { group: ['fastify/*', 'nats/*'], message: 'Workflow code must not do I/O.' },
          {
            group: ['**/activities', '**/activities/**'],
            allowTypeImports: true,
            message: 'Workflows import activities as types only: `import type * as activities from ...`.',
          },
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
      parserOptions: { projectService: { allowDefaultProject: ['*.mjs', '*.js', 'bin/*.js', 'test/lint-fixtures/*.ts', 'test/lint-fixtures/workflows/*.ts'] }, tsconfigRootDir: import.meta.dirname },
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
);
