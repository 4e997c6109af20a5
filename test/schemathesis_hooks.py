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


# Structured output's `response_format.json_schema.schema` is any JSON object to the OpenAPI
# description, but the gateway serves only schemas whose every constraining keyword its grammar
# enforces (shared/json-schema.ts; the rest are a 400 `unsupported_schema` naming the keyword:
# shared/json-schema.test.ts and gateway/app.test.ts check that). A description of which schemas
# those are would be a schema of JSON Schema itself. So a generated schema object is replaced by
# one the grammar enforces, and every other field of the case is still fuzzed; a `schema` that is
# not an object (a negative case) is left as generated.
ENFORCEABLE_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}


@schemathesis.hook
def map_body(context, body):
    fmt = body.get("response_format") if isinstance(body, dict) else None
    spec = fmt.get("json_schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        spec["schema"] = dict(ENFORCEABLE_SCHEMA)
    return body
