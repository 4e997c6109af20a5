"""The official `openai` Python client against magus dev (test/dev.int.test.ts runs it with the
venv of scripts/python-openai): structured output parsed into pydantic models (one with conint(ge=0),
EmailStr and a pattern), a tool call whose
arguments parse into the function's pydantic model, embeddings, a text completion, chat with
log-probabilities, and a Responses API chain of two turns. Prints one JSON line of what it
got; any failed check exits non-zero with the reason."""
import json
import os
import sys

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
    assert isinstance(person, Person), f"not parsed: {made_up.choices[0].message}"

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

    print(
        json.dumps(
            {
                "openai": openai.__version__,
                "capital": capital.model_dump(),
                "person": person.model_dump(),
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
