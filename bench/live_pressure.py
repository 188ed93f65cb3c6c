"""A live agent's engine under many clients: its step rate, alone and while clients ask,
and its memory (RSS) under misbehaving clients.

    python bench/live_pressure.py [--clients 64] [--kinds checksum,list,fetch] [--rounds 2]
    python bench/live_pressure.py --misbehave non-reading [--clients 64] [--fetch-mib 32]

An engine process steps (a matrix product and a block rewrite each step, then
``agent.poll()``) and prints its step count. Without ``--misbehave`` its cache holds
``--requests`` requests of ``--request-blocks`` blocks each (2,048 of 128 by default,
8 KiB blocks), and the engine's steps per second are measured in windows of
``--seconds``, alternating: alone, then while ``--clients`` clients each loop over one
kind of request, then alone again, for each kind:

- ``checksum``: each asks for the checksums of every request (``{"op": "checksum"}``);
- ``list``: each asks for the listing of every request;
- ``fetch``: each fetches one block of a request (a different one each time).

Clients read each reply whole and ask again (a "busy" reply: again after 5 ms). Printed
per window: steps per second, the longest step (a poll included), the replies the
clients got (answers, errors); per kind, the ratio of its rate to the mean of the two
windows alone beside it (this machine's noise cancels in the ratio of neighbouring
windows). ``--json`` prints them as JSON.

With ``--misbehave`` the cache holds one request of ``--fetch-mib`` MiB (128 KiB blocks)
and ``--clients`` clients misbehave while the engine's RSS and steps are measured:

- ``non-reading``: each fetches the whole request (a ``--fetch-mib`` MiB payload) and
  never reads the reply;
- ``slow``: each sends half a request and stalls;
- ``queued``: each sends a whole small request and waits, in an engine that polls.

``--held-mib``, ``--poll-mib`` and ``--poll-share`` set the agent's ``max_held_bytes``,
``max_poll_bytes`` and ``poll_share`` (its defaults when not given).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK = 16
RATE_SHAPE = (2, 64, "float16")
"""Heads, head size and dtype of the step-rate engine's blocks: 8 KiB a block."""
MEMORY_SHAPE = (8, 128, "float32")
"""The same for the memory engine: 128 KiB a block, a large fetch in few blocks."""
ROWS = 4096
"""The step-rate engine's cache rows; its requests' blocks cycle over them."""


def block_bytes(heads: int, head_size: int, dtype: str) -> int:
    """One block of the engine's one layer: 16 tokens of K and V of every head."""
    return BLOCK * heads * 2 * head_size * (2 if dtype == "float16" else 4)


def serve(args: argparse.Namespace) -> None:
    """The engine: step, poll, and print ``steps N LONGEST`` every 0.1 s until stdin
    closes (``LONGEST``: the longest step since the last line, in seconds)."""
    import torch

    from kvaudit import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.live import Agent

    torch.set_num_threads(1)  # an engine's step on one core: steadier than a shared pool
    heads, head_size, dtype = MEMORY_SHAPE if args.misbehave else RATE_SHAPE
    size = block_bytes(heads, head_size, dtype)
    tables: dict[str, RequestBlocks] = {}
    if args.misbehave:
        big = max(1, (args.fetch_mib << 20) // size)
        rows = big + 8
        tables["big"] = RequestBlocks(big * BLOCK, {0: (0, list(range(big)))})
    else:
        rows = ROWS + 8
        per = args.request_blocks
        for number in range(args.requests):
            ids = [(number * per + i) % ROWS for i in range(per)]
            tables[f"r{number}"] = RequestBlocks(per * BLOCK, {0: (0, ids)})
    cache = torch.randn(rows, heads, BLOCK, 2 * head_size).to(getattr(torch, dtype))
    spec = {"type": "full_attention", "block_size": BLOCK, "num_kv_heads": heads,
            "head_size": head_size, "dtype": dtype, "layout": "NHTC"}  # fmt: skip
    description = parse_description(
        {
            "kvaudit": 1,
            "num_blocks": rows,
            "groups": [{"spec": spec, "layers": ["model.layers.0.attn"]}],
        },
        "engine",
    )
    options: dict[str, float] = {}
    if args.poll_share is not None:
        options["poll_share"] = args.poll_share
    if args.held_mib is not None:
        options["max_held_bytes"] = args.held_mib << 20
    if args.poll_mib is not None:
        options["max_poll_bytes"] = args.poll_mib << 20
    agent = Agent(
        args.serve, description, {"model.layers.0.attn": cache}, lambda: tables, **options
    )
    weights = torch.randn(256, 256)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print("ready", flush=True)
    steps, longest = 0, 0.0
    last = previous = time.monotonic()
    try:
        while not done.is_set():
            (weights @ weights).sum()
            cache[rows - 1 - steps % 8].normal_()
            agent.poll()
            steps += 1
            now = time.monotonic()
            longest, previous = max(longest, now - previous), now
            if now - last >= 0.1:
                print(f"steps {steps} {longest:.6f}", flush=True)
                last, longest = now, 0.0
    finally:
        agent.close()


def rss_mib(pid: int) -> float:
    """A process's resident memory in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class EngineProcess:
    """The engine in a process of its own; its step count read from its output."""

    def __init__(self, socket_path: str, args: argparse.Namespace) -> None:
        command = [sys.executable, __file__, "--serve", socket_path]
        for flag, value in (
            ("--fetch-mib", args.fetch_mib),
            ("--held-mib", args.held_mib),
            ("--poll-mib", args.poll_mib),
            ("--poll-share", args.poll_share),
            ("--requests", args.requests),
            ("--request-blocks", args.request_blocks),
            ("--misbehave", args.misbehave),
        ):
            if value is not None:
                command += [flag, str(value)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the engine did not start: {line!r}")
        self.steps = 0
        self.longest = 0.0
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("steps "):
                _, steps, longest = line.split()
                with self._lock:
                    self.steps = int(steps)
                    self.longest = max(self.longest, float(longest))

    def window(self, seconds: float) -> dict[str, float]:
        """Steps, steps per second and the longest step over ``seconds``, and the largest
        RSS seen (MiB)."""
        with self._lock:
            start_steps, self.longest = self.steps, 0.0
        start = time.monotonic()
        peak = rss_mib(self.process.pid)
        while time.monotonic() - start < seconds:
            time.sleep(0.05)
            peak = max(peak, rss_mib(self.process.pid))
        with self._lock:
            steps, longest = self.steps - start_steps, self.longest
        rate = steps / (time.monotonic() - start)
        return {"steps": steps, "steps_per_s": rate, "longest_step_s": longest, "rss_mib": peak}

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def frame(message: dict) -> bytes:
    text = json.dumps(message).encode()
    return struct.pack(">IQ", len(text), 0) + text


def ask(path: str, request: bytes, timeout: float) -> str:
    """One request on a fresh connection, its reply read whole: ``answered``, the error
    reply's first words, or what went wrong."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        data = bytearray()
        try:
            sock.connect(path)
            sock.sendall(request)
            while True:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        except OSError as error:
            return f"no reply: {type(error).__name__}"
    if len(data) < 12:
        return "no reply: closed"
    size, _ = struct.unpack(">IQ", data[:12])
    text = bytes(data[12 : 12 + size])
    if text.startswith(b'{"ok":true'):
        return "answered"  # not parsed: the client's CPU is not what is measured
    reply = json.loads(text)
    return " ".join(str(reply.get("error", "")).split()[:4])


class Clients:
    """``count`` threads, each asking one kind of request in a loop until stopped."""

    def __init__(self, path: str, kind: str, count: int, args: argparse.Namespace) -> None:
        self.path, self.kind, self.args = path, kind, args
        self.stop = threading.Event()
        self.outcomes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(seed,), daemon=True) for seed in range(count)
        ]
        for thread in self.threads:
            thread.start()

    def _request(self, chooser: random.Random) -> bytes:
        if self.kind == "checksum":
            return frame({"op": "checksum"})
        if self.kind == "list":
            return frame({"op": "list"})
        number = chooser.randrange(self.args.requests)
        lo = chooser.randrange(self.args.request_blocks)
        return frame({"op": "fetch", "request": f"r{number}", "group": 0, "lo": lo,
                      "hi": lo + 1, "num_tokens": self.args.request_blocks * BLOCK})  # fmt: skip

    def _loop(self, seed: int) -> None:
        chooser = random.Random(seed)
        while not self.stop.is_set():
            outcome = ask(self.path, self._request(chooser), timeout=60)
            with self._lock:
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if outcome != "answered":
                time.sleep(0.005)

    def end(self) -> dict[str, int]:
        """Stop every client (each ends its request in progress); what they got."""
        self.stop.set()
        for thread in self.threads:
            thread.join()
        with self._lock:
            return dict(self.outcomes)


def measure_rates(args: argparse.Namespace) -> dict:
    """Windows alone and under each kind of client, alternating; each kind's ratio to
    the mean of its neighbouring windows alone."""
    folder = tempfile.mkdtemp(prefix="kvaudit-pressure-")
    path = os.path.join(folder, "pp0-tp0.sock")
    engine = EngineProcess(path, args)
    windows: list[dict] = []
    try:
        engine.window(1.0)  # warm up
        windows.append({"kind": "alone", **engine.window(args.seconds)})
        for _ in range(args.rounds):
            for kind in args.kinds:
                clients = Clients(path, kind, args.clients, args)
                figures = engine.window(args.seconds)
                outcomes = clients.end()
                windows.append({"kind": kind, **figures, "replies": outcomes})
                engine.window(args.settle)  # what the clients left queued drains
                windows.append({"kind": "alone", **engine.window(args.seconds)})
    finally:
        engine.stop()
        os.rmdir(folder)
    ratios: dict[str, list[float]] = {}
    for index, window in enumerate(windows):
        if window["kind"] != "alone":
            alone = (windows[index - 1]["steps_per_s"] + windows[index + 1]["steps_per_s"]) / 2
            window["ratio"] = window["steps_per_s"] / alone
            ratios.setdefault(window["kind"], []).append(window["ratio"])
    return {
        "clients": args.clients,
        "requests": args.requests,
        "request_blocks": args.request_blocks,
        "windows": windows,
        "ratios": {kind: min(values) for kind, values in ratios.items()},
    }


def misbehave(path: str, kind: str, count: int, fetch_mib: int) -> list[socket.socket]:
    """``count`` open connections to the agent, each misbehaving as ``kind`` says."""
    blocks = max(1, (fetch_mib << 20) // block_bytes(*MEMORY_SHAPE))
    fetch = {"op": "fetch", "request": "big", "group": 0, "lo": 0, "hi": blocks}
    request = frame({**fetch, "num_tokens": blocks * BLOCK})
    opened = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(path)
        if kind == "non-reading":
            sock.sendall(request)
        elif kind == "slow":
            sock.sendall(request[: len(request) // 2])
        else:
            sock.sendall(frame({"op": "list"}))
        opened.append(sock)
    return opened


def measure_memory(args: argparse.Namespace) -> dict[str, float]:
    """Both windows' RSS, steps and step rates, and their differences."""
    folder = tempfile.mkdtemp(prefix="kvaudit-pressure-")
    path = os.path.join(folder, "pp0-tp0.sock")
    engine = EngineProcess(path, args)
    try:
        engine.window(0.5)  # warm up
        calm = engine.window(args.seconds)
        clients = misbehave(path, args.misbehave, args.clients, args.fetch_mib)
        try:
            busy = engine.window(args.seconds)
        finally:
            for sock in clients:
                sock.close()
    finally:
        engine.stop()
        os.rmdir(folder)
    return {
        "clients": args.clients,
        "fetch_mib": args.fetch_mib,
        "calm_steps": calm["steps"],
        "busy_steps": busy["steps"],
        "calm_steps_per_s": calm["steps_per_s"],
        "busy_steps_per_s": busy["steps_per_s"],
        "step_rate_ratio": busy["steps_per_s"] / calm["steps_per_s"],
        "calm_rss_mib": calm["rss_mib"],
        "busy_rss_mib": busy["rss_mib"],
        "rss_growth_mib": busy["rss_mib"] - calm["rss_mib"],
    }


def print_rates(figures: dict) -> None:
    print(
        f"{figures['clients']} clients of each kind; {figures['requests']} requests of "
        f"{figures['request_blocks']} blocks in the cache"
    )
    print(f"{'window':10} {'steps/s':>9} {'longest':>9} {'ratio':>6}  replies")
    for window in figures["windows"]:
        ratio = f"{window['ratio']:6.2f}" if "ratio" in window else " " * 6
        replies = ", ".join(f"{n} {what}" for what, n in sorted(window.get("replies", {}).items()))
        print(
            f"{window['kind']:10} {window['steps_per_s']:9.1f} "
            f"{window['longest_step_s'] * 1000:7.1f}ms {ratio}  {replies}"
        )
    ratios = ", ".join(f"{kind} {value:.2f}" for kind, value in figures["ratios"].items())
    print(f"step rate under clients / alone (lowest of the rounds): {ratios}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--kinds", default="checksum,list,fetch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--request-blocks", type=int, default=128)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--misbehave", choices=("non-reading", "slow", "queued"))
    parser.add_argument("--fetch-mib", type=int, default=32)
    parser.add_argument("--held-mib", type=int)
    parser.add_argument("--poll-mib", type=int)
    parser.add_argument("--poll-share", type=float)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.kinds = [kind for kind in args.kinds.split(",") if kind]
    unknown = set(args.kinds) - {"checksum", "list", "fetch"}
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(sorted(unknown))}")
    if args.serve:
        serve(args)
        return 0
    if args.misbehave is None:
        figures = measure_rates(args)
        if args.json:
            print(json.dumps(figures))
        else:
            print_rates(figures)
        return 0
    memory = measure_memory(args)
    if args.json:
        print(json.dumps(memory))
        return 0
    print(f"{args.clients} {args.misbehave} clients, a {args.fetch_mib} MiB request")
    print(f"{'':12} {'steps/s':>9} {'RSS MiB':>9}")
    print(f"{'no clients':12} {memory['calm_steps_per_s']:9.0f} {memory['calm_rss_mib']:9.0f}")
    print(f"{'misbehaving':12} {memory['busy_steps_per_s']:9.0f} {memory['busy_rss_mib']:9.0f}")
    print(
        f"step rate ratio {memory['step_rate_ratio']:.2f}, "
        f"RSS growth {memory['rss_growth_mib']:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
