"""What the official-client checks share: `slotstream generate --json` as the reference,
a `slotstream serve` on a free loopback port, and a check that prints what it confirmed.
"""

import json
import re
import subprocess
import sys
import threading


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
