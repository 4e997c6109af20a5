/**
 * What `fastify-plugin` does, without the dependency: mark a plugin function so fastify runs it in
 * its parent's context (decorators, hooks and the error handler it sets are visible to siblings),
 * and give it a `name` and `dependencies` that fastify checks at registration.
 * With `fastify-plugin` installed this becomes `export const servicePlugin = (fn, meta) => fp(fn, { fastify: '5.x', ...meta })`.
 */
import type { FastifyPluginCallback } from 'fastify';

export interface PluginMeta {
  name: string;
  dependencies?: string[];
}

export function servicePlugin<Options extends object>(fn: FastifyPluginCallback<Options>, meta: PluginMeta): FastifyPluginCallback<Options> {
  const marked = fn as FastifyPluginCallback<Options> & Record<symbol, unknown>;
  marked[Symbol.for('skip-override')] = true;
  marked[Symbol.for('fastify.display-name')] = meta.name;
  marked[Symbol.for('plugin-meta')] = { fastify: '5.x', name: meta.name, dependencies: meta.dependencies ?? [] };
  return marked;
}
