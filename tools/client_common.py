"""What the official-client checks share: `slotstream generate --json` as the reference,
a `slotstream serve` on a free loopback port, and a check that prints what it confirmed.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))

# A tool every check gives the model, in OpenAI's chat shape.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def qwen3_template():
    """Qwen3's real chat template (tests/fixtures/qwen3-chat), which renders tools."""
    with open(os.path.join(HERE, "..", "tests", "fixtures", "qwen3-chat", "tokenizer_config.json")) as f:
        return json.load(f)["chat_template"]


# A chat template that renders images as Qwen3.5's does (tests/integration/vision.rs).
IMAGE_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for item in message.content %}"
    "{%- if item.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
VISION_FIXTURE = os.path.join(HERE, "..", "tests", "fixtures", "qwen3_5-moe-vision")
# A picture of the vision fixture: 64 x 160 pixels, 10 tokens at the processor's bounds.
IMAGE = os.path.join(VISION_FIXTURE, "image1.png")
IMAGE_QUESTION = "What is in the picture?"


def vision_model(tmp):
    """A copy of the vision fixture (a small random tower on the Qwen3.5-MoE text fixture)
    with a template that renders images, and the reference `slotstream generate --image`
    gives for IMAGE before IMAGE_QUESTION (8 tokens)."""
    return model_copy(VISION_FIXTURE, tmp, IMAGE_TEMPLATE)


def image_base64():
    import base64

    with open(IMAGE, "rb") as f:
        return base64.b64encode(f.read()).decode()


def model_copy(model, tmp, template=None, no_eos=False):
    """A copy of `model` in `tmp` with `template` as its chat template and, with `no_eos`,
    no end of sequence (its streams run to their token limit)."""
    copy = os.path.join(tmp, "model")
    shutil.copytree(model, copy)
    if template is not None:
        with open(os.path.join(copy, "chat_template.jinja"), "w") as f:
            f.write(template)
    if no_eos:
        for name, key in [("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                          ("tokenizer_config.json", "eos_token")]:
            path = os.path.join(copy, name)
            if os.path.exists(path):
                with open(path) as f:
                    cfg = json.load(f)
                if name == "config.json":
                    cfg[key] = []
                else:
                    cfg.pop(key, None)
                with open(path, "w") as f:
                    json.dump(cfg, f)
    return copy


def generate(binary, model, *args):
    """`slotstream generate --json` on the CPU: the reference text and ids."""
    out = subprocess.run(
        [binary, "generate", "--model", model, "--device", "cpu", "--json", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def start(binary, model, *args):
    """`slotstream serve` on a free port; returns the process and its base URL
    (`http://127.0.0.1:PORT`, without a path)."""
    server = subprocess.Popen(
        [binary, "serve", "--model", model, "--device", "cpu", "--port", "0", "--pool-slots", "24", *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in server.stderr:
        sys.stderr.write(line)
        m = re.search(r"on (http://[^\s/]+)", line)
        if m:
            # Keep draining stderr so the server never blocks on a full pipe.
            threading.Thread(target=lambda: [sys.stderr.write(l) for l in server.stderr], daemon=True).start()
            return server, m.group(1)
    raise SystemExit(f"the server exited before listening (status {server.wait()})")


def stop(server):
    server.terminate()
    server.wait()


def check(what, got, want):
    if got != want:
        raise SystemExit(f"{what}: got {got!r}, want {want!r}")
    print(f"ok: {what}")
