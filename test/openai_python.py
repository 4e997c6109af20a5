"""The official `openai` Python client against magus dev (test/dev.int.test.ts runs it with the
venv of scripts/python-openai): structured output parsed into pydantic models (one with conint(ge=0),
EmailStr and a pattern) by chat completions and by the Responses API, tool calls whose
arguments parse into the function's pydantic model (one of them that constrained model),
embeddings, a text completion, chat with log-probabilities, and a Responses API chain of two
turns. Prints one JSON line of what it got; any failed check exits non-zero with the reason."""
import json
import os
import re
import sys

import email_validator
import openai
from pydantic import BaseModel, EmailStr, Field, conint


class Capital(BaseModel):
    country: str
    capital: str


class Person(BaseModel):
    """The keywords pydantic writes for its constrained types: minimum, format email, pattern."""

    name: str = Field(pattern=r"^[A-Z][a-z]+$")
    age: conint(ge=0)
    email: EmailStr


def check_person(raw: str, parsed: object) -> None:
    """The answer's raw JSON holds each keyword itself (not only after pydantic's coercion): an
    integer age >= 0, a name matching the pattern, an email address email-validator accepts."""
    assert isinstance(parsed, Person), f"not parsed: {raw!r}"
    value = json.loads(raw)
    assert type(value["age"]) is int and value["age"] >= 0, f"age: {value!r}"
    assert re.search(r"^[A-Z][a-z]+$", value["name"]), f"name: {value!r}"
    try:
        email_validator.validate_email(value["email"], check_deliverability=False)
    except email_validator.EmailNotValidError as e:
        raise AssertionError(f"email: {value!r}: {e}") from e
    assert Person.model_validate(value) == parsed, f"{value!r} is not {parsed!r}"


class GetWeather(BaseModel):
    """Get the current weather in a city"""

    city: str


def main() -> None:
    client = openai.OpenAI(base_url=os.environ["MAGUS_URL"], api_key=os.environ["MAGUS_TOKEN"], max_retries=0)  # a 429 or 5xx fails, not hidden by a retry

    parsed = client.beta.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=64,
    )
    capital = parsed.choices[0].message.parsed
    assert isinstance(capital, Capital), f"not parsed: {parsed.choices[0].message}"
    assert capital.capital == "Paris", f"capital: {capital!r}"

    # conint(ge=0), EmailStr and a pattern: each enforced by the grammar, so pydantic's own validation passes.
    made_up = client.beta.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "Make up a person: a name, an age and an email address. Answer in JSON."}],
        response_format=Person,
        temperature=0,
        max_tokens=96,
    )
    person = made_up.choices[0].message.parsed
    assert made_up.choices[0].finish_reason == "stop", f"finish_reason: {made_up.choices[0].finish_reason}"
    check_person(made_up.choices[0].message.content, person)

    # The same keywords in a function's parameters (strict), the call forced: magus's grammar
    # generates its arguments (under tool_choice "auto" magus refuses this schema with a 400).
    added = client.beta.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "Make up a person: a name, an age and an email address. Add them to the address book."}],
        tools=[openai.pydantic_function_tool(Person, name="add_person", description="Add a person to the address book")],
        tool_choice={"type": "function", "function": {"name": "add_person"}},
        temperature=0,
        max_tokens=160,
    )
    assert added.choices[0].finish_reason == "tool_calls", f"finish_reason: {added.choices[0].finish_reason}"
    add_call = added.choices[0].message.tool_calls[0].function
    assert add_call.name == "add_person", f"called: {add_call.name}"
    check_person(add_call.arguments, add_call.parsed_arguments)
    try:
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Hi"}],
            tools=[openai.pydantic_function_tool(Person, name="add_person")],
            tool_choice="auto",
        )
        raise AssertionError("a pattern under tool_choice auto was accepted")
    except openai.BadRequestError as e:
        assert (e.code, e.param) == ("unsupported_schema", "tools[0].function.parameters.properties.name.pattern"), f"refused otherwise: {e}"

    called = client.beta.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        temperature=0,
        max_tokens=64,
    )
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls", f"finish_reason: {choice.finish_reason}"
    args = choice.message.tool_calls[0].function.parsed_arguments
    assert isinstance(args, GetWeather), f"arguments not parsed: {choice.message.tool_calls[0]}"
    assert args.city == "Paris", f"city: {args!r}"

    embedded = client.embeddings.create(model="demo", input=["Paris is in France.", "Bananas are yellow."])
    vectors = [d.embedding for d in embedded.data]
    assert [len(v) for v in vectors] == [576, 576], f"sizes: {[len(v) for v in vectors]}"
    assert vectors[0] != vectors[1], "different inputs, equal vectors"

    completion = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2)
    text = completion.choices[0].text
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == text, f"tokens {lp.tokens!r} are not the text {text!r}"
    assert all(len(top) <= 2 for top in lp.top_logprobs), f"top_logprobs: {lp.top_logprobs!r}"

    greedy = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
    )
    content = greedy.choices[0].logprobs.content
    assert all(c.logprob >= max(t.logprob for t in c.top_logprobs) - 1e-6 for c in content), "a greedy token less likely than an alternative"

    first = client.responses.create(model="demo", input="What is the capital of France?", temperature=0, max_output_tokens=32)
    assert first.status == "completed", f"status: {first.status}"
    assert "Paris" in first.output_text, f"first turn: {first.output_text!r}"
    second = client.responses.create(model="demo", input="And of Germany?", previous_response_id=first.id, temperature=0, max_output_tokens=32)
    assert second.previous_response_id == first.id, f"previous_response_id: {second.previous_response_id}"
    assert second.output_text.strip(), "second turn: empty"
    assert second.usage.input_tokens > first.usage.input_tokens, f"second turn without the first: {second.usage}"

    # Structured output by text_format, the constrained model.
    responded = client.responses.parse(
        model="demo",
        input="Make up a person: a name, an age and an email address. Answer in JSON.",
        text_format=Person,
        temperature=0,
        max_output_tokens=96,
    )
    assert responded.status == "completed", f"status: {responded.status}"
    check_person(responded.output_text, responded.output_parsed)

    print(
        json.dumps(
            {
                "openai": openai.__version__,
                "capital": capital.model_dump(),
                "person": person.model_dump(),
                "person_call": add_call.parsed_arguments.model_dump(),
                "person_response": responded.output_parsed.model_dump(),
                "call": args.model_dump(),
                "dimensions": len(vectors[0]),
                "completion": text,
                "logprobs": len(content),
                "responses": {"previous": second.previous_response_id, "cached": second.usage.input_tokens_details.cached_tokens},
            }
        )
    )


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"check failed: {e}", file=sys.stderr)
        sys.exit(1)
