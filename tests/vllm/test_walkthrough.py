"""docs/vllm.md's CPU walk-through (examples/vllm_cpu/walkthrough.py) runs as written: a
broken transfer caught inline after a local prefix hit, dumped and located. Run as
docs/vllm.md writes it, with a relative output folder (``out/vllm-cpu``, from a temporary
working directory)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_walkthrough_catches_and_locates_the_fault(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_cpu" / "walkthrough.py"), "out/vllm-cpu"],
        capture_output=True, text=True, env=env, timeout=600, check=False, cwd=tmp_path,
    )  # fmt: skip
    out = tmp_path / "out" / "vllm-cpu"  # where the relative folder is
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "walk-through done: caught inline and located" in done.stdout
    assert (
        "kvaudit: MISMATCH request req-7 group 0: positions [3] (blocks [4]) differ from the "
        "producer's checksums (position 3 compared; 0-2 held locally (prefix cache), not "
        "compared); looked up among the last 65536 blocks received from the producer: no "
        "recent producer block holds these checksums"
    ) in done.stdout
    located = subprocess.run(
        [sys.executable, "-m", "kvaudit", "diff", out / "prefill" / "dumps" / "req-7",
         out / "decode" / "dumps" / "req-7", "--allow-missing", "--format", "json"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    [entry] = json.loads(located.stdout)["requests"]["req-7"]["groups"]["0"]["located"]
    assert (entry["position"], entry["head"], entry["tokens"]) == (3, 1, [50])
    assert entry["layer"] == "model.layers.1.self_attn.attn"
    # The two output folders without their dumps: the lines' layer sums (on by default)
    # still name the layer and plane of the flipped bit (byte 2 of a cell: its K row).
    for side in ("prefill", "decode"):
        shutil.copytree(
            out / side, tmp_path / "bare" / side, ignore=shutil.ignore_patterns("dumps")
        )
    bare = subprocess.run(
        [sys.executable, "-m", "kvaudit", "diff", tmp_path / "bare" / "prefill",
         tmp_path / "bare" / "decode", "--allow-missing"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert bare.returncode == 1, bare.stdout + bare.stderr
    assert (
        "req-7 group 0: differs: the block at position 3: layer 1 K differs (by the records' "
        "layer sums; heads and tokens not located)"
    ) in bare.stdout, bare.stdout
