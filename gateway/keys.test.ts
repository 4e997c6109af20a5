/**
 * Keys at the gateway, through `app.inject`: a caller is the key its token's entry names, not
 * the token id — two keys of the same name in two namespaces (or a key declared again under an
 * old name: another uid) never read each other's stored responses; a suspended key is a 403;
 * `models` patterns (`*`, `ns/*`, `ns/name`, a bare name; empty = none) decide which models a
 * key sees, and a bare name reaches the namespace the key may use; anonymous callers share
 * nothing stored.
 */
jest.mock('cookie', () => ({
  stringifySetCookie: () => {
    throw new Error('cookies are not used in these tests');
  },
}));
import type { LightMyRequestResponse } from 'fastify';
import type { ResponseObject } from '../shared/responses';
import { mayUse, staticTokenSource, tokenDigest, type Principal } from './plugins/auth';
import { memoryResponseStore } from './serving/response-store';
import { buildTestApp, readyModel, testSettings, type TestApp } from '../test/harness/gateway-app';

const tokenOf = (id: string) => `mgs_${id}_${'k'.repeat(24)}`;
/** Entries as the controller writes them (key, uid, models) for keys `<ns>/team` and friends. */
const entries = {
  'a-team': { digest: tokenDigest(tokenOf('a-team')), name: 'ns-a/team', key: 'ns-a/team', uid: 'uid-a', models: ['ns-a/*'] },
  'b-team': { digest: tokenDigest(tokenOf('b-team')), name: 'ns-b/team', key: 'ns-b/team', uid: 'uid-b', models: ['ns-b/*'] },
  'a-again': { digest: tokenDigest(tokenOf('a-again')), name: 'ns-a/team', key: 'ns-a/team', uid: 'uid-a2', models: ['ns-a/*'] },
  'a-rotated': { digest: tokenDigest(tokenOf('a-rotated')), name: 'ns-a/team', key: 'ns-a/team', uid: 'uid-a', models: ['ns-a/*'] },
  paused: { digest: tokenDigest(tokenOf('paused')), name: 'ns-a/paused', key: 'ns-a/paused', uid: 'uid-p', models: ['ns-a/*'], suspended: true },
  nothing: { digest: tokenDigest(tokenOf('nothing')), name: 'ns-a/nothing', key: 'ns-a/nothing', uid: 'uid-n', models: [] },
};

let t: TestApp;
const store = memoryResponseStore();
beforeEach(async () => {
  store.records.clear();
  t = await buildTestApp({
    storedResponses: store,
    tokens: staticTokenSource(entries, 'test'),
    // `shared` in both namespaces, registry order a then b.
    models: [readyModel('shared', 'ns-a'), readyModel('shared', 'ns-b'), readyModel('only-b', 'ns-b')],
  });
  t.plane.script = () => [
    {
      seq: 0,
      type: 'done',
      data: {
        id: 'chatcmpl-1',
        object: 'chat.completion',
        choices: [{ index: 0, message: { role: 'assistant', content: 'ok' }, finish_reason: 'stop' }],
        usage: { prompt_tokens: 1, completion_tokens: 1, total_tokens: 2 },
      },
    },
  ];
});
afterEach(() => t.app.close());

const call = (method: 'GET' | 'POST' | 'DELETE', url: string, id?: string, body?: object): Promise<LightMyRequestResponse> =>
  t.app.inject({
    method,
    url,
    headers: { ...(id ? { authorization: `Bearer ${tokenOf(id)}` } : {}), ...(body ? { 'content-type': 'application/json' } : {}) },
    ...(body ? { payload: JSON.stringify(body) } : {}),
  });

test('same name, two namespaces: each key reads only its own stored responses; a rotated token keeps them, a key declared again does not', async () => {
  const made = await call('POST', '/v1/responses', 'a-team', { model: 'shared', input: 'hi' });
  expect(made.statusCode).toBe(200);
  const id = made.json<ResponseObject>().id;
  expect(store.records.get(id)?.owner).toBe('ns-a/team#uid-a');
  expect((await call('GET', `/v1/responses/${id}`, 'a-team')).statusCode).toBe(200);
  expect((await call('GET', `/v1/responses/${id}`, 'a-rotated')).statusCode).toBe(200); // the same key, a new token
  for (const other of ['b-team', 'a-again']) {
    expect((await call('GET', `/v1/responses/${id}`, other)).statusCode).toBe(404);
    expect((await call('DELETE', `/v1/responses/${id}`, other)).statusCode).toBe(404);
    const next = await call('POST', '/v1/responses', other, { model: 'shared', input: 'more', previous_response_id: id });
    expect([next.statusCode, next.json()]).toEqual([404, expect.anything()]);
  }
  expect(store.records.has(id)).toBe(true);
});

test('a suspended key is a 403 key_suspended on every route; a wrong secret for it is still a 401', async () => {
  for (const [method, url] of [
    ['GET', '/v1/models'],
    ['POST', '/v1/chat/completions'],
  ] as const) {
    const res = await call(method, url, 'paused', { model: 'shared', messages: [{ role: 'user', content: 'x' }] });
    expect(res.statusCode).toBe(403);
    expect(res.json()).toMatchObject({ error: { code: 'key_suspended', type: 'permission_error' } });
  }
  const wrong = await t.app.inject({ method: 'GET', url: '/v1/models', headers: { authorization: 'Bearer mgs_paused_wrongwrongwrong' } });
  expect(wrong.statusCode).toBe(401);
});

test("a bare model name reaches the namespace the key may use; another namespace's models are not listed", async () => {
  const list = async (id: string) =>
    (await call('GET', '/v1/models', id))
      .json<{ data: { id: string }[] }>()
      .data.map((m) => m.id)
      .sort();
  expect(await list('a-team')).toEqual(['shared']);
  expect(await list('b-team')).toEqual(['only-b', 'shared']);
  expect(await list('nothing')).toEqual([]);
  // `shared` is ns-a's first in registry order, yet b-team reaches ns-b's.
  const res = await call('POST', '/v1/chat/completions', 'b-team', { model: 'shared', messages: [{ role: 'user', content: 'x' }] });
  expect(res.statusCode).toBe(200);
  expect(t.broker.calls.at(-1)!.model).toMatchObject({ namespace: 'ns-b', name: 'shared' });
  expect((await call('POST', '/v1/chat/completions', 'a-team', { model: 'only-b', messages: [{ role: 'user', content: 'x' }] })).statusCode).toBe(404);
  expect((await call('GET', '/v1/models/only-b', 'a-team')).statusCode).toBe(404);
  expect((await call('GET', '/v1/models/ns-b/shared', 'a-team')).statusCode).toBe(404);
});

test('mayUse: *, ns/*, ns/name, a bare name; absent = all, empty = none', () => {
  const p = (models?: string[]): Principal => ({ key: 'k', owner: 'k#1', conversationScope: 'k#1', name: 'k', ...(models ? { models } : {}) });
  expect(mayUse(p(), 'x', 'm')).toBe(true);
  expect(mayUse(p([]), 'x', 'm')).toBe(false);
  expect(mayUse(p(['*']), 'x', 'm')).toBe(true);
  expect(mayUse(p(['x/*']), 'x', 'm')).toBe(true);
  expect(mayUse(p(['x/*']), 'y', 'm')).toBe(false);
  expect(mayUse(p(['x/m']), 'x', 'm')).toBe(true);
  expect(mayUse(p(['x/m']), 'y', 'm')).toBe(false);
  expect(mayUse(p(['m']), 'y', 'm')).toBe(true);
  expect(mayUse(p(['m']), 'y', 'n')).toBe(false);
});

test('anonymous callers share nothing stored: their responses are not stored, and none can be read', async () => {
  await t.app.close();
  t = await buildTestApp({ storedResponses: store, settings: testSettings({ allowAnonymous: true }), models: [readyModel('shared', 'ns-a')] });
  t.plane.script = () => [
    {
      seq: 0,
      type: 'done',
      data: {
        id: 'chatcmpl-1',
        object: 'chat.completion',
        choices: [{ index: 0, message: { role: 'assistant', content: 'ok' }, finish_reason: 'stop' }],
        usage: { prompt_tokens: 1, completion_tokens: 1, total_tokens: 2 },
      },
    },
  ];
  const made = await call('POST', '/v1/responses', undefined, { model: 'shared', input: 'hi' });
  expect(made.statusCode).toBe(200);
  expect(made.json<ResponseObject>().store).toBe(false);
  expect(store.records.size).toBe(0);
  // Even a record someone stored as "anonymous" is not handed to an anonymous caller.
  const id = 'resp_planted';
  store.records.set(id, {
    owner: 'anonymous',
    model: 'ns-a/shared',
    root: id,
    previous: null,
    depth: 0,
    input: [],
    output: [],
    response: made.json<ResponseObject>(),
  });
  expect((await call('GET', `/v1/responses/${id}`)).statusCode).toBe(404);
  expect((await call('POST', '/v1/responses', undefined, { model: 'shared', input: 'more', previous_response_id: id })).statusCode).toBe(404);
});
