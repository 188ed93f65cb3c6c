"""A live agent's engine under misbehaving clients: its memory (RSS) and step rate.

    python bench/live_pressure.py [--clients 64] [--misbehave non-reading] [--fetch-mib 32]

An engine process steps (a matrix product and a block rewrite each step, then
``agent.poll()``) over a float32 cache holding one request of ``--fetch-mib`` MiB. The
engine's steps per second and RSS are measured for ``--seconds`` with no client, then
while ``--clients`` clients misbehave:

- ``non-reading``: each fetches the whole request's blocks (the reply's payload is
  ``--fetch-mib`` MiB) and never reads the reply;
- ``slow``: each sends half a request and stalls;
- ``queued``: each sends a whole small request and waits, in an engine that polls.

Printed: both windows' steps per second and RSS, and their ratios (this machine's noise
cancels in a ratio of two windows of one run). ``--json`` prints them as JSON.
``--held-mib`` and ``--poll-mib`` set the agent's ``max_held_bytes`` and
``max_poll_bytes`` (its defaults when not given).
"""

from __future__ import annotations

import argparse
import json
import os
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

BLOCK, HEADS, HEAD_SIZE = 16, 8, 128
BLOCK_BYTES = BLOCK * HEADS * 2 * HEAD_SIZE * 4
"""One block of the engine's one layer: 16 tokens of 8 float32 heads of K and V."""


def serve(socket_path: str, fetch_mib: int, held_mib: int | None, poll_mib: int | None) -> None:
    """The engine: step, poll, and print ``steps N`` every 0.1 s until stdin closes."""
    import torch

    from kvaudit import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.live import Agent

    torch.set_num_threads(1)  # an engine's step on one core: steadier than a shared pool
    blocks = max(1, (fetch_mib << 20) // BLOCK_BYTES)
    rows = blocks + 8
    cache = torch.randn(rows, HEADS, BLOCK, 2 * HEAD_SIZE)
    spec = {"type": "full_attention", "block_size": BLOCK, "num_kv_heads": HEADS,
            "head_size": HEAD_SIZE, "dtype": "float32", "layout": "NHTC"}  # fmt: skip
    description = parse_description(
        {
            "kvaudit": 1,
            "num_blocks": rows,
            "groups": [{"spec": spec, "layers": ["model.layers.0.attn"]}],
        },
        "engine",
    )
    tables = {"big": RequestBlocks(blocks * BLOCK, {0: (0, list(range(blocks)))})}
    options: dict[str, int] = {}
    if held_mib is not None:
        options["max_held_bytes"] = held_mib << 20
    if poll_mib is not None:
        options["max_poll_bytes"] = poll_mib << 20
    agent = Agent(
        socket_path, description, {"model.layers.0.attn": cache}, lambda: tables, **options
    )
    weights = torch.randn(256, 256)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print("ready", flush=True)
    steps, last = 0, time.monotonic()
    try:
        while not done.is_set():
            (weights @ weights).sum()
            cache[rows - 1 - steps % 8].normal_()
            agent.poll()
            steps += 1
            if time.monotonic() - last >= 0.1:
                print(f"steps {steps}", flush=True)
                last = time.monotonic()
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
        command = [sys.executable, __file__, "--serve", socket_path, "--fetch-mib",
                   str(args.fetch_mib)]  # fmt: skip
        for flag, value in (("--held-mib", args.held_mib), ("--poll-mib", args.poll_mib)):
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
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("steps "):
                self.steps = int(line.split()[1])

    def window(self, seconds: float) -> tuple[float, float]:
        """Steps per second over ``seconds``, and the largest RSS seen (MiB)."""
        start_steps, start = self.steps, time.monotonic()
        peak = rss_mib(self.process.pid)
        while time.monotonic() - start < seconds:
            time.sleep(0.05)
            peak = max(peak, rss_mib(self.process.pid))
        return (self.steps - start_steps) / (time.monotonic() - start), peak

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


def frame(message: dict) -> bytes:
    text = json.dumps(message).encode()
    return struct.pack(">IQ", len(text), 0) + text


def misbehave(path: str, kind: str, count: int, fetch_mib: int) -> list[socket.socket]:
    """``count`` open connections to the agent, each misbehaving as ``kind`` says."""
    blocks = max(1, (fetch_mib << 20) // BLOCK_BYTES)
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


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Both windows' step rates and RSS, and their ratios."""
    folder = tempfile.mkdtemp(prefix="kvaudit-pressure-")
    path = os.path.join(folder, "pp0-tp0.sock")
    engine = EngineProcess(path, args)
    try:
        engine.window(0.5)  # warm up
        calm_rate, calm_rss = engine.window(args.seconds)
        clients = misbehave(path, args.misbehave, args.clients, args.fetch_mib)
        try:
            busy_rate, busy_rss = engine.window(args.seconds)
        finally:
            for sock in clients:
                sock.close()
    finally:
        engine.stop()
        os.rmdir(folder)
    return {
        "clients": args.clients,
        "fetch_mib": args.fetch_mib,
        "calm_steps_per_s": calm_rate,
        "busy_steps_per_s": busy_rate,
        "step_rate_ratio": busy_rate / calm_rate,
        "calm_rss_mib": calm_rss,
        "busy_rss_mib": busy_rss,
        "rss_growth_mib": busy_rss - calm_rss,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--misbehave", choices=("non-reading", "slow", "queued"), default="non-reading"
    )
    parser.add_argument("--fetch-mib", type=int, default=32)
    parser.add_argument("--held-mib", type=int)
    parser.add_argument("--poll-mib", type=int)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.fetch_mib, args.held_mib, args.poll_mib)
        return 0
    figures = measure(args)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"{args.clients} {args.misbehave} clients, a {args.fetch_mib} MiB request")
    print(f"{'':12} {'steps/s':>9} {'RSS MiB':>9}")
    print(f"{'no clients':12} {figures['calm_steps_per_s']:9.0f} {figures['calm_rss_mib']:9.0f}")
    print(f"{'misbehaving':12} {figures['busy_steps_per_s']:9.0f} {figures['busy_rss_mib']:9.0f}")
    print(
        f"step rate ratio {figures['step_rate_ratio']:.2f}, "
        f"RSS growth {figures['rss_growth_mib']:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
