"""Drives `slotstream serve` with the official OpenAI Python client (CI runs this).

Usage: python tools/openai_client_test.py SLOTSTREAM_BINARY MODEL_DIR

Starts the server on a free loopback port with an API key, then checks that chat and
text completions, streamed and not, give exactly the text `slotstream generate` gives
for the same prompt (greedy), that usage and the `slotstream_stats` extra come back,
and that a wrong key raises the client's AuthenticationError. Exits non-zero on any
mismatch. Pinned client version: tools/requirements-openai.txt.
"""

import json
import re
import subprocess
import sys
import threading

import openai

KEY = "ci-key"


def generate(binary, model, *args):
    out = subprocess.run(
        [binary, "generate", "--model", model, "--device", "cpu", "--json", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def start(binary, model):
    server = subprocess.Popen(
        [binary, "serve", "--model", model, "--device", "cpu", "--port", "0", "--api-key", KEY, "--pool-slots", "24"],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in server.stderr:
        sys.stderr.write(line)
        m = re.search(r"on (http://\S+/v1)", line)
        if m:
            # Keep draining stderr so the server never blocks on a full pipe.
            threading.Thread(target=lambda: [sys.stderr.write(l) for l in server.stderr], daemon=True).start()
            return server, m.group(1)
    raise SystemExit(f"the server exited before listening (status {server.wait()})")


def check(what, got, want):
    if got != want:
        raise SystemExit(f"{what}: got {got!r}, want {want!r}")
    print(f"ok: {what}")


def main():
    binary, model = sys.argv[1], sys.argv[2]
    question = "How are experts streamed?"
    chat_want = generate(binary, model, "--prompt", question, "--max-tokens", "16")
    raw_prompt = "The slot pool"
    text_want = generate(binary, model, "--raw", "--prompt", raw_prompt, "--max-tokens", "16")

    server, base = start(binary, model)
    try:
        client = openai.OpenAI(base_url=base, api_key=KEY)
        name = client.models.list().data[0].id
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

        bad = openai.OpenAI(base_url=base, api_key="wrong")
        try:
            bad.models.list()
            raise SystemExit("a wrong API key was accepted")
        except openai.AuthenticationError:
            print("ok: wrong key refused")
        try:
            client.chat.completions.create(model="no-such-model", messages=messages)
            raise SystemExit("an unknown model was accepted")
        except openai.NotFoundError:
            print("ok: unknown model refused")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
