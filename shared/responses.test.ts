/**
 * The Responses request's translation into chat (shared/responses.ts): input items → messages,
 * instructions, function calls merged into one assistant turn, text.format → response_format,
 * tools → chat tools; and the fields chat's checks name, spelled as the Responses request has them.
 */
import { checkStructure, unsupportedBy } from './chat';
import { chatParamToResponses, chatTextToResponses, inputMessages, pendingResponse, responseFormatOf, toChatTurn, type ResponsesBody } from './responses';

const body = (over: Partial<ResponsesBody>): ResponsesBody => ({ model: 'demo', input: 'hi', ...over });

describe('input items → chat messages', () => {
  it('a string is one user message', () => {
    expect(inputMessages('hello')).toEqual({ messages: [{ role: 'user', content: 'hello' }], origins: ['input'] });
  });

  it('messages keep their role (developer is system), text parts joined; consecutive calls are one assistant turn after its text; outputs are tool messages', () => {
    const { messages, origins } = inputMessages([
      { role: 'developer', content: 'Be brief.' },
      {
        type: 'message',
        role: 'user',
        content: [
          { type: 'input_text', text: 'Weather in ' },
          { type: 'input_text', text: 'Paris and Rome?' },
        ],
      },
      { type: 'message', role: 'assistant', content: [{ type: 'output_text', text: 'Let me look.' }] },
      { type: 'function_call', call_id: 'c1', name: 'weather', arguments: '{"city":"Paris"}' },
      { type: 'function_call', call_id: 'c2', name: 'weather', arguments: '{"city":"Rome"}' },
      { type: 'function_call_output', call_id: 'c1', output: 'sunny' },
      { type: 'function_call_output', call_id: 'c2', output: [{ type: 'input_text', text: 'rain' }] },
      { type: 'function_call', call_id: 'c3', name: 'weather', arguments: '{}' },
    ]);
    expect(messages).toEqual([
      { role: 'system', content: 'Be brief.' },
      { role: 'user', content: 'Weather in Paris and Rome?' },
      {
        role: 'assistant',
        content: 'Let me look.',
        tool_calls: [
          { id: 'c1', type: 'function', function: { name: 'weather', arguments: '{"city":"Paris"}' } },
          { id: 'c2', type: 'function', function: { name: 'weather', arguments: '{"city":"Rome"}' } },
        ],
      },
      { role: 'tool', content: 'sunny', tool_call_id: 'c1' },
      { role: 'tool', content: 'rain', tool_call_id: 'c2' },
      // After a tool result, a call starts a new assistant turn.
      { role: 'assistant', content: '', tool_calls: [{ id: 'c3', type: 'function', function: { name: 'weather', arguments: '{}' } }] },
    ]);
    expect(origins).toEqual(['input[0]', 'input[1]', 'input[2]', 'input[5]', 'input[6]', 'input[7]']);
  });
});

describe('toChatTurn', () => {
  it('instructions lead, then the history, then the input; sampling fields and max_output_tokens as chat has them; nulls left out', () => {
    const history = [
      { role: 'user' as const, content: 'Capital of France?' },
      { role: 'assistant' as const, content: 'Paris.' },
    ];
    const turn = toChatTurn(
      body({ input: 'And Germany?', instructions: 'Be brief.', temperature: 0, top_p: null, max_output_tokens: 16, parallel_tool_calls: null }),
      history,
      true,
    );
    expect(turn.request).toEqual({
      model: 'demo',
      messages: [{ role: 'system', content: 'Be brief.' }, ...history, { role: 'user', content: 'And Germany?' }],
      stream: true,
      temperature: 0,
      max_tokens: 16,
    });
    expect(turn.input).toEqual([{ role: 'user', content: 'And Germany?' }]);
    expect(turn.origins).toEqual(['instructions', 'previous_response_id', 'previous_response_id', 'input']);
  });

  it('function tools and tool_choice become chat’s; text.format its response_format', () => {
    const parameters = { type: 'object', properties: { city: { type: 'string' } } };
    const turn = toChatTurn(
      body({
        tools: [
          { type: 'function', name: 'weather', description: 'Weather now', parameters, strict: true },
          { type: 'function', name: 'time', description: null, parameters: null },
        ],
        tool_choice: { type: 'function', name: 'weather' },
        parallel_tool_calls: false,
        text: { format: { type: 'json_schema', name: 'answer', schema: { type: 'object' }, strict: true } },
      }),
      [],
      false,
    );
    expect(turn.request).toMatchObject({
      tools: [
        { type: 'function', function: { name: 'weather', description: 'Weather now', parameters, strict: true } },
        { type: 'function', function: { name: 'time' } },
      ],
      tool_choice: { type: 'function', function: { name: 'weather' } },
      parallel_tool_calls: false,
      response_format: { type: 'json_schema', json_schema: { name: 'answer', schema: { type: 'object' }, strict: true } },
    });
    expect(toChatTurn(body({ tool_choice: 'required', tools: [] }), [], false).request).toEqual({
      model: 'demo',
      messages: [{ role: 'user', content: 'hi' }],
      stream: false,
      tool_choice: 'required',
    });
  });

  it.each([
    [undefined, undefined],
    [{ type: 'text' as const }, { type: 'text' }],
    [{ type: 'json_object' as const }, { type: 'json_object' }],
    [
      { type: 'json_schema' as const, name: 'n', schema: { type: 'object' } },
      { type: 'json_schema', json_schema: { name: 'n', schema: { type: 'object' } } },
    ],
  ])('text.format %j → response_format %j', (format, expected) => {
    expect(responseFormatOf(format)).toEqual(expected);
  });
});

describe('chat’s refusals, naming the Responses field', () => {
  it('distributed-llama refuses tools, structured output and tool turns: the field is the request’s', () => {
    const turn = (over: Partial<ResponsesBody>) => toChatTurn(body(over), [], false);
    const tools = turn({ tools: [{ type: 'function', name: 'f' }] });
    expect(unsupportedBy('dllama', tools.request)?.field).toBe('tools');
    expect(unsupportedBy('llamacpp', tools.request)).toBeUndefined();
    const format = turn({ text: { format: { type: 'json_object' } } });
    expect(chatParamToResponses(unsupportedBy('dllama', format.request)!.field, format.origins)).toBe('text.format');
    const call = turn({
      input: [
        { role: 'user', content: 'x' },
        { type: 'function_call', call_id: 'c', name: 'f', arguments: '{}' },
      ],
    });
    const refused = unsupportedBy('dllama', call.request)!;
    expect(chatParamToResponses(refused.field, call.origins)).toBe('input[1]');
    expect(chatTextToResponses(refused.message, call.origins)).toMatch(/^`input\[1\]` \(tools\) is not supported/);
    // A tool turn of the chain's history is the previous response's.
    const chained = toChatTurn(
      body({}),
      [{ role: 'assistant', content: '', tool_calls: [{ id: 'c', type: 'function', function: { name: 'f', arguments: '{}' } }] }],
      false,
    );
    expect(chatParamToResponses(unsupportedBy('dllama', chained.request)!.field, chained.origins)).toBe('previous_response_id');
  });

  it("structure problems' params and words", () => {
    const orphan = toChatTurn(body({ instructions: 'x', input: [{ type: 'function_call_output', call_id: 'c9', output: 'r' }] }), [], false);
    const checked = checkStructure(orphan.request);
    expect(checked.ok).toBe(false);
    if (checked.ok) return;
    expect(chatParamToResponses(checked.problem.param, orphan.origins)).toBe('input[0].call_id');
    expect(chatTextToResponses(checked.problem.message, orphan.origins)).toBe("input[0] answers tool call 'c9', which no earlier assistant message made.");
    expect(chatParamToResponses('tools[3].function.parameters.properties.a', [])).toBe('tools[3].parameters.properties.a');
    expect(chatParamToResponses('response_format.json_schema.schema.pattern', [])).toBe('text.format.schema.pattern');
    expect(chatParamToResponses('tool_choice.function.name', [])).toBe('tool_choice.name');
    expect(chatParamToResponses('tool_choice', [])).toBe('tool_choice');
  });
});

describe('pendingResponse', () => {
  it('a background one is created queued, and says so', () => {
    expect(pendingResponse('resp_1', body({ background: true }), 7)).toMatchObject({ status: 'queued', background: true });
  });

  it('echoes the request, with OpenAI’s defaults where it says nothing', () => {
    expect(pendingResponse('resp_1', body({}), 7)).toEqual({
      id: 'resp_1',
      object: 'response',
      background: false,
      created_at: 7,
      status: 'in_progress',
      incomplete_details: null,
      model: 'demo',
      output: [],
      instructions: null,
      max_output_tokens: null,
      temperature: null,
      top_p: null,
      top_logprobs: null,
      tools: [],
      tool_choice: 'auto',
      parallel_tool_calls: true,
      text: { format: { type: 'text' } },
      previous_response_id: null,
      store: true,
      metadata: {},
      usage: null,
      error: null,
    });
  });
});
