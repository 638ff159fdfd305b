"""Drives `slotstream serve` with the official `anthropic` Python client (CI runs this).

Usage: python tools/anthropic_client_test.py SLOTSTREAM_BINARY MODEL_DIR

Checks that messages.create and messages.stream give exactly the text `slotstream
generate` gives (greedy), with the stop reason and usage, and that count_tokens counts
the prompt; that a wrong key raises AuthenticationError; on a copy of the model with
Qwen3's template, a tool round trip (tools, a tool_use turn and its tool_result) reaches
the prompt; on a copy whose template opens a `<think>` block, a thinking block comes back
with a signature that is accepted when sent back and refused when its text is edited; on
a copy with no end of sequence and a queue of one, a second request while a stream runs
raises OverloadedError (529); on the vision fixture, a base64 image block gives `slotstream
generate --image`'s text. Exits non-zero on any mismatch. Pinned client version:
tools/requirements-clients.txt.
"""

import sys
import tempfile

import anthropic

from client_common import (
    IMAGE,
    IMAGE_QUESTION,
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
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


def client_for(base):
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)


def main():
    binary, model = sys.argv[1], sys.argv[2]
    question = "How are experts streamed?"
    want = generate(binary, model, "--prompt", question, "--max-tokens", "16")
    messages = [{"role": "user", "content": question}]
    generated = len(want["output_ids"])
    stop_reason = "max_tokens" if generated == 16 else "end_turn"

    server, base = start(binary, model, "--api-key", KEY)
    try:
        client = client_for(base)
        r = client.messages.create(model="claude-x", max_tokens=16, messages=messages)
        check("text", r.content[0].text, want["text"])
        check("stop_reason", r.stop_reason, stop_reason)
        check("usage output_tokens", r.usage.output_tokens, generated)
        check("usage input tokens", r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0), len(want["prompt_ids"]))
        with client.messages.stream(model="claude-x", max_tokens=16, messages=messages) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        check("streamed text", text, want["text"])
        check("streamed stop_reason", final.stop_reason, stop_reason)
        count = client.messages.count_tokens(model="claude-x", messages=messages)
        check("count_tokens", count.input_tokens, len(want["prompt_ids"]))
        try:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model="m", max_tokens=1, messages=messages
            )
            raise SystemExit("a wrong key was accepted")
        except anthropic.AuthenticationError:
            print("ok: wrong key refused")
    finally:
        stop(server)

    with tempfile.TemporaryDirectory() as tmp:
        server, base = start(binary, model_copy(model, tmp, qwen3_template()), "--api-key", KEY)
        try:
            client = client_for(base)
            plain = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}])
            history = [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C, clear"}]},
            ]
            counted = client.messages.count_tokens(model="m", messages=history, tools=[WEATHER])
            r = client.messages.create(model="m", max_tokens=2, messages=history, tools=[WEATHER])
            check("tool round trip: prompt counted", r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0), counted.input_tokens)
            check("tool round trip: tools and history in the prompt", counted.input_tokens > plain.input_tokens, True)
        finally:
            stop(server)

    with tempfile.TemporaryDirectory() as tmp:
        server, base = start(binary, model_copy(model, tmp, THINKING_TEMPLATE), "--api-key", KEY)
        try:
            client = client_for(base)
            thinking = {"type": "enabled", "budget_tokens": 1024}
            r = client.messages.create(model="m", max_tokens=6, messages=messages, thinking=thinking)
            block = r.content[0]
            check("thinking block", block.type, "thinking")
            check("thinking signature", bool(block.signature), True)
            turn = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": block.thinking, "signature": block.signature},
                    {"type": "text", "text": "ok"},
                ]},
                {"role": "user", "content": "Go on."},
            ]
            r = client.messages.create(model="m", max_tokens=2, messages=turn, thinking=thinking)
            check("thinking block sent back accepted", r.type, "message")
            turn[1]["content"][0]["thinking"] += " edited"
            try:
                client.messages.create(model="m", max_tokens=2, messages=turn, thinking=thinking)
                raise SystemExit("an edited thinking block was accepted")
            except anthropic.BadRequestError:
                print("ok: edited thinking block refused")
        finally:
            stop(server)

    with tempfile.TemporaryDirectory() as tmp:
        server, base = start(binary, model_copy(model, tmp, no_eos=True), "--api-key", KEY, "--queue", "1")
        try:
            client = client_for(base)
            with client.messages.stream(model="m", max_tokens=3000, messages=messages) as s:
                next(iter(s.text_stream))  # the stream holds the queue's one place
                try:
                    client.messages.create(model="m", max_tokens=1, messages=messages)
                    raise SystemExit("a request beyond the queue was accepted")
                except anthropic.OverloadedError as e:
                    check("full queue", e.status_code, 529)
        finally:
            stop(server)
    check_images(binary)


def check_images(binary):
    """A base64 image block before the question gives `slotstream generate --image`'s text."""
    with tempfile.TemporaryDirectory() as tmp:
        model = vision_model(tmp)
        want = generate(binary, model, "--image", IMAGE, "--prompt", IMAGE_QUESTION, "--max-tokens", "8")
        server, base = start(binary, model, "--api-key", KEY)
        try:
            source = {"type": "base64", "media_type": "image/png", "data": image_base64()}
            content = [{"type": "image", "source": source}, {"type": "text", "text": IMAGE_QUESTION}]
            r = client_for(base).messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": content}]
            )
            check("image: text", r.content[0].text if r.content else "", want["text"])
        finally:
            stop(server)


if __name__ == "__main__":
    main()
