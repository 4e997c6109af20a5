/**
 * `GET /v1/models` and `GET /v1/models/:model`: the ready models the caller may use, OpenAI-shaped,
 * plus `servable` (and `not_servable_reason`): a model no live runtime can run is listed, marked,
 * so a caller sees why its requests are refused; `engines` and `capabilities` (what a request may
 * ask beyond plain chat: `json_schema`); `sampling`, the defaults of a request that sets no sampling
 * field; `serving`, whether its pool serves, starts an instance (and for how long) or fails now,
 * from the pool's published view. Both answer from a registry read that began after the request
 * arrived, so they agree at all times.
 */
import type { FastifyPluginCallback } from 'fastify';
import type { ReadyModel } from '../../shared/model';
import { modelCapabilities } from '../../shared/runtimes';
import { modelSampling } from '../../shared/sampling';
import type { ModelCatalog } from '../serving/model-catalog';
import type { ModelServing, SessionBroker } from '../serving/sessions';
import { mayUse } from '../plugins/auth';
import { errors } from '../plugins/errors';
import { getModelSchema, listModelsSchema, type ModelObject } from '../schemas/models';

function toModelObject(m: ReadyModel, models: ModelCatalog, sessions: SessionBroker): ModelObject {
  const why = models.unservable(m);
  const engines = models.engines(m);
  return {
    id: m.name,
    object: 'model',
    created: Math.floor(Date.parse(m.readyAt) / 1000) || 0,
    owned_by: 'magus',
    servable: why === undefined,
    ...(why === undefined ? {} : { not_servable_reason: why }),
    engines,
    capabilities: modelCapabilities(engines),
    sampling: modelSampling(m),
    ...servingField(sessions.serving?.(m)),
  };
}

function servingField(s: ModelServing | undefined): Pick<ModelObject, 'serving'> {
  if (!s) return {};
  return {
    serving: {
      status: s.status,
      instances: s.instances,
      starting: s.starting,
      ...(s.startingForSec !== undefined ? { starting_for_s: s.startingForSec } : {}),
      ...(s.failing ? { failing: s.failing } : {}),
    },
  };
}

export const modelRoutes: FastifyPluginCallback = (app, _opts, done) => {
  const { models, sessions } = app.gateway;

  app.get('/v1/models', { schema: listModelsSchema, onRequest: app.authenticate }, async (request) => {
    const principal = request.principal!;
    const seen = new Set<string>();
    const data: ModelObject[] = [];
    for (const m of await models.list()) {
      // Ids are bare names; the first namespace holding a name is the one a request reaches.
      if (seen.has(m.name) || !mayUse(principal, m.namespace, m.name)) continue;
      seen.add(m.name);
      data.push(toModelObject(m, models, sessions));
    }
    return { object: 'list', data };
  });

  app.get<{ Params: { model: string } }>('/v1/models/:model', { schema: getModelSchema, onRequest: app.authenticate }, async (request) => {
    const principal = request.principal!;
    const m = await models.lookup(request.params.model, (ns, n) => mayUse(principal, ns, n));
    if (!m) throw errors.modelNotFound(request.params.model);
    return toModelObject(m, models, sessions);
  });
  done();
};
