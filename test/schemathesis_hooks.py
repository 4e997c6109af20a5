"""schemathesis hooks of test/gateway-fuzz.int.test.ts (the test names this file in SCHEMATHESIS_HOOKS).

The gateway's JSON parser refuses a body with a `__proto__` key, or a `constructor` key holding
`prototype`, at any depth (prototype poisoning: a 400 before any schema is looked at;
gateway/README.md). JSON Schema can say that of every nested value only with a recursive schema of
all JSON, so the OpenAPI description does not, and hypothesis, which puts `__proto__` among the
strings it tries first, would make it a "schema-valid request rejected". Such bodies are left out
of the generated cases; gateway/app.test.ts checks the refusal itself.
"""

import schemathesis


def _poisoned(value, depth=0):
    if depth > 100:
        return False
    if isinstance(value, dict):
        ctor = value.get("constructor")
        if "__proto__" in value or (isinstance(ctor, dict) and "prototype" in ctor):
            return True
        return any(_poisoned(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return any(_poisoned(v, depth + 1) for v in value)
    return False


@schemathesis.hook
def filter_body(context, body):
    return not _poisoned(body)


# What the OpenAPI description cannot say, being rules across fields or about schemas themselves,
# each checked by the gateway with a 400 naming the field (gateway/app.test.ts checks those):
# - structured output's `response_format.json_schema.schema` and a tool's `parameters` are any
#   JSON object to the description, but only schemas whose every constraining keyword the
#   grammar enforces are served (shared/json-schema.ts); a generated schema object is replaced by
#   one the grammar enforces;
# - tool names are unique, a named `tool_choice` names one of them, `required` needs a tool, and a
#   `tool` message answers a call an earlier assistant message made: generated cases are made to
#   agree (a tool result answering nothing becomes a user message);
# - chat's `top_logprobs` needs `logprobs: true`, and log-probabilities come neither with tools
#   nor with a JSON response format: a case asking for both loses its log-probabilities, one with
#   `top_logprobs` alone gets `logprobs: true`;
# - embeddings' `dimensions`: the description allows any size, a model only its own (the stub
#   engine's 8), so a whole number becomes 8;
# - the Responses API (`/v1/responses`) has the same rules in its own
#   spelling: a function tool's `name` and `parameters` sit on the tool itself, a named
#   `tool_choice` is `{"type": "function", "name"}`, structured output's schema is
#   `text.format.schema`, and a `function_call_output` item must answer a `function_call` item
#   before it (or it becomes a user message); log-probabilities (`include`, `top_logprobs`)
#   come neither with tools nor with a JSON format. `previous_response_id` must name a stored response
#   of the caller, which a generated id never does (a 404 `previous_response_not_found`, which
#   gateway/responses.test.ts checks), so it is left out.
# Every other field of a case is still fuzzed; values of the wrong type (negative cases) are left
# as generated.
ENFORCEABLE_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
# test/fixtures/stub-engine.ts STUB_EMBEDDING_DIMENSIONS.
STUB_EMBEDDING_DIMENSIONS = 8


def _function(tool, responses):
    """What holds a tool's name and parameters: chat's `function` object, or a Responses tool itself."""
    if not isinstance(tool, dict):
        return None
    return tool if responses else tool.get("function")


def _answered(items, kind, call_of, answer_of):
    """Items of `kind` answering a call no earlier item made become a user message."""
    calls = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        call = call_of(item)
        if call is not None:
            calls.update(call)
        answered = answer_of(item)
        if isinstance(answered, str) and answered not in calls:
            items[i] = {"role": "user", "content": "x"}


def _agree(body, path):
    responses = path == "/v1/responses"
    fmt = body.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    text = body.get("text")
    if responses and isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("type") == "json_schema":
        spec = text["format"]
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        spec["schema"] = dict(ENFORCEABLE_SCHEMA)
    if responses and isinstance(body.get("previous_response_id"), str):
        del body["previous_response_id"]
    tools = body.get("tools")
    names = []
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            fn = _function(tool, responses)
            if not isinstance(fn, dict):
                continue
            if isinstance(fn.get("parameters"), dict):
                fn["parameters"] = dict(ENFORCEABLE_SCHEMA)
            if isinstance(fn.get("name"), str):
                if fn["name"] in names:
                    fn["name"] = f"tool{i}"
                names.append(fn["name"])
    choice = body.get("tool_choice")
    named = _function(choice, responses) if isinstance(choice, dict) else None
    if isinstance(named, dict) and isinstance(named.get("name"), str):
        if names:
            named["name"] = names[0]
        else:
            body["tool_choice"] = "auto"
    if choice == "required" and not names:
        body["tool_choice"] = "auto"
    if "messages" in body:
        top = body.get("top_logprobs")
        wants = body.get("logprobs") is True or (type(top) is int and top >= 0)
        structured = (names and body.get("tool_choice") != "none") or (isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"))
        if wants and structured:
            body["logprobs"] = False
            body.pop("top_logprobs", None)
        elif type(top) is int and body.get("logprobs") is not True:
            body["logprobs"] = True
    if responses:
        fmt_type = text["format"].get("type") if isinstance(text, dict) and isinstance(text.get("format"), dict) else None
        include = body.get("include")
        wants = (isinstance(include, list) and "message.output_text.logprobs" in include) or type(body.get("top_logprobs")) is int
        if wants and ((names and body.get("tool_choice") != "none") or fmt_type in ("json_object", "json_schema")):
            body.pop("include", None)
            body.pop("top_logprobs", None)
    dims = body.get("dimensions")
    if path == "/v1/embeddings" and type(dims) in (int, float) and dims == int(dims) and dims >= 1:
        body["dimensions"] = STUB_EMBEDDING_DIMENSIONS
    messages = body.get("messages")
    if isinstance(messages, list):
        _answered(
            messages,
            "tool",
            lambda m: [c["id"] for c in m["tool_calls"] if isinstance(c, dict) and isinstance(c.get("id"), str)] if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list) else None,
            lambda m: m.get("tool_call_id") if m.get("role") == "tool" else None,
        )
    items = body.get("input")
    if responses and isinstance(items, list):
        _answered(
            items,
            "function_call_output",
            lambda item: [item["call_id"]] if item.get("type") == "function_call" and isinstance(item.get("call_id"), str) else None,
            lambda item: item.get("call_id") if item.get("type") == "function_call_output" else None,
        )
    return body


@schemathesis.hook
def before_call(context, case, kwargs):
    # Every phase's cases pass here (the coverage phase's bypass map_body); positive and negative
    # alike: what is changed is only what the description cannot say.
    if isinstance(case.body, dict):
        _agree(case.body, case.path)
