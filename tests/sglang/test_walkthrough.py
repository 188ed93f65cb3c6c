"""docs/sglang.md's CPU walk-through (examples/sglang_cpu/walkthrough.py) runs as written: a
TP=2 prefill and a TP=1 decode through SGLang's own code, a planted fault caught inline
where SGLang's own check admits the transfer unverified, then located by ``kvaudit diff``.
Run as docs/sglang.md writes it, with a relative output folder (``out/sglang-cpu``, from
a temporary working directory): gloo's rendezvous files and the engines' folders must not
depend on an absolute path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_walkthrough_catches_and_locates_the_fault(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVAUDIT_SGLANG_OUTPUT", None)
    script = ROOT / "examples" / "sglang_cpu" / "walkthrough.py"
    done = subprocess.run(
        [sys.executable, str(script), "out/sglang-cpu"],
        capture_output=True, text=True, env=env, timeout=600, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "SGLang's own check compares this transfer: False" in lines
    assert any(
        line.startswith("ERROR kvaudit KV checksum mismatch req=req-bad tokens=0..40")
        for line in lines
    )
    assert (
        "kept in the batch: ['req-ok', 'req-prefix']; aborted through SGLang: ['req-bad']" in lines
    )
    # The walk-through adds 1.0 to K element 3 of layer 1, head 2, token 33: named with
    # both values, which differ by exactly what was added.
    place = (
        "req-bad group 0: single element: model.layers.1.self_attn.attn head 2 token 33 "
        "(position 2), K element 3 (bfloat16): "
    )
    [line] = {line for line in lines if line.startswith(place)}
    before, after = (float(x) for x in line.removeprefix(place).split(" -> "))
    assert after - before == 1.0
    assert lines[-1] == "walk-through done: caught inline and located"
    out = tmp_path / "out" / "sglang-cpu"  # where the relative folder is, nowhere else
    assert (out / "prefill" / "dumps" / "req-bad").is_dir()
    assert (out / "decode" / "dumps" / "req-bad").is_dir()
