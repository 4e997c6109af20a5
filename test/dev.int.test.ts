/**
 * The main job as a user runs it: `magus dev` (the compiled CLI) brings up the whole system and
 * the demo model, the request it prints works, and Ctrl-C leaves nothing behind.
 */
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import Ajv from 'ajv';
import addFormats from 'ajv-formats';
import OpenAI from 'openai';
import { zodFunction, zodResponseFormat, zodTextFormat } from 'openai/helpers/zod';
import { z } from 'zod';
import { sleep } from './harness/wait';

test('magus dev serves the demo model (curl and kubectl), and SIGINT stops everything it started', async () => {
  // No --port: dev binds the gateway's port itself (a port picked here first could be taken by another test meanwhile).
  const child = spawn(process.execPath, [join(__dirname, '..', 'bin', 'magus.js'), 'dev'], { stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  let err = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr.on('data', (d: Buffer) => (err += d.toString()));
  const exited = new Promise<number | null>((r) => child.once('exit', r));
  try {
    const deadline = Date.now() + 120_000;
    while (!out.includes('Ctrl-C stops everything')) {
      if (child.exitCode !== null || Date.now() > deadline) throw new Error(`magus dev did not get ready:\n${err}`);
      await sleep(250);
    }
    const base = /served at (http:\/\/127\.0\.0\.1:\d+)\/v1/.exec(out)?.[1];
    expect(base).toBeDefined();
    expect(out).toMatch(/Temporal UI: http:\/\/127\.0\.0\.1:\d+/);
    const tokenFile = /API token: +in (\S+)/.exec(out)![1]!;
    expect(out).not.toContain(readFileSync(tokenFile, 'utf8').trim()); // printed by reference only

    // What the printed curl does.
    const res = await fetch(`${base!}/v1/chat/completions`, {
      method: 'POST',
      headers: { authorization: `Bearer ${readFileSync(tokenFile, 'utf8').trim()}`, 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'demo', messages: [{ role: 'user', content: 'Hello!' }], stream: true, max_tokens: 8 }),
    });
    const body = await res.text();
    expect([res.status, res.status === 200 ? '' : body]).toEqual([200, '']);
    expect(body).toContain('"object":"chat.completion.chunk"');
    expect(body.trimEnd().endsWith('data: [DONE]')).toBe(true);

    // The demo is a real model (SmolLM2-135M-Instruct through the pipeline as a GGUF repository):
    // asked with the official client, greedy, it answers right.
    const openai = new OpenAI({ baseURL: `${base!}/v1`, apiKey: readFileSync(tokenFile, 'utf8').trim(), maxRetries: 0 }); // a 429 or 5xx fails here, not hidden by a retry
    const answer = await openai.chat.completions.create({
      model: 'demo',
      messages: [{ role: 'user', content: 'What is the capital of France?' }],
      temperature: 0,
      max_tokens: 32,
    });
    expect(answer.choices[0]?.message.content).toMatch(/\bParis\b/);
    expect(answer.choices[0]?.finish_reason).toBe('stop');

    // Structured output with the client's own helper (a zod schema as json_schema, strict): the
    // grammar makes the structure certain, the model gets the content right.
    const Capital = z.object({ country: z.string(), capital: z.string() });
    const parsed = await openai.chat.completions.parse({
      model: 'demo',
      messages: [{ role: 'user', content: 'What is the capital of France? Answer in JSON.' }],
      response_format: zodResponseFormat(Capital, 'capital'),
      temperature: 0,
      max_tokens: 64,
    });
    // (Greedy, SmolLM2 writes the country in capitals.)
    expect(parsed.choices[0]?.message.parsed).toEqual({ country: expect.stringMatching(/^france$/i) as unknown, capital: 'Paris' });
    // zod's constrained types: .int().min(0), .email() and .regex() become minimum, format and
    // pattern, each enforced by the grammar, so the client's own parse (zod) passes.
    const Person = z.object({ name: z.string().regex(/^[A-Z][a-z]+$/), age: z.number().int().min(0), email: z.string().email() });
    const person = await openai.chat.completions.parse({
      model: 'demo',
      messages: [{ role: 'user', content: 'Make up a person: a name, an age and an email address. Answer in JSON.' }],
      response_format: zodResponseFormat(Person, 'person'),
      temperature: 0,
      max_tokens: 96,
    });
    expect(Person.safeParse(person.choices[0]?.message.parsed)).toMatchObject({ success: true });
    // And checked apart from zod: the answer's raw text under the schema the helper sent (integer,
    // minimum, pattern, format email), by Ajv with ajv-formats in full mode.
    const ajv = new Ajv({ strict: false, allErrors: true });
    addFormats(ajv, { mode: 'full' });
    const validPerson = ajv.compile(zodTextFormat(Person, 'person').schema);
    const isValidPerson = (value: unknown) => ({ valid: validPerson(value), errors: validPerson.errors ?? null });
    expect(person.choices[0]?.finish_reason).toBe('stop');
    expect(isValidPerson(JSON.parse(person.choices[0]!.message.content!))).toEqual({ valid: true, errors: null });
    // The same keywords in a function's parameters (zodFunction: strict, the same schema), the
    // call forced, so magus's grammar generates the arguments (under tool_choice "auto" they are
    // node-llama-cpp's, whose grammar does not enforce these keywords: such a schema is a 400).
    const addPerson = zodFunction({ name: 'add_person', parameters: Person, description: 'Add a person to the address book' });
    const added = await openai.chat.completions.parse({
      model: 'demo',
      messages: [{ role: 'user', content: 'Make up a person: a name, an age and an email address. Add them to the address book.' }],
      tools: [addPerson],
      tool_choice: { type: 'function', function: { name: 'add_person' } },
      temperature: 0,
      max_tokens: 160,
    });
    expect(added.choices[0]?.finish_reason).toBe('tool_calls');
    const addCall = added.choices[0]!.message.tool_calls![0]!;
    if (addCall.type !== 'function') throw new Error(`not a function call: ${JSON.stringify(addCall)}`);
    expect(addCall.function.name).toBe('add_person');
    expect(Person.safeParse(addCall.function.parsed_arguments)).toMatchObject({ success: true });
    expect(isValidPerson(JSON.parse(addCall.function.arguments))).toEqual({ valid: true, errors: null });
    await expect(
      openai.chat.completions.create({ model: 'demo', messages: [{ role: 'user', content: 'Hi' }], tools: [addPerson], tool_choice: 'auto' }),
    ).rejects.toMatchObject({
      status: 400,
      code: 'unsupported_schema',
      param: 'tools[0].function.parameters.properties.name.pattern',
    });
    // JSON mode: an object the model closes itself (asked for a small one: asked to "describe
    // Paris", it adds keys until max_tokens, and a cut object proves nothing).
    const json = await openai.chat.completions.create({
      model: 'demo',
      messages: [{ role: 'user', content: 'Give the name and country of Paris in JSON.' }],
      response_format: { type: 'json_object' },
      temperature: 0,
      max_tokens: 128,
    });
    expect(json.choices[0]?.finish_reason).toBe('stop');
    expect(JSON.parse(json.choices[0]!.message.content!)).toMatchObject({ name: 'Paris' });

    // Tools: a named function is called with arguments that parse (the grammar) and are right
    // (the model), streamed as the client assembles them; the result sent back is answered.
    const weather = {
      type: 'function' as const,
      function: {
        name: 'get_weather',
        description: 'Get the current weather in a city',
        parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
      },
    };
    const ask = { role: 'user' as const, content: 'What is the weather in Paris?' };
    const called = await openai.chat.completions.create({
      model: 'demo',
      messages: [ask],
      tools: [weather],
      tool_choice: { type: 'function', function: { name: 'get_weather' } },
      temperature: 0,
      max_tokens: 64,
    });
    expect(called.choices[0]?.finish_reason).toBe('tool_calls');
    const call = called.choices[0]!.message.tool_calls![0]!;
    expect(call.type === 'function' && JSON.parse(call.function.arguments)).toEqual({ city: 'Paris' });
    const stream = await openai.chat.completions.create({
      model: 'demo',
      messages: [ask],
      tools: [weather],
      tool_choice: 'required',
      temperature: 0,
      max_tokens: 64,
      stream: true,
    });
    let streamedArgs = '';
    for await (const chunk of stream) for (const d of chunk.choices[0]?.delta.tool_calls ?? []) streamedArgs += d.function?.arguments ?? '';
    expect(JSON.parse(streamedArgs)).toEqual({ city: 'Paris' });
    const answered = await openai.chat.completions.create({
      model: 'demo',
      messages: [ask, called.choices[0]!.message, { role: 'tool', tool_call_id: call.id, content: 'Sunny, 21 degrees Celsius' }],
      tools: [weather],
      temperature: 0,
      max_tokens: 48,
    });
    expect(answered.choices[0]?.message.content).toMatch(/21/);

    // Embeddings of the real model (SmolLM2-135M: 576 dimensions), as the SDK asks for them (base64 by default).
    const embedded = await openai.embeddings.create({
      model: 'demo',
      input: ['The capital of France is Paris.', 'Bananas are yellow.', 'The capital of France is Paris.'],
    });
    expect(embedded.data.map((d) => d.index)).toEqual([0, 1, 2]);
    const [paris, bananas, again] = embedded.data.map((d) => d.embedding);
    expect(paris).toHaveLength(576);
    expect(paris!.every(Number.isFinite)).toBe(true);
    expect(again).toEqual(paris);
    expect(bananas).not.toEqual(paris);
    expect(embedded.usage.prompt_tokens).toBeGreaterThan(10);
    const floats = await openai.embeddings.create({ model: 'demo', input: 'Bananas are yellow.', encoding_format: 'float', dimensions: 576 });
    expect(floats.data[0]!.embedding.map((v) => Math.fround(v))).toEqual(bananas);
    await expect(openai.embeddings.create({ model: 'demo', input: 'x', dimensions: 64 })).rejects.toMatchObject({ status: 400, param: 'dimensions' });
    // An answer larger than a NATS message (1 MiB): 256 vectors of 576 as JSON numbers, ~3 MB,
    // sent by the bridge in parts and joined by the gateway; every vector the model's own.
    const many = Array.from({ length: 256 }, (_, i) => (i === 200 ? 'Bananas are yellow.' : `Sentence number ${i} of a long batch.`));
    const large = await openai.embeddings.create({ model: 'demo', input: many, encoding_format: 'float' });
    expect(JSON.stringify(large).length).toBeGreaterThan(1024 * 1024);
    expect(large.data.map((d) => d.index)).toEqual(many.map((_, i) => i));
    expect(large.data.every((d) => d.embedding.length === 576 && d.embedding.every(Number.isFinite))).toBe(true);
    expect(large.data[200]!.embedding.map((v) => Math.fround(v))).toEqual(bananas);

    // Log-probabilities (magus's own token loop): greedy, the same answer as without them, each
    // token the most likely of its alternatives; the tokens' texts are the answer.
    const lp = await openai.chat.completions.create({
      model: 'demo',
      messages: [{ role: 'user', content: 'What is the capital of France?' }],
      temperature: 0,
      max_tokens: 32,
      logprobs: true,
      top_logprobs: 3,
    });
    expect(lp.choices[0]?.message.content).toBe(answer.choices[0]?.message.content);
    const tokens = lp.choices[0]!.logprobs!.content!;
    expect(tokens.map((c) => c.token).join('')).toBe(lp.choices[0]?.message.content);
    for (const c of tokens) {
      expect(c.top_logprobs).toHaveLength(3);
      for (const alt of c.top_logprobs) expect(c.logprob).toBeGreaterThanOrEqual(alt.logprob - 1e-6);
    }

    // Text completions: raw text, no chat template; prompts answered in order, streamed the same.
    const completion = await openai.completions.create({
      model: 'demo',
      prompt: ['The capital of France is', 'The capital of Germany is'],
      max_tokens: 8,
      temperature: 0,
      logprobs: 2,
    });
    expect(completion.choices.map((c) => c.index)).toEqual([0, 1]);
    expect(completion.choices[0]?.text).toMatch(/Paris/);
    expect(completion.choices[1]?.text).toMatch(/Berlin/);
    expect(completion.choices[0]?.logprobs?.tokens?.join('')).toBe(completion.choices[0]?.text);
    expect(completion.usage?.completion_tokens).toBeGreaterThan(0);
    let streamedText = '';
    for await (const c of await openai.completions.create({ model: 'demo', prompt: 'The capital of France is', max_tokens: 8, temperature: 0, stream: true }))
      streamedText += c.choices[0]?.text ?? '';
    expect(streamedText).toBe(completion.choices[0]?.text);

    // The Responses API: a chain of two turns is one conversation, so the second reaches the
    // first's session and instance, whose engine finds the first turn's prompt in its cache.
    // The second turn sees a word only the first gave (asked alone, the model makes a name up).
    // Asked for the name only: a free question lets the small model wander into a story whose
    // narrator has another name, and whether it does turns on its first answer's last words.
    const first = await openai.responses.create({ model: 'demo', input: 'My name is Zorblat.', temperature: 0, max_output_tokens: 32 });
    // (The small model rambles: an answer may be cut by max_output_tokens, `incomplete`.)
    expect(first).toMatchObject({ object: 'response', status: expect.stringMatching(/^(completed|incomplete)$/) as unknown });
    const second = await openai.responses.create({
      model: 'demo',
      input: 'What is my name? Answer with the name only.',
      previous_response_id: first.id,
      temperature: 0,
      max_output_tokens: 32,
    });
    expect(second).toMatchObject({ object: 'response', previous_response_id: first.id });
    expect(second.output_text).toMatch(/Zorblat/);
    const alone = await openai.responses.create({
      model: 'demo',
      input: 'What is my name? Answer with the name only.',
      temperature: 0,
      max_output_tokens: 32,
      store: false,
    });
    expect(alone.output_text).not.toMatch(/Zorblat/);
    expect(second.usage!.input_tokens).toBeGreaterThan(first.usage!.input_tokens);
    expect(second.usage!.input_tokens_details.cached_tokens).toBeGreaterThan(0);
    expect((await openai.responses.retrieve(second.id)).output_text).toBe(second.output_text);
    // Streamed: the deltas are the completed response's text.
    const events = await openai.responses.create({ model: 'demo', input: 'Name three colors.', temperature: 0, max_output_tokens: 32, stream: true });
    let deltas = '';
    let completed: OpenAI.Responses.Response | undefined;
    for await (const event of events) {
      if (event.type === 'response.output_text.delta') deltas += event.delta;
      if (event.type === 'response.completed') completed = event.response;
    }
    expect(deltas.trim()).not.toBe('');
    expect(completed?.output[0]).toMatchObject({ type: 'message', content: [{ type: 'output_text', text: deltas }] });
    // Log-probabilities in a response: each token of the text, greedy-consistent.
    const withLogprobs = await openai.responses.create({
      model: 'demo',
      input: 'What is the capital of France?',
      temperature: 0,
      max_output_tokens: 16,
      include: ['message.output_text.logprobs'],
      top_logprobs: 2,
      store: false,
    });
    const part = withLogprobs.output[0]!.type === 'message' ? withLogprobs.output[0]!.content[0]! : undefined;
    expect(part?.type === 'output_text' && part.logprobs?.map((l) => l.token).join('')).toBe(withLogprobs.output_text);
    for (const l of part?.type === 'output_text' ? (part.logprobs ?? []) : [])
      for (const alt of l.top_logprobs) expect(l.logprob).toBeGreaterThanOrEqual(alt.logprob - 1e-6);
    // Structured output by text.format, with the client's helper.
    const capital = await openai.responses.parse({
      model: 'demo',
      input: 'What is the capital of France? Answer in JSON.',
      text: { format: zodTextFormat(Capital, 'capital') },
      temperature: 0,
      max_output_tokens: 64,
    });
    expect(capital.output_parsed).toEqual({ country: expect.stringMatching(/^france$/i) as unknown, capital: 'Paris' });
    // …and with the constrained Person: parsed by the client's zod, and valid under Ajv.
    const personResponse = await openai.responses.parse({
      model: 'demo',
      input: 'Make up a person: a name, an age and an email address. Answer in JSON.',
      text: { format: zodTextFormat(Person, 'person') },
      temperature: 0,
      max_output_tokens: 96,
    });
    expect(personResponse.status).toBe('completed');
    expect(Person.safeParse(personResponse.output_parsed)).toMatchObject({ success: true });
    expect(isValidPerson(JSON.parse(personResponse.output_text))).toEqual({ valid: true, errors: null });

    // The official Python client too (scripts/python-openai): parse into pydantic models (chat, a forced tool call, a response), embeddings, completions, logprobs, a chain of responses.
    const python = execFileSync(join(__dirname, '..', 'scripts', 'python-openai'), ['--check'], { encoding: 'utf8' }).trim();
    const py = spawnSync(python, [join(__dirname, 'openai_python.py')], {
      env: { ...process.env, MAGUS_URL: `${base!}/v1`, MAGUS_TOKEN: readFileSync(tokenFile, 'utf8').trim() },
      encoding: 'utf8',
      timeout: 60_000,
    });
    expect({ status: py.status, stderr: py.stderr }).toEqual({ status: 0, stderr: '' });
    expect(JSON.parse(py.stdout)).toMatchObject({
      capital: { capital: 'Paris' },
      person: { name: expect.stringMatching(/^[A-Z][a-z]+$/) as unknown, age: expect.any(Number) as unknown, email: expect.stringContaining('@') as unknown },
      call: { city: 'Paris' },
      dimensions: 576,
      responses: { previous: expect.stringMatching(/^resp_/) as unknown },
    });
    // What pydantic parsed (chat, a forced call's arguments, a response), under zod's schema by Ajv too.
    const pyOut = JSON.parse(py.stdout) as Record<'person' | 'person_call' | 'person_response', unknown>;
    for (const key of ['person', 'person_call', 'person_response'] as const)
      expect([key, isValidPerson(pyOut[key])]).toEqual([key, { valid: true, errors: null }]);

    // The kubectl door: the printed command shows the demo model as a Ready resource.
    const kubectlLine = /^ {2}KUBECONFIG=(\S+) kubectl get models$/m.exec(out);
    expect(kubectlLine).not.toBeNull();
    const models = execFileSync('kubectl', ['get', 'models', '--no-headers'], { env: { ...process.env, KUBECONFIG: kubectlLine![1] }, encoding: 'utf8' });
    expect(models).toMatch(/^demo\s+magus-demo\/SmolLM2-135M-Instruct-GGUF\s+Ready\s+100%\s+\S+ \S*B\s+True\s+/m);
  } finally {
    child.kill('SIGINT');
  }
  expect(await exited).toBe(0);
  expect(err).not.toMatch(/while stopping/);
}, 240_000);
