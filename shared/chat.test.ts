import { MAX_SCHEMA_BYTES, checkStructure, unsupportedBy } from './chat';

const user = { role: 'user', content: 'hi' };
const fn = (name: string, parameters?: Record<string, unknown>) => ({ type: 'function' as const, function: { name, ...(parameters ? { parameters } : {}) } });
const city = { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] };

describe('checkStructure: the one check of structured output and tools, at the gateway and the engine', () => {
  it('converts the response format and every tool, in order', () => {
    const r = checkStructure({
      messages: [user],
      response_format: { type: 'json_schema', json_schema: { name: 'c', schema: city } },
      tools: [fn('a', city), fn('b')],
    });
    expect(r).toEqual({
      ok: true,
      structure: {
        responseFormat: { type: 'json_schema', schema: expect.objectContaining({ type: 'object' }) as unknown },
        tools: [{ name: 'a', params: expect.objectContaining({ type: 'object' }) as unknown }, { name: 'b' }],
      },
    });
    expect(checkStructure({ messages: [user], response_format: { type: 'json_object' } })).toEqual({
      ok: true,
      structure: { responseFormat: { type: 'json_object' }, tools: [] },
    });
    expect(checkStructure({ messages: [user], response_format: { type: 'text' } })).toEqual({ ok: true, structure: { tools: [] } });
  });

  it.each([
    [
      'a schema the grammar cannot enforce',
      { response_format: { type: 'json_schema' as const, json_schema: { name: 'n', schema: { type: 'string', pattern: '(a)\\1' } } } },
      'response_format.json_schema.schema.pattern',
      'unsupported_schema',
    ],
    [
      'a schema too large',
      { response_format: { type: 'json_schema' as const, json_schema: { name: 'n', schema: { type: 'string', description: 'x'.repeat(MAX_SCHEMA_BYTES) } } } },
      'response_format.json_schema.schema',
      'invalid_value',
    ],
    [
      "a tool's parameters the grammar cannot enforce, even under tool_choice none",
      { tools: [fn('a', { type: 'array', uniqueItems: true })], tool_choice: 'none' as const },
      'tools[0].function.parameters.uniqueItems',
      'unsupported_schema',
    ],
    [
      "a tool's parameters node-llama-cpp's function calling cannot enforce, under tool_choice auto",
      { tools: [fn('a', { type: 'object', properties: { n: { type: 'integer', maximum: 3 } } })] },
      'tools[0].function.parameters.properties.n.maximum',
      'unsupported_schema',
    ],
    ['a tool name given twice', { tools: [fn('a'), fn('a')] }, 'tools[1].function.name', 'invalid_value'],
    [
      'tool_choice naming no tool',
      { tools: [fn('a')], tool_choice: { type: 'function' as const, function: { name: 'b' } } },
      'tool_choice.function.name',
      'invalid_value',
    ],
    ['tool_choice required without tools', { tool_choice: 'required' as const }, 'tool_choice', 'invalid_value'],
    ['top_logprobs without logprobs', { top_logprobs: 2 }, 'top_logprobs', 'invalid_value'],
    ['logprobs with tools offered', { logprobs: true, tools: [fn('a')] }, 'logprobs', 'unsupported_feature'],
  ])('refuses %s, naming the field', (_what, fields, param, code) => {
    const r = checkStructure({ messages: [user], ...fields });
    expect(r).toMatchObject({ ok: false, problem: { param, code } });
  });

  it('a tool result must answer a call an earlier assistant turn made', () => {
    const call = { id: 'c1', type: 'function' as const, function: { name: 'a', arguments: '{}' } };
    const answered = [user, { role: 'assistant', tool_calls: [call] }, { role: 'tool', tool_call_id: 'c1' }];
    expect(checkStructure({ messages: answered, tools: [fn('a')] }).ok).toBe(true);
    expect(checkStructure({ messages: [user, { role: 'tool', tool_call_id: 'c1' }, { role: 'assistant', tool_calls: [call] }] })).toMatchObject({
      ok: false,
      problem: { param: 'messages[1].tool_call_id' },
    });
    expect(checkStructure({ messages: [user, { role: 'tool', tool_call_id: null }] })).toMatchObject({
      ok: false,
      problem: { param: 'messages[1].tool_call_id' },
    });
  });
});

describe('unsupportedBy: what an engine cannot serve, named by the field that asks for it', () => {
  it.each([
    ['response_format', { response_format: { type: 'json_object' as const } }],
    ['tools', { tools: [fn('a')] }],
    ['messages[1]', { messages: [user, { role: 'tool', tool_calls: null }] }],
    ['logprobs', { logprobs: true }],
  ])('distributed-llama refuses %s; llama.cpp serves it', (field, body) => {
    expect(unsupportedBy('dllama', body)).toMatchObject({ field, message: expect.stringContaining("distributed-llama's dllama-api") as unknown });
    expect(unsupportedBy('llamacpp', body)).toBeUndefined();
  });

  it('plain chat, logprobs false and tools under tool_choice none are plain for every engine', () => {
    expect(unsupportedBy('dllama', { messages: [user], logprobs: false })).toBeUndefined();
    expect(checkStructure({ messages: [user], logprobs: true, tools: [fn('a')], tool_choice: 'none' }).ok).toBe(true);
  });
});
