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
