/**
 * The routes' validators and response serializers, each made the first time a request needs it
 * rather than when the app starts. Ajv compiling every route's schemas was ~140 ms, and
 * fast-json-stringify's serializers ~20 ms, of the ~0.8 s of CPU a replica took to start
 * (bench/README.md, "A replica's start") — CPU that, on a node of few cores, a replica started
 * beside another takes from it just when that one takes the clients of a replica that died
 * (bench:chaos's gateway kills) — and the chat body's alone ~0.1 s. So a validator is loaded from
 * the code `npm run build` generated for its schema (validators-build.ts), and compiled only when
 * the build made none for it (the tests, which run the sources; a schema that depends on the
 * configuration); a serializer is compiled when first used.
 *
 * They are fastify's own compilers (`@fastify/ajv-compiler` with the server's `ajv` options, and
 * Ajv's standalone code of the same; `@fastify/fast-json-stringify-compiler`), so what they
 * accept, the errors they give and what they write are the same; a schema either refuses is
 * found by the tests, which also start the app with fastify's eager compilers
 * (`compilers.test.ts`). One difference: fastify lowercases the keys of a `headers` schema only
 * for its own compiler, so a route's `headers` schema must name them in lower case (refused when
 * the route is added, otherwise).
 */
import type { AjvCompiler } from '@fastify/ajv-compiler';
import type { SerializerSelector } from '@fastify/fast-json-stringify-compiler';
import type { FastifyServerOptions } from 'fastify';
import { createHash } from 'node:crypto';
import { existsSync, readdirSync } from 'node:fs';
import { basename, join } from 'node:path';

type Factories = NonNullable<NonNullable<FastifyServerOptions['schemaController']>['compilersFactory']>;
/** What fastify takes as `schemaController.compilersFactory.buildValidator`. */
export type ValidatorFactory = NonNullable<Factories['buildValidator']>;
type BuildSerializer = ReturnType<typeof SerializerSelector>;
type Serialize = ReturnType<ReturnType<BuildSerializer>>;

/** What fastify hands a validator builder's compiler: a route's part (`@fastify/ajv-compiler`'s types call it a schema). */
export interface ValidatorRoute {
  method: string;
  url: string;
  httpPart: string;
  schema: unknown;
}
/** A compiled validator as fastify calls it (validation.js): false with `errors` when the data fails. */
export type Validator = ((data: unknown, ctx?: object) => unknown) & { errors?: unknown; schemaEnv?: unknown };
/** A validator builder as fastify calls it: with the schemas added to the instance and the server's `ajv` options. */
export type BuildValidator = (externalSchemas: unknown, options: unknown) => (route: ValidatorRoute) => Validator;

/**
 * Where `npm run build` writes the routes' validators as code (validators-build.ts) and the built
 * app looks for them: `validators/` beside this file in dist/ (from the sources, as the tests run,
 * there is none, and each is compiled).
 */
export const GENERATED_VALIDATORS = join(__dirname, 'validators');

/** The Ajv the validators are made with (`@fastify/ajv-compiler`'s). */
// eslint-disable-next-line @typescript-eslint/no-require-imports -- a JSON file, read once
const AJV_VERSION = (require('ajv/package.json') as { version: string }).version;

/**
 * The file a validator generated for `route` is in: named by everything its code depends on —
 * the schema, the part it checks, the schemas added to the instance, the server's Ajv options
 * (but `code`, which generating sets) and Ajv's version — so a schema or an option changed since
 * the build is compiled, never checked by code made for another.
 */
export function generatedValidatorFile(dir: string, route: ValidatorRoute, externalSchemas: unknown, ajvOptions: unknown): string {
  const { code: _code, ...custom } = (ajvOptions as { customOptions?: Record<string, unknown> } | undefined)?.customOptions ?? {};
  const plugins = ((ajvOptions as { plugins?: unknown[] } | undefined)?.plugins ?? []).length;
  const key = JSON.stringify([AJV_VERSION, custom, plugins, externalSchemas, route.httpPart, route.schema]);
  return join(dir, `${createHash('sha256').update(key).digest('hex').slice(0, 32)}.js`);
}

/**
 * fastify's validator builder (`schemaController.compilersFactory.buildValidator`) with each
 * validator compiled on first use — or, when the build generated it (`dir`), its code loaded
 * then, with nothing compiled.
 */
export function lazyValidators(opts: { build?: BuildValidator; dir?: string } = {}): ValidatorFactory {
  const build = opts.build ?? fastifyValidators;
  const dir = opts.dir === undefined ? GENERATED_VALIDATORS : opts.dir;
  // The files the build wrote, read once: a route part's is looked up by name.
  const generated = new Set(dir !== '' && existsSync(dir) ? readdirSync(dir) : []);
  const lazyBuild: BuildValidator = (externalSchemas, options) => {
    // Ajv itself is made only when a validator has to be compiled.
    let compile: ReturnType<BuildValidator> | undefined;
    return (route) => {
      const headers = route.httpPart === 'headers' ? (route.schema as { properties?: object; required?: string[] } | null) : null;
      const named = [...Object.keys(headers?.properties ?? {}), ...(headers?.required ?? [])];
      const upper = named.find((h) => h !== h.toLowerCase());
      if (upper) throw new Error(`${route.method} ${route.url}: header '${upper}' in its headers schema is to be named in lower case`);
      const file = generated.size > 0 ? generatedValidatorFile(dir, route, externalSchemas, options) : undefined;
      // eslint-disable-next-line @typescript-eslint/no-require-imports -- code the build generated, loaded when first needed
      if (file && generated.has(basename(file))) return lazyValidator(() => require(file) as Validator);
      return lazyValidator(() => (compile ??= build(externalSchemas, options))(route));
    };
  };
  return lazyBuild as unknown as ValidatorFactory;
}

/** fastify's serializer builder (`schemaController.compilersFactory.buildSerializer`) with each serializer compiled on first use. */
export function lazySerializers(build: BuildSerializer = fastifySerializers): BuildSerializer {
  return (externalSchemas, options) => {
    let compile: ReturnType<BuildSerializer> | undefined;
    return (route) => {
      let serialize: Serialize | undefined;
      return (doc) => (serialize ??= (compile ??= build(externalSchemas, options))(route))(doc);
    };
  };
}

// fastify's own compilers, each loaded (Ajv, fast-json-stringify: ~20 ms of a start) only by a
// replica that compiles, and one of each per process (they pool by their options).
let ajvPool: BuildValidator | undefined;
let fjsPool: BuildSerializer | undefined;
const fastifyValidators: BuildValidator = (externalSchemas, options) => {
  // eslint-disable-next-line @typescript-eslint/no-require-imports -- loaded when first compiling
  ajvPool ??= (require('@fastify/ajv-compiler') as { AjvCompiler: typeof AjvCompiler }).AjvCompiler() as unknown as BuildValidator;
  return ajvPool(externalSchemas, options);
};
const fastifySerializers: BuildSerializer = (externalSchemas, options) => {
  // eslint-disable-next-line @typescript-eslint/no-require-imports -- loaded when first compiling
  fjsPool ??= (require('@fastify/fast-json-stringify-compiler') as { SerializerSelector: typeof SerializerSelector }).SerializerSelector();
  return fjsPool(externalSchemas, options);
};

/**
 * A validator that `make` makes (loads or compiles) at its first call, or when fastify first reads
 * its `schemaEnv` (to pass the request as the root's parent) or `errors` (a failed check's).
 */
function lazyValidator(make: () => Validator): Validator {
  let validate: Validator | undefined;
  const compiled = (): Validator => (validate ??= make());
  const call = function (this: unknown, data: unknown, ctx?: object) {
    const v = compiled();
    return ctx === undefined ? v.call(this, data) : v.call(this, data, ctx);
  };
  Object.defineProperty(call, 'errors', { get: () => compiled().errors });
  Object.defineProperty(call, 'schemaEnv', { get: () => compiled().schemaEnv });
  return call;
}
