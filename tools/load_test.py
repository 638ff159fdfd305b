#!/usr/bin/env python3
"""Load test of `slotstream serve`: concurrent clients, every answer checked.

Usage: python3 tools/load_test.py SLOTSTREAM_BINARY [--clients 4] [--duration 45]
       [--model DIR] [--report FILE] [--seed N]

Starts `slotstream serve` on a copy of a small model (tests/fixtures/qwen3-next-bf16 by
default) given Qwen3's chat template (tests/fixtures/qwen3-chat, so that tools render),
with the prompt cache on disk (`--prompt-cache-dir`) and small enough in memory and on
disk that both tiers evict, and the experts streamed through a small slot pool. Then
`--clients` threads send requests for `--duration` seconds, each drawn from the MIX
below: repeated prompts and prompts that share a prefix come from drawing among a few
conversations built on a few shared system prompts and completion prefixes.

Checks (any failure exits 1):
- every greedy answer (text, reasoning, tool calls, finish reason, token count) equals a
  single-client run of the same request on a second server with no prompt cache, run
  before the load; a streamed answer (its deltas joined) equals the plain one;
- none lost: every request but the cancelled ones gets a whole answer (a stream ends
  with `data: [DONE]`); no 5xx; malformed bodies get a 4xx with an error body;
- after the warm-up (the first quarter, at least 10 s) the server's RSS stays within
  RSS_SLACK of the warm-up's highest and its open descriptors within the clients' count
  of the warm-up's highest (from /proc); once idle again, its descriptors are as many as
  before the load (within FD_IDLE_SLACK);
- the snapshot files stay within the disk budget (`--prompt-cache-disk`), sampled, and
  the disk tier was read (`disk_hits` > 0).

Prints a summary and writes it as JSON to --report: requests and errors per kind,
p50/p99 latency, the RSS, descriptors and snapshot bytes sampled over time, the
server's /stats at the end.

Every dialect the server speaks is a request kind: OpenAI chat and completions, Ollama's
/api/chat (JSON lines), Anthropic's /v1/messages and the Responses API (named events),
each an Endpoint (its path, the readers of its plain and streamed answers, how a body is
streamed) with the same conversations translated into its shape (in_ollama,
in_anthropic, in_responses) and a row in MIX. Python's standard library only.
"""

import argparse
import http.client
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from client_common import model_copy, qwen3_template

# The request mix: each client draws its next request's kind by weight.
MIX = [
    # kind                 weight  what it sends
    ("chat", 4, "POST /v1/chat/completions: one of 3 system prompts x 6 questions, some with an earlier turn"),
    ("chat_stream", 4, "the same, streamed with usage; the deltas joined must equal the plain answer"),
    ("completion", 3, "POST /v1/completions: one of 3 shared prefixes x 5 tails, some with a stop sequence"),
    ("completion_stream", 3, "the same, streamed"),
    ("tools", 2, "chat with a tool: tool_choice auto/none/required/named, a tool-call history, parallel_tool_calls false"),
    ("tools_stream", 1, "the same, streamed"),
    ("cancel", 2, "a streamed chat whose client hangs up after 0 to 3 chunks"),
    ("ollama", 2, "POST /api/chat: the chat and tool conversations in Ollama's shape (options, tool_name)"),
    ("ollama_stream", 2, "the same, streamed as JSON lines"),
    ("anthropic", 2, "POST /v1/messages: the same conversations in Anthropic's shape (system, tool_use, tool_result)"),
    ("anthropic_stream", 2, "the same, streamed as Anthropic's events"),
    ("responses", 2, "POST /v1/responses: the same conversations as Responses items (instructions, function_call)"),
    ("responses_stream", 2, "the same, streamed as the Responses API's events"),
    ("malformed", 2, "a body the server must refuse with a 4xx: not JSON, wrong types, bad roles, batches, in every dialect"),
]

RSS_SLACK = lambda base: max(16 << 20, base // 20)  # noqa: E731 (16 MiB or 5%)
FD_IDLE_SLACK = 2
MAX_TOKENS = 12
PROMPT_CACHE_MEMORY = "2MiB"
PROMPT_CACHE_DISK = 4 << 20

SYSTEMS = [
    "You are a careful assistant who answers briefly about the slot pool and expert streaming.",
    "You explain Mixture-of-Experts inference to engineers, with numbers where you can.",
    "Answer as a terse systems programmer would, in one or two sentences.",
]
QUESTIONS = [
    "How are experts streamed?",
    "What does the slot pool evict first?",
    "Why pin a record while the GPU reads it?",
    "How big is one expert record?",
    "What is a prefill sweep?",
    "Where do snapshots go after a restart?",
]
PREFIXES = [
    "The slot pool holds expert records read from the SSD. ",
    "In a Mixture-of-Experts layer, the router picks a few experts per token, and ",
    "def read_records(pool, ids):\n    # Reads the missing records at the queue depth\n",
]
TAILS = ["Each", "When a miss", "    for i in ids:", "The CLOCK hand", "Then"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


# ---------------------------------------------------------------------------------------
# Dialects: an endpoint's path and the readers that turn its plain and streamed answers
# into one comparable value.
# ---------------------------------------------------------------------------------------


def openai_stream_body(body):
    return dict(body, stream=True, stream_options={"include_usage": True})


def stream_true(body):
    return dict(body, stream=True)


@dataclass
class Endpoint:
    path: str
    read_plain: object  # (parsed JSON body) -> answer
    read_stream: object  # (HTTPResponse) -> answer, or raises Lost
    stream_body: object = openai_stream_body  # (plain body) -> the streamed request's body


class Lost(Exception):
    """An answer that did not come whole."""


def sse_events(response):
    """The JSON events of an SSE stream; Lost unless it ends with `data: [DONE]`."""
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise Lost("the stream ended without data: [DONE]")


def openai_chat(body):
    choice = body["choices"][0]
    m = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return {
        "content": m.get("content") or "",
        "reasoning": m.get("reasoning_content") or "",
        "tool_calls": calls,
        "finish_reason": choice["finish_reason"],
        "completion_tokens": body["usage"]["completion_tokens"],
    }


def openai_chat_stream(response):
    content, reasoning, calls, finish, tokens = [], [], [], None, None
    for event in sse_events(response):
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            delta = choice.get("delta", {})
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or "")
            for c in delta.get("tool_calls") or []:
                calls.append((c["function"]["name"], c["function"]["arguments"]))
            finish = choice.get("finish_reason") or finish
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "tool_calls": calls,
        "finish_reason": finish,
        "completion_tokens": tokens,
    }


def openai_completion(body):
    choice = body["choices"][0]
    return {
        "text": choice["text"],
        "finish_reason": choice["finish_reason"],
        "completion_tokens": body["usage"]["completion_tokens"],
    }


def openai_completion_stream(response):
    text, finish, tokens = [], None, None
    for event in sse_events(response):
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "finish_reason": finish, "completion_tokens": tokens}


def compact(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def ollama_chat(body):
    m = body["message"]
    return {
        "content": m.get("content") or "",
        "reasoning": m.get("thinking") or "",
        "tool_calls": [(c["function"]["name"], compact(c["function"]["arguments"])) for c in m.get("tool_calls") or []],
        "finish_reason": body["done_reason"],
        "completion_tokens": body["eval_count"],
    }


def ollama_chat_stream(response):
    content, reasoning, calls, last = [], [], [], None
    for raw in response:
        line = json.loads(raw)
        if "error" in line:
            raise Lost(f"status 500: {line['error']}")
        m = line.get("message", {})
        content.append(m.get("content") or "")
        reasoning.append(m.get("thinking") or "")
        calls += [(c["function"]["name"], compact(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
        if line.get("done"):
            last = line
    if last is None:
        raise Lost("the stream ended without a line with done: true")
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "tool_calls": calls,
        "finish_reason": last["done_reason"],
        "completion_tokens": last["eval_count"],
    }


def anthropic_message(body):
    blocks = body["content"]
    return {
        "content": "".join(b["text"] for b in blocks if b["type"] == "text"),
        "reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
        "tool_calls": [(b["name"], compact(b["input"])) for b in blocks if b["type"] == "tool_use"],
        "finish_reason": body["stop_reason"],
        "completion_tokens": body["usage"]["output_tokens"],
    }


def named_events(response):
    """The (event, data) pairs of an SSE stream with named events."""
    name = None
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])


def anthropic_stream(response):
    content, reasoning, calls, inputs, finish, tokens, stopped = [], [], [], {}, None, None, False
    for name, data in named_events(response):
        if name == "error":
            raise Lost(f"status 500: {data}")
        if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
            calls.append((data["index"], data["content_block"]["name"]))
            inputs[data["index"]] = ""
        elif name == "content_block_delta":
            d = data["delta"]
            if d["type"] == "text_delta":
                content.append(d["text"])
            elif d["type"] == "thinking_delta":
                reasoning.append(d["thinking"])
            elif d["type"] == "input_json_delta":
                inputs[data["index"]] += d["partial_json"]
        elif name == "message_delta":
            finish, tokens = data["delta"]["stop_reason"], data["usage"]["output_tokens"]
        elif name == "message_stop":
            stopped = True
    if not stopped:
        raise Lost("the stream ended without message_stop")
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "tool_calls": [(n, compact(json.loads(inputs[i]))) for i, n in calls],
        "finish_reason": finish,
        "completion_tokens": tokens,
    }


def responses_answer(body):
    content, reasoning, calls = [], [], []
    for item in body["output"]:
        if item["type"] == "message":
            content += [p["text"] for p in item["content"]]
        elif item["type"] == "reasoning":
            reasoning += [p["text"] for p in item["content"]]
        elif item["type"] == "function_call":
            calls.append((item["name"], item["arguments"]))
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "tool_calls": calls,
        "finish_reason": body["status"],
        "completion_tokens": body["usage"]["output_tokens"],
    }


def responses_stream(response):
    content, reasoning, calls, final = [], [], [], None
    for name, data in named_events(response):
        if name == "response.output_text.delta":
            content.append(data["delta"])
        elif name == "response.reasoning_text.delta":
            reasoning.append(data["delta"])
        elif name == "response.output_item.done" and data["item"]["type"] == "function_call":
            calls.append((data["item"]["name"], data["item"]["arguments"]))
        elif name in ("response.completed", "response.incomplete"):
            final = data["response"]
        elif name in ("response.failed", "error"):
            raise Lost(f"status 500: {data}")
    if final is None:
        raise Lost("the stream ended without response.completed or response.incomplete")
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "tool_calls": calls,
        "finish_reason": final["status"],
        "completion_tokens": final["usage"]["output_tokens"],
    }


CHAT = Endpoint("/v1/chat/completions", openai_chat, openai_chat_stream)
COMPLETION = Endpoint("/v1/completions", openai_completion, openai_completion_stream)
OLLAMA = Endpoint("/api/chat", ollama_chat, ollama_chat_stream, stream_true)
ANTHROPIC = Endpoint("/v1/messages", anthropic_message, anthropic_stream, stream_true)
RESPONSES = Endpoint("/v1/responses", responses_answer, responses_stream, stream_true)


# ---------------------------------------------------------------------------------------
# Request kinds: the finite set of bodies each draws from, and what is expected.
# ---------------------------------------------------------------------------------------


def chat_bodies():
    out = []
    for s, system in enumerate(SYSTEMS):
        for q, question in enumerate(QUESTIONS):
            messages = [{"role": "system", "content": system}]
            if q % 3 == 2:  # an earlier turn: a longer shared prefix
                messages += [
                    {"role": "user", "content": QUESTIONS[0]},
                    {"role": "assistant", "content": "Through the slot pool."},
                ]
            messages.append({"role": "user", "content": question})
            out.append({"model": "m", "messages": messages, "max_tokens": MAX_TOKENS - s, "temperature": 0})
    return out


def completion_bodies():
    out = []
    for p, prefix in enumerate(PREFIXES):
        for t, tail in enumerate(TAILS):
            body = {"model": "m", "prompt": prefix + tail, "max_tokens": MAX_TOKENS, "temperature": 0}
            if (p + t) % 4 == 0:
                body["stop"] = ["e", "\n"]
            out.append(body)
    return out


def tool_bodies():
    question = [{"role": "user", "content": "Weather in Paris?"}]
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, clear"},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = []
    for messages in [question, history]:
        for choice in ["auto", "none", "required", named]:
            out.append({"model": "m", "messages": messages, "tools": [WEATHER], "tool_choice": choice,
                        "max_tokens": MAX_TOKENS, "temperature": 0})
    out.append({"model": "m", "messages": question, "tools": [WEATHER], "parallel_tool_calls": False,
                "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": MAX_TOKENS, "temperature": 0})
    return out


def in_ollama(body):
    """An OpenAI chat body (as chat_bodies and tool_bodies make them) in Ollama's shape."""
    messages = []
    for m in body["messages"]:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                             "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
            m["content"] = m["content"] or ""
        if m["role"] == "tool":
            m = {"role": "tool", "tool_name": "get_weather", "content": m["content"]}
        messages.append(m)
    out = {"model": "m", "messages": messages, "stream": False,
           "options": {"num_predict": body["max_tokens"], "temperature": 0}}
    if "tools" in body:
        out["tools"] = body["tools"]
    return out


def in_anthropic(body):
    """The same conversation as a Messages body (tool_choice auto)."""
    system, messages = None, []
    for m in body["messages"]:
        if m["role"] == "system":
            system = m["content"]
        elif m.get("tool_calls"):
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})
        elif m["role"] == "tool":
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]})
        else:
            messages.append({"role": m["role"], "content": m["content"]})
    out = {"model": "m", "max_tokens": body["max_tokens"], "messages": messages}
    if system is not None:
        out["system"] = system
    if "tools" in body:
        out["tools"] = [{"name": t["function"]["name"], "description": t["function"]["description"],
                         "input_schema": t["function"]["parameters"]} for t in body["tools"]]
    return out


def in_responses(body):
    """The same conversation as Responses input items (tool_choice auto)."""
    instructions, items = None, []
    for m in body["messages"]:
        if m["role"] == "system":
            instructions = m["content"]
        elif m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    out = {"model": "m", "input": items, "max_output_tokens": body["max_tokens"], "temperature": 0}
    if instructions is not None:
        out["instructions"] = instructions
    if "tools" in body:
        out["tools"] = [{"type": "function", **t["function"]} for t in body["tools"]]
    return out


def dialect_bodies():
    """The chat conversations and the tool conversations whose tool_choice is auto."""
    tools = [b for b in tool_bodies() if b.get("tool_choice") == "auto"]
    return chat_bodies() + tools


MALFORMED = [
    (CHAT, b"{not json"),
    (CHAT, b"[]"),
    (CHAT, b'{"messages": "hi"}'),
    (CHAT, b'{"messages": []}'),
    (CHAT, b'{"messages": [{"role": "wizard", "content": "x"}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}'),
    (COMPLETION, b'{"prompt": "x", "max_tokens": -1}'),
    (COMPLETION, b'{"prompt": "x", "n": 3}'),
    (COMPLETION, b'{"prompt": [[1, 2], [3]]}'),
    (COMPLETION, b'{"prompt": "\xff\xfe"}'),
    (COMPLETION, b'{"prompt": [99999999]}'),
    (COMPLETION, b'{"prompt": "x", "top_p": 7}'),
    (OLLAMA, b"{not json"),
    (OLLAMA, b'{"messages": [{"role": "wizard", "content": "x"}]}'),
    (OLLAMA, b'{"messages": [{"role": "user", "content": "x"}], "options": {"num_predict": 0}}'),
    (ANTHROPIC, b'{"messages": [{"role": "user", "content": "x"}]}'),
    (ANTHROPIC, b'{"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}'),
    (RESPONSES, b'{"input": 5}'),
    (RESPONSES, b'{"input": "x", "previous_response_id": "resp_none"}'),
]


@dataclass
class Kind:
    """What a kind sends (`endpoint`, drawing among `bodies`) and how it runs: `plain`
    and `stream` answers are checked against the reference, `cancel` hangs up part-way,
    `refused` expects a 4xx."""

    endpoint: Endpoint
    bodies: list
    mode: str


def kinds():
    chats, completions, tools = chat_bodies(), completion_bodies(), tool_bodies()
    return {
        "chat": Kind(CHAT, chats, "plain"),
        "chat_stream": Kind(CHAT, chats, "stream"),
        "completion": Kind(COMPLETION, completions, "plain"),
        "completion_stream": Kind(COMPLETION, completions, "stream"),
        "tools": Kind(CHAT, tools, "plain"),
        "tools_stream": Kind(CHAT, tools, "stream"),
        "cancel": Kind(CHAT, chats, "cancel"),
        "ollama": Kind(OLLAMA, [in_ollama(b) for b in dialect_bodies()], "plain"),
        "ollama_stream": Kind(OLLAMA, [in_ollama(b) for b in dialect_bodies()], "stream"),
        "anthropic": Kind(ANTHROPIC, [in_anthropic(b) for b in dialect_bodies()], "plain"),
        "anthropic_stream": Kind(ANTHROPIC, [in_anthropic(b) for b in dialect_bodies()], "stream"),
        "responses": Kind(RESPONSES, [in_responses(b) for b in dialect_bodies()], "plain"),
        "responses_stream": Kind(RESPONSES, [in_responses(b) for b in dialect_bodies()], "stream"),
        "malformed": Kind(None, MALFORMED, "refused"),
    }


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------


def post(port, path, body, timeout=120):
    """Sends `body` (a dict, or bytes as they are); returns the connection and response."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def plain_answer(port, endpoint, body):
    conn, r = post(port, endpoint.path, body)
    try:
        data = r.read()
        if r.status != 200:
            raise Lost(f"status {r.status}: {data[:300]!r}")
        return endpoint.read_plain(json.loads(data))
    finally:
        conn.close()


def key(endpoint, body):
    return endpoint.path + " " + json.dumps(body, sort_keys=True)


# ---------------------------------------------------------------------------------------
# The server and what /proc says of it
# ---------------------------------------------------------------------------------------


def start_server(binary, model, args, log_path):
    log = open(log_path, "w")
    server = subprocess.Popen(
        [binary, "serve", "--model", model, "--device", "cpu", "--port", "0", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    for line in server.stderr:
        log.write(line)
        m = re.search(r"on http://[^:]+:(\d+)", line)
        if m:
            # Keep draining stderr into the log so the server never blocks on a full pipe.
            threading.Thread(target=lambda: [log.write(l) for l in server.stderr], daemon=True).start()
            return server, int(m.group(1))
    raise SystemExit(f"the server exited before listening (status {server.wait()}); log: {log_path}")


def get_json(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def snapshot_bytes(folder):
    return sum(e.stat().st_size for e in os.scandir(folder) if e.name.endswith(".slotsnap"))


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    latencies: list = field(default_factory=list)
    errors: dict = field(default_factory=dict)

    def error(self, what, detail, examples):
        self.errors[what] = self.errors.get(what, 0) + 1
        if len(examples) < 20:
            examples.append(f"{what}: {detail}")


def one_request(port, kind, body, rng, reference):
    """Runs one request; returns None when it went as expected, else (error, detail)."""
    if kind.mode == "refused":
        endpoint, data = body
        conn, r = post(port, endpoint.path, data)
        try:
            text = r.read()
        finally:
            conn.close()
        if not 400 <= r.status < 500:
            return ("5xx" if r.status >= 500 else "status", f"{r.status} for {data[:80]!r}: {text[:200]!r}")
        if "error" not in json.loads(text):
            return ("no error body", f"{data[:80]!r}")
        return None
    if kind.mode == "cancel":
        conn, r = post(port, kind.endpoint.path, kind.endpoint.stream_body(body))
        try:
            if r.status != 200:
                return ("5xx" if r.status >= 500 else "status", f"{r.status}: {r.read()[:200]!r}")
            chunks = rng.randrange(4)
            for raw in r:
                if chunks == 0:
                    break
                if raw.startswith(b"data: "):
                    chunks -= 1
        finally:
            conn.close()  # hangs up mid-stream
        return None
    want = reference[key(kind.endpoint, body)]
    try:
        if kind.mode == "plain":
            got = plain_answer(port, kind.endpoint, body)
        else:
            conn, r = post(port, kind.endpoint.path, kind.endpoint.stream_body(body))
            try:
                if r.status != 200:
                    return ("5xx" if r.status >= 500 else "status", f"{r.status}: {r.read()[:200]!r}")
                got = kind.endpoint.read_stream(r)
            finally:
                conn.close()
    except Lost as e:
        status = re.match(r"status (\d+)", str(e))
        return ("5xx" if status and int(status.group(1)) >= 500 else "lost", str(e))
    if got != want:
        return ("wrong answer", f"{json.dumps(body)[:160]}: got {got!r}, want {want!r}")
    return None


def client(port, table, reference, deadline, seed, tallies, examples, lock):
    rng = random.Random(seed)
    names, weights = [n for n, _, _ in MIX], [w for _, w, _ in MIX]
    while time.monotonic() < deadline:
        name = rng.choices(names, weights=weights)[0]
        kind = table[name]
        body = rng.choice(kind.bodies)
        start = time.monotonic()
        try:
            failure = one_request(port, kind, body, rng, reference)
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            failure = ("lost", f"{type(e).__name__}: {e}")
        elapsed = time.monotonic() - start
        with lock:
            t = tallies[name]
            t.sent += 1
            if failure is None:
                t.ok += 1
                t.latencies.append(elapsed)
            else:
                t.error(*failure, examples)


def percentile(values, p):
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary")
    ap.add_argument("--model", default=os.path.join(here, "..", "tests", "fixtures", "qwen3-next-bf16"))
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration", type=float, default=45, help="seconds of load")
    ap.add_argument("--sample-every", type=float, default=None, help="seconds between /proc samples")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--report", default=None, help="write the summary here as JSON")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(1 << 32)
    sample_every = a.sample_every or max(1.0, a.duration / 60)
    warmup = max(10.0, a.duration / 4)
    print(f"load test: {a.clients} clients, {a.duration:.0f} s, seed {seed}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model = model_copy(a.model, tmp, qwen3_template())
        common = ["--pool-slots", "24", "--queue", str(2 * a.clients + 8)]
        table = kinds()

        # The reference: each distinct request alone, on a server without prompt reuse.
        ref_server, ref_port = start_server(a.binary, model, [*common, "--prompt-cache", "0"],
                                            os.path.join(tmp, "reference.log"))
        reference = {}
        try:
            for name, kind in table.items():
                if kind.mode in ("plain", "stream"):
                    for body in kind.bodies:
                        k = key(kind.endpoint, body)
                        if k not in reference:
                            reference[k] = plain_answer(ref_port, kind.endpoint, body)
        finally:
            ref_server.terminate()
            ref_server.wait()
        distinct = len({json.dumps(v, sort_keys=True) for v in reference.values()})
        if distinct < len(reference) // 2:
            raise SystemExit(f"the reference has {distinct} distinct answers to {len(reference)} requests")
        print(f"reference: {len(reference)} distinct requests, one at a time ({distinct} distinct answers)",
              flush=True)

        snapshots = os.path.join(tmp, "snapshots")
        log_path = os.path.join(tmp, "serve.log")
        server, port = start_server(a.binary, model, [
            *common, "--prompt-cache", PROMPT_CACHE_MEMORY, "--prompt-cache-dir", snapshots,
            "--prompt-cache-disk", f"{PROMPT_CACHE_DISK}B"], log_path)
        failures = []
        try:
            pid = server.pid
            idle_fds_before = open_fds(pid)
            tallies = {name: Tally() for name, _, _ in MIX}
            examples, lock = [], threading.Lock()
            samples = []
            t0 = time.monotonic()
            deadline = t0 + a.duration
            threads = [
                threading.Thread(target=client, args=(port, table, reference, deadline, seed + i, tallies,
                                                      examples, lock))
                for i in range(a.clients)
            ]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                samples.append({
                    "t": round(time.monotonic() - t0, 1),
                    "rss_mib": round(rss_bytes(pid) / (1 << 20), 1),
                    "fds": open_fds(pid),
                    "snapshot_bytes": snapshot_bytes(snapshots),
                })
                for t in threads:
                    t.join(timeout=sample_every / len(threads))
            # Idle again: the connections the clients closed go away.
            for _ in range(50):
                if open_fds(pid) <= idle_fds_before + FD_IDLE_SLACK:
                    break
                time.sleep(0.1)
            idle_fds_after = open_fds(pid)
            stats = get_json(port, "/stats")
            health = get_json(port, "/health")
        finally:
            server.terminate()
            server.wait()
            log_tail = open(log_path).read().splitlines()[-30:]

        # The checks.
        for name, t in tallies.items():
            for what, n in t.errors.items():
                failures.append(f"{name}: {n} x {what}")
        if server.returncode not in (0, -15):
            failures.append(f"the server exited with {server.returncode}")
        warm = [s for s in samples if s["t"] <= warmup]
        after = [s for s in samples if s["t"] > warmup]
        bounds = {}
        if warm and after:
            rss_base = max(s["rss_mib"] for s in warm) * (1 << 20)
            bounds["rss_mib"] = round((rss_base + RSS_SLACK(int(rss_base))) / (1 << 20), 1)
            bounds["fds"] = max(s["fds"] for s in warm) + a.clients
            for s in after:
                if s["rss_mib"] > bounds["rss_mib"]:
                    failures.append(f"RSS {s['rss_mib']} MiB at {s['t']} s, above {bounds['rss_mib']} MiB")
                    break
            for s in after:
                if s["fds"] > bounds["fds"]:
                    failures.append(f"{s['fds']} descriptors at {s['t']} s, above {bounds['fds']}")
                    break
        else:
            failures.append(f"no samples after the {warmup:.0f} s warm-up: run longer")
        if idle_fds_after > idle_fds_before + FD_IDLE_SLACK:
            failures.append(f"idle descriptors: {idle_fds_before} before the load, {idle_fds_after} after")
        over = [s for s in samples if s["snapshot_bytes"] > PROMPT_CACHE_DISK]
        if over or stats["engine"]["prompt_cache"]["disk_bytes"] > PROMPT_CACHE_DISK:
            failures.append(f"snapshot files above the {PROMPT_CACHE_DISK}-byte budget: {over[:3]}")
        if stats["engine"]["prompt_cache"]["disk_hits"] == 0:
            failures.append("the disk tier was never read (disk_hits 0)")
        if health.get("status") not in ("ok", None):
            failures.append(f"/health after the load: {health}")

    every = [x for t in tallies.values() for x in t.latencies]
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    report = {
        "clients": a.clients,
        "duration_s": a.duration,
        "seed": seed,
        "mix": [{"kind": n, "weight": w, "what": d} for n, w, d in MIX],
        "requests": sum(t.sent for t in tallies.values()),
        "errors": sum(sum(t.errors.values()) for t in tallies.values()),
        "latency_ms": {"p50": ms(percentile(every, 50)), "p99": ms(percentile(every, 99))},
        "kinds": {
            n: {"sent": t.sent, "ok": t.ok, "errors": t.errors,
                "p50_ms": ms(percentile(t.latencies, 50)), "p99_ms": ms(percentile(t.latencies, 99))}
            for n, t in tallies.items()
        },
        "warmup_s": warmup,
        "bounds": bounds,
        "idle_fds": {"before": idle_fds_before, "after": idle_fds_after},
        "samples": samples,
        "stats": stats,
        "failures": failures,
        "examples": examples,
    }
    if a.report:
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{report['requests']} requests, {report['errors']} errors, "
          f"p50 {report['latency_ms']['p50']} ms, p99 {report['latency_ms']['p99']} ms")
    for n, k in report["kinds"].items():
        print(f"  {n:18} {k['sent']:6} sent {k['ok']:6} ok  p50 {k['p50_ms']} ms  p99 {k['p99_ms']} ms  {k['errors'] or ''}")
    step = max(1, len(samples) // 10)
    print("  RSS MiB over time: " + ", ".join(f"{s['t']:.0f}s {s['rss_mib']}" for s in samples[::step]))
    print("  descriptors over time: " + ", ".join(f"{s['t']:.0f}s {s['fds']}" for s in samples[::step]))
    print(f"  bounds after the {warmup:.0f} s warm-up: {bounds}; idle descriptors {idle_fds_before} -> {idle_fds_after}")
    print(f"  prompt cache: {stats['engine']['prompt_cache']}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures + examples[:10]))
        print("server log, last lines:\n  " + "\n  ".join(log_tail))
        sys.exit(1)
    print("ok: no errors, nothing lost, no 5xx, RSS and descriptors flat")


if __name__ == "__main__":
    main()
