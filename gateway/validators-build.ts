/**
 * `npm run build`'s last step (`node dist/gateway/validators-build.js`): the routes' validators
 * generated as code (Ajv's standalone code, made by fastify's own compiler with the app's options)
 * into `dist/gateway/validators/`, one file per route part, named by what it checks
 * (compilers.ts `generatedValidatorFile`). A replica then loads a route's validator the first time
 * a request needs it instead of compiling it — the chat body's took ~0.1 s of CPU to compile — so a
 * replica's start, and its first request of each kind, compile nothing.
 *
 * The app is registered with services that do nothing: registering it only adds its routes.
 */
import { AjvCompiler, AjvReference } from '@fastify/ajv-compiler';
import standaloneCode from 'ajv/dist/standalone';
import type Ajv from 'ajv';
import Fastify from 'fastify';
import { mkdirSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import gatewayApp, { options } from './app';
import { GENERATED_VALIDATORS, generatedValidatorFile, type BuildValidator, type ValidatorFactory } from './compilers';
import { loadGatewayConfig } from './config';
import { staticTokenSource } from './plugins/auth';
import type { ResponseRouter } from './serving/exchange';
import { createModelCatalog } from './serving/model-catalog';
import { memoryResponseStore } from './serving/response-store';
import type { SessionBroker } from './serving/sessions';

/** A validator builder that also writes each validator's standalone code to `dir`, under the name compilers.ts looks it up by. */
export function storeValidators(dir: string, stored: string[] = []): ValidatorFactory {
  const factory = AjvCompiler();
  const build: BuildValidator = (externalSchemas, ajvOptions) => {
    const given = (ajvOptions ?? {}) as { customOptions?: object };
    // Ajv keeps the source it generates only when told to.
    const withSource = { ...given, customOptions: { ...given.customOptions, code: { source: true } } };
    const compile = factory(externalSchemas as never, withSource);
    const ajv = (compile as unknown as Record<symbol, { ajv: Ajv }>)[AjvReference as symbol]!.ajv;
    return (route) => {
      const validate = (compile as unknown as (route: unknown) => Parameters<typeof standaloneCode>[1])(route);
      const file = generatedValidatorFile(dir, route, externalSchemas, ajvOptions);
      writeFileSync(`${file}.tmp`, standaloneCode(ajv, validate));
      renameSync(`${file}.tmp`, file);
      stored.push(`${route.method} ${route.url} ${route.httpPart}`);
      return validate as never;
    };
  };
  return build as unknown as ValidatorFactory;
}

/** Generates the validators of every route of the app into `dir` (emptied first); resolves with the route parts generated. */
export async function generateValidators(dir: string = GENERATED_VALIDATORS): Promise<string[]> {
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  const stored: string[] = [];
  const app = Fastify({
    ...options,
    logger: false,
    schemaController: { compilersFactory: { ...options.schemaController.compilersFactory, buildValidator: storeValidators(dir, stored) } },
  });
  const config = loadGatewayConfig({ MAGUS_GATEWAY_SECRET: 'validators-build'.repeat(4) });
  await app.register(gatewayApp, {
    settings: config.settings,
    tokens: staticTokenSource({}, 'validators-build'),
    sessions: {} as SessionBroker,
    publish: () => Promise.resolve(),
    responses: {} as ResponseRouter,
    storedResponses: memoryResponseStore(),
    models: createModelCatalog({ list: () => Promise.resolve([]) }),
  });
  await app.ready();
  await app.close();
  return stored;
}

if (require.main === module) {
  generateValidators().then(
    (stored) => process.stdout.write(`magus build: ${stored.length} route validators generated in ${GENERATED_VALIDATORS}\n`),
    (err: unknown) => {
      process.stderr.write(`magus build: the route validators could not be generated: ${String(err)}\n`);
      process.exit(1);
    },
  );
}
