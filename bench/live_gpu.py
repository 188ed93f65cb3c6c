"""Live caches on a GPU: toy engines (tests/helpers/live_engine.py) with CUDA tensors behind
``kvaudit.live`` agents, read through the command line (docs/live.md).

    python bench/live_gpu.py

A producer at TP=2 and a consumer at TP=1 (another layout, a planted fault), each
process stepping (rewriting, freeing and reusing blocks) while asked: the producer's
live checksums must equal a dump its agents write, the consumer's live checksums the
same KV checksummed on the CPU, and ``diff live:P live:C`` must find and locate the
fault. Part of bench/gpu.py; about a minute. Exits 2 without CUDA, 1 on a failed check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "tests" / "helpers" / "live_engine.py"
LIFETIME_S = 240


def _kvaudit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVAUDIT_LIVE_TIMEOUT": "30"}
    command = [sys.executable, "-m", "kvaudit", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def check_live(device: str = "cuda") -> bool:
    """Run the engines on ``device`` and the checks; True when all pass."""
    root = Path(tempfile.mkdtemp(prefix="kvaudit-live-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    specs = [
        ("prefill", ["--tp-size", "2", "--role", "producer"], 0),
        ("prefill", ["--tp-size", "2", "--role", "producer"], 1),
        ("decode", ["--layout", "KNHTD", "--fault", "--mode", "thread"], 0),
    ]
    processes = []
    started = time.perf_counter()
    try:
        for folder, args, rank in specs:
            (root / folder).mkdir(mode=0o700, exist_ok=True)
            sock = root / folder / f"pp0-tp{rank}.sock"
            command = [sys.executable, str(ENGINE), "--socket", str(sock), "--tp-rank", str(rank)]
            command += [*args, "--device", device, "--lifetime", str(LIFETIME_S)]
            processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env))
        for process in processes:
            if process.stdout is None or process.stdout.readline().strip() != "ready":
                print("live: an engine did not start", flush=True)
                return False
        return _checks(root)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
        print(f"live: {time.perf_counter() - started:.1f} s", flush=True)


def _totals(text: str, request_id: str) -> list[str]:
    return json.loads(text)["requests"][request_id]["groups"]["0"]["totals"]


def _checks(root: Path) -> bool:
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    from kvaudit.sources.socket_source import dump_requests

    ok = True
    prefill, decode = root / "prefill", root / "decode"
    live = _kvaudit("checksum", f"live:{prefill}", "--request", "stable", "--format", "json")
    dumps = root / "dumps"
    dumps.mkdir()
    dump_requests(str(prefill), dumps, ["stable"])
    dumped = _kvaudit("checksum", str(dumps), "--request", "stable", "--format", "json")
    same = live.returncode == 0 and _totals(live.stdout, "stable") == _totals(
        dumped.stdout, "stable"
    )
    print(f"live: producer's live checksums equal its agents' dump: {same}", flush=True)
    ok = ok and same

    consumer = _kvaudit("checksum", f"live:{decode}", "--request", "stable", "--format", "json")
    on_cpu = _kvaudit(
        "checksum", str(dumps), "--request", "stable", "--format", "json", "--device", "cpu"
    )
    differs = consumer.returncode == 0 and _totals(consumer.stdout, "stable") != _totals(
        on_cpu.stdout, "stable"
    )
    print(f"live: the consumer's fault changes its checksums: {differs}", flush=True)
    ok = ok and differs

    diff = _kvaudit(
        "diff", f"live:{prefill}", f"live:{decode}", "--request", "stable", "--format", "json"
    )
    located = []
    if diff.returncode == 1:
        group = json.loads(diff.stdout)["requests"]["stable"]["groups"]["0"]
        located = [(item["layer"], item["head"], item["tokens"]) for item in group["located"]]
    from helpers import live_engine as toy

    want = [(toy.LAYERS[toy.FAULT["layer"]], toy.FAULT["head"], [toy.FAULT["token"]])]
    print(f"live: diff live:P live:C located {located} (expected {want})", flush=True)
    return ok and located == want


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/live_gpu.py: needs a CUDA GPU, and torch sees none", file=sys.stderr)
        return 2
    return 0 if check_live() else 1


if __name__ == "__main__":
    sys.exit(main())
