"""Drives `slotstream serve` with the official OpenAI Python client (CI runs this): chat
and text completions and the Responses API.

Usage: python tools/openai_client_test.py SLOTSTREAM_BINARY MODEL_DIR

Starts the server on a free loopback port with an API key, then checks that chat and
text completions, streamed and not, give exactly the text `slotstream generate` gives
for the same prompt (greedy), as does `responses.create` and `responses.stream`, that usage and the `slotstream_stats` extra come back,
that any model name is served, and that a wrong key raises the client's
AuthenticationError. Then, on a copy of the model with Qwen3's chat template
(tests/fixtures/qwen3-chat), the client's tool fields: tools with a tool-call history
(`arguments` as a JSON string) and tool results, every `tool_choice`, and
`chat_template_kwargs` through `extra_body`, a Responses function call round trip
(`function_call` and `function_call_output` items) against the same chat history and a
follow-up through `previous_response_id`, their prompt tokens against `slotstream
generate --think off`; a required call's opening continued by the random model, constrained
to the tool's schema, is a valid call (or text when max_tokens cuts it). Last, constrained
output and log-probabilities: `chat.completions.parse` with a Pydantic model (the reply
parses into it), and `logprobs=True, top_logprobs=5`, whole and streamed (and the same values
through `responses.create` and `responses.stream` with `include`). Then images, on the
vision fixture: an `image_url` data URL and a Responses `input_image` give `slotstream
generate --image`'s text, and an http URL is a 400. Exits non-zero
on any mismatch. Pinned client version:
tools/requirements-clients.txt.
"""

import json
import sys
import tempfile

import openai
from pydantic import BaseModel, Field
from typing import Literal

from client_common import (
    IMAGE,
    IMAGE_QUESTION,
    WEATHER,
    check,
    generate,
    image_base64,
    model_copy,
    qwen3_template,
    start,
    stop,
    vision_model,
)

KEY = "ci-key"


def main():
    binary, model = sys.argv[1], sys.argv[2]
    question = "How are experts streamed?"
    chat_want = generate(binary, model, "--prompt", question, "--max-tokens", "16")
    raw_prompt = "The slot pool"
    text_want = generate(binary, model, "--raw", "--prompt", raw_prompt, "--max-tokens", "16")

    server, base = start(binary, model, "--api-key", KEY)
    base += "/v1"
    try:
        client = openai.OpenAI(base_url=base, api_key=KEY)
        name = client.models.list().data[0].id
        check("models.retrieve", client.models.retrieve(name).id, name)
        messages = [{"role": "user", "content": question}]

        r = client.chat.completions.create(
            model=name, messages=messages, max_tokens=16, temperature=0, extra_body={"slotstream_stats": True}
        )
        check("chat text", r.choices[0].message.content, chat_want["text"])
        check("chat usage", r.usage.completion_tokens, len(chat_want["output_ids"]))
        check("chat stats present", "hit_rate" in r.model_extra["slotstream_stats"], True)

        stream = client.chat.completions.create(
            model=name, messages=messages, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        check("streamed chat text", "".join(pieces), chat_want["text"])
        check("streamed chat usage", usage.prompt_tokens, len(chat_want["prompt_ids"]))

        r = client.completions.create(model=name, prompt=raw_prompt, max_tokens=16, temperature=0)
        check("completion text", r.choices[0].text, text_want["text"])

        stream = client.completions.create(model=name, prompt=raw_prompt, max_tokens=16, temperature=0, stream=True)
        check("streamed completion text", "".join(c.choices[0].text for c in stream), text_want["text"])

        # The Responses API: the same text, whole and streamed.
        r = client.responses.create(model=name, input=question, max_output_tokens=16, temperature=0)
        check("responses text", r.output_text, chat_want["text"])
        check("responses usage", r.usage.input_tokens, len(chat_want["prompt_ids"]))
        with client.responses.stream(model=name, input=question, max_output_tokens=16, temperature=0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        check("streamed responses text", "".join(deltas), chat_want["text"])

        bad = openai.OpenAI(base_url=base, api_key="wrong")
        try:
            bad.models.list()
            raise SystemExit("a wrong API key was accepted")
        except openai.AuthenticationError:
            print("ok: wrong key refused")
        r = client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)
        check("any model name served and echoed", r.model, "no-such-model")
    finally:
        stop(server)
    check_tools(binary, model)
    check_constrained(binary, model)
    check_images(binary)


def check_images(binary):
    """An image as a data URL in a chat `image_url` part and a Responses `input_image`
    gives `slotstream generate --image`'s text; an http(s) URL is a 400."""
    with tempfile.TemporaryDirectory() as tmp:
        model = vision_model(tmp)
        want = generate(binary, model, "--image", IMAGE, "--prompt", IMAGE_QUESTION, "--max-tokens", "8")
        server, base = start(binary, model)
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none")
            url = "data:image/png;base64," + image_base64()
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": IMAGE_QUESTION}]
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
            )
            check("image: chat text", r.choices[0].message.content, want["text"])
            check("image: chat prompt tokens", r.usage.prompt_tokens, len(want["prompt_ids"]))
            r = client.responses.create(
                model="m",
                input=[{"role": "user", "content": [
                    {"type": "input_image", "image_url": url}, {"type": "input_text", "text": IMAGE_QUESTION}]}],
                max_output_tokens=8,
                temperature=0,
            )
            check("image: responses text", r.output_text, want["text"])
            try:
                web = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": web}], max_tokens=2)
                raise SystemExit("an http image URL was accepted")
            except openai.BadRequestError as e:
                check("image: an http URL is a 400 naming data URLs", "data: URL" in str(e), True)
        finally:
            stop(server)


class City(BaseModel):
    """What `chat.completions.parse` asks for (the client sends its strict JSON schema)."""

    name: Literal["Paris", "Oslo", "Rome"]
    population: int = Field(ge=0, le=999)
    coastal: bool


def check_constrained(binary, model):
    """A Pydantic response_format and logprobs through the client, on the random model."""
    server, base = start(binary, model, "--api-key", KEY)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY)
        messages = [{"role": "user", "content": "A city, as JSON."}]
        for seed in range(3):
            r = client.chat.completions.parse(
                model="m", messages=messages, response_format=City, max_tokens=200, temperature=1.0, seed=seed
            )
            check("parsed finish", r.choices[0].finish_reason, "stop")
            check("parsed into the model", isinstance(r.choices[0].message.parsed, City), True)
        print(f"ok: response_format {City.__name__}: {r.choices[0].message.parsed!r}")

        r = client.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
        )
        content = r.choices[0].logprobs.content
        check("one logprob per token", len(content), r.usage.completion_tokens)
        for entry in content:
            top = entry.top_logprobs
            check("top_logprobs count", len(top), 5)
            check("top_logprobs sorted", all(a.logprob >= b.logprob for a, b in zip(top, top[1:])), True)
            check("greedy picks the most probable", entry.token, top[0].token)
            check("bytes are the token's", bytes(entry.bytes).decode("utf-8", "replace"), entry.token)
        stream = client.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5, stream=True
        )
        streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        check("streamed logprobs", [(e.token, e.logprob) for e in streamed], [(e.token, e.logprob) for e in content])
        print("ok: logprobs=True, top_logprobs=5, whole and streamed")

        # The Responses dialect: the same greedy tokens with the same values.
        include = ["message.output_text.logprobs"]
        r = client.responses.create(
            model="m", input=messages, max_output_tokens=8, temperature=0, top_logprobs=5, include=include
        )
        part = r.output[0].content[0]
        want = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in content]
        got = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in part.logprobs]
        check("responses logprobs", got, want)
        with client.responses.stream(
            model="m", input=messages, max_output_tokens=8, temperature=0, top_logprobs=5, include=include
        ) as stream:
            deltas = [(e.token, e.logprob) for ev in stream if ev.type == "response.output_text.delta" for e in ev.logprobs]
        check("streamed responses logprobs", deltas, [w[:2] for w in want])
        print("ok: responses include=message.output_text.logprobs, top_logprobs=5, whole and streamed")
    finally:
        stop(server)




def check_tools(binary, model):
    """Tool fields through the client, on a copy of the model with Qwen3's template."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = model_copy(model, tmp, qwen3_template())
        question = "Weather in Paris?"
        off_want = generate(binary, copy, "--think", "off", "--prompt", question, "--max-tokens", "4")
        server, base = start(binary, copy, "--api-key", KEY)
        base += "/v1"
        try:
            client = openai.OpenAI(base_url=base, api_key=KEY)
            messages = [{"role": "user", "content": question}]
            r = client.chat.completions.create(
                model="m", messages=messages, max_tokens=4,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            check("chat_template_kwargs prompt tokens", r.usage.prompt_tokens, len(off_want["prompt_ids"]))
            check("chat_template_kwargs text", r.choices[0].message.content, off_want["text"])

            history = messages + [
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C, clear"},
            ]
            plain = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
            for choice in ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]:
                r = client.chat.completions.create(
                    model="m", messages=history, tools=[WEATHER], tool_choice=choice, max_tokens=4
                )
                if r.usage.prompt_tokens <= plain.usage.prompt_tokens:
                    raise SystemExit(f"tool_choice {choice}: tools and history not in the prompt")
                print(f"ok: tools, tool-call history, tool_choice {json.dumps(choice)}")

            # A function call round trip through the Responses API renders as the chat
            # history above does, and a follow-up continues the stored response.
            items = [
                {"role": "user", "content": question},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": json.dumps({"city": "Paris"})},
                {"type": "function_call_output", "call_id": "call_1", "output": "21 C, clear"},
            ]
            function = {"type": "function", **WEATHER["function"]}
            chat = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=2)
            r = client.responses.create(model="m", input=items, tools=[function], max_output_tokens=2)
            check("responses function call round trip prompt", r.usage.input_tokens, chat.usage.prompt_tokens)
            r2 = client.responses.create(
                model="m", input="And tomorrow?", previous_response_id=r.id, tools=[function], max_output_tokens=2
            )
            check("previous_response_id continues", r2.usage.input_tokens > r.usage.input_tokens, True)

            named = {"type": "function", "function": {"name": "get_weather"}}
            r = client.chat.completions.create(
                model="m", messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=6,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            opening = '<tool_call>\n{"name": "get_weather", "arguments": '
            message = r.choices[0].message
            # 6 tokens seldom finish the (constrained) call: then it is text.
            if message.tool_calls is None:
                check("a required call's opening starts the reply", message.content.startswith(opening), True)
            stream = client.chat.completions.create(
                model="m", messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=6, stream=True,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            pieces, calls = [], []
            for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta and delta.content:
                    pieces.append(delta.content)
                if delta and delta.tool_calls:
                    calls.extend(delta.tool_calls)
            check("streamed, the same text", "".join(pieces), message.content or "")
            check("streamed, the same calls", len(calls), len(message.tool_calls or []))
        finally:
            stop(server)


if __name__ == "__main__":
    main()
