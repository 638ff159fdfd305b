"""Drives `slotstream serve` with the official `ollama` Python client (CI runs this).

Usage: python tools/ollama_client_test.py SLOTSTREAM_BINARY MODEL_DIR

Checks that chat and generate, streamed and not, give exactly the text `slotstream
generate` gives (greedy), with Ollama's counts; that list, show and ps describe the
model and /api/version answers; that an image the model's template cannot render is
refused with the client's ResponseError (400); on a copy of the model with Qwen3's template, that tools and a
tool-call history (arguments as objects, `tool_name` on the result) reach the prompt and
that `think=False` renders as `slotstream generate --think off`; and that
`ollama.Client()` with no host finds a server started without `--port`; on the vision
fixture, `images` on chat and generate give `slotstream generate --image`'s text. Exits non-zero
on any mismatch. Pinned client version: tools/requirements-clients.txt.
"""

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import ollama

from client_common import (
    IMAGE,
    IMAGE_QUESTION,
    WEATHER,
    check,
    generate,
    model_copy,
    qwen3_template,
    start,
    stop,
    vision_model,
)



def main():
    binary, model = sys.argv[1], sys.argv[2]
    question = "How are experts streamed?"
    want = generate(binary, model, "--prompt", question, "--max-tokens", "16")
    raw_prompt = "The slot pool"
    raw_want = generate(binary, model, "--raw", "--prompt", raw_prompt, "--max-tokens", "16")
    options = {"num_predict": 16, "temperature": 0}
    messages = [{"role": "user", "content": question}]

    server, base = start(binary, model)
    try:
        client = ollama.Client(host=base)
        r = client.chat(model="m", messages=messages, options=options)
        check("chat text", r.message.content, want["text"])
        check("chat eval_count", r.eval_count, len(want["output_ids"]))
        check("chat prompt_eval_count", r.prompt_eval_count, len(want["prompt_ids"]))
        check("chat done", r.done, True)
        pieces = [c.message.content for c in client.chat(model="m", messages=messages, options=options, stream=True)]
        check("streamed chat text", "".join(pieces), want["text"])

        r = client.generate(model="m", prompt=raw_prompt, raw=True, options=options)
        check("generate raw text", r.response, raw_want["text"])
        pieces = [c.response for c in client.generate(model="m", prompt=question, options=options, stream=True)]
        check("streamed generate text (templated)", "".join(pieces), want["text"])

        name = client.list().models[0].model
        show = client.show(name)
        check("show capabilities", "completion" in show.capabilities, True)
        check("show architecture", show.modelinfo["general.architecture"], "qwen3_next")
        check("ps context", client.ps().models[0].context_length > 0, True)
        with urllib.request.urlopen(f"{base}/api/version") as v:
            check("version", "version" in json.load(v), True)
        try:
            client.chat(model="m", messages=[{"role": "user", "content": "a", "images": [b"not an image"]}])
            raise SystemExit("an image was accepted")
        except ollama.ResponseError as e:
            check("image refused", e.status_code, 400)
    finally:
        stop(server)
    check_tools(binary, model)
    check_default_port(binary, model)
    check_images(binary)


def check_images(binary):
    """`images` (the client sends the file base64) before the text give `slotstream
    generate --image`'s text, on /api/chat and /api/generate."""
    with tempfile.TemporaryDirectory() as tmp:
        model = vision_model(tmp)
        want = generate(binary, model, "--image", IMAGE, "--prompt", IMAGE_QUESTION, "--max-tokens", "8")
        server, base = start(binary, model)
        try:
            client = ollama.Client(host=base)
            options = {"num_predict": 8, "temperature": 0}
            r = client.chat(
                model="m", messages=[{"role": "user", "content": IMAGE_QUESTION, "images": [IMAGE]}], options=options
            )
            check("image: chat text", r.message.content, want["text"])
            r = client.generate(model="m", prompt=IMAGE_QUESTION, images=[IMAGE], options=options)
            check("image: generate text", r.response, want["text"])
        finally:
            stop(server)


def check_tools(binary, model):
    """Tools and thinking through the client, on a copy of the model with Qwen3's template."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = model_copy(model, tmp, qwen3_template())
        question = "Weather in Paris?"
        off_want = generate(binary, copy, "--think", "off", "--prompt", question, "--max-tokens", "4")
        server, base = start(binary, copy)
        try:
            client = ollama.Client(host=base)
            messages = [{"role": "user", "content": question}]
            r = client.chat(model="m", messages=messages, think=False, options={"num_predict": 4})
            check("think=False prompt tokens", r.prompt_eval_count, len(off_want["prompt_ids"]))
            check("think=False text", r.message.content, off_want["text"])
            plain = client.chat(model="m", messages=messages, options={"num_predict": 2})
            history = messages + [
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": "21 C, clear"},
            ]
            r = client.chat(model="m", messages=history, tools=[WEATHER], options={"num_predict": 2})
            check("tools and tool-call history in the prompt", r.prompt_eval_count > plain.prompt_eval_count, True)
        finally:
            stop(server)


def check_default_port(binary, model):
    """`ollama.Client()` with no host reaches a server started with no `--port`."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 11434)) == 0:
            raise SystemExit("port 11434 is already in use: the default-port check cannot run")
    server = subprocess.Popen(
        [binary, "serve", "--model", model, "--device", "cpu", "--pool-slots", "24"],
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                names = [m.model for m in ollama.Client().list().models]
                break
            except Exception as e:  # not yet listening, or still loading (503)
                if server.poll() is not None:
                    raise SystemExit(f"the server exited ({server.returncode})") from e
                time.sleep(0.1)
        else:
            raise SystemExit("no server answered on the default port")
        check("default port: models listed", len(names) > 0, True)
    finally:
        stop(server)


if __name__ == "__main__":
    main()
