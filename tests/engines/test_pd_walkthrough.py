"""docs/vllm.md's whole-engine walk-through as a user runs it, and vLLM's own offline P/D
pattern (two ``LLM`` instances sharing ExampleConnector's folder) paired by prompt."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.pd_checks import ROOT, kvaudit_cli

HERE = Path(__file__).resolve().parent


def test_the_walkthrough_runs_as_documented(tmp_path: Path) -> None:
    """docs/vllm.md's command, from a working folder with a relative output folder."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_pd_cpu" / "walkthrough.py"),
         "out/vllm-pd", "--base-port", "8130"],
        capture_output=True, text=True, timeout=1200, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "walk-through done" in done.stdout
    out = tmp_path / "out" / "vllm-pd"
    assert (out / "decode" / "kvaudit-output.json").is_file()
    # Production keeps few dumps: without any, the records' layer sums still name the
    # layer and plane of the planted fault (faulty_transfer.py: layer 0, a K element).
    for side in ("prefill", "decode"):
        shutil.copytree(
            out / side, tmp_path / "nodumps" / side, ignore=shutil.ignore_patterns("dumps")
        )
    diff = kvaudit_cli("diff", tmp_path / "nodumps" / "prefill", tmp_path / "nodumps" / "decode")
    assert diff.returncode == 1, diff.stdout[-3000:] + diff.stderr[-3000:]
    assert "layer 0 K differs (by the records' layer sums" in diff.stdout, diff.stdout[-3000:]


def test_offline_pd_requests_are_paired_by_their_prompts(model: Path, tmp_path: Path) -> None:
    """vLLM's own offline P/D pattern: the engines name each prompt's request differently;
    kvaudit diff of their output folders pairs them by prompt and compares every one."""
    for role in ("producer", "consumer"):
        done = subprocess.run(
            [sys.executable, str(HERE / "offline_pd.py"), role, str(model), str(tmp_path)],
            capture_output=True, text=True, timeout=900, check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"},
        )  # fmt: skip
        causes = [line for line in done.stderr.splitlines() if "Error" in line]
        assert done.returncode == 0, "\n".join(causes[:20]) + done.stderr[-2000:]
    diff = kvaudit_cli("diff", tmp_path / "prefill", tmp_path / "decode", "--allow-missing",
                       "--format", "json")  # fmt: skip
    assert diff.returncode == 0, diff.stdout[-3000:] + diff.stderr[-3000:]
    report = json.loads(diff.stdout)
    assert len(report["requests"]) == 3
    assert sum("paired by prompt" in w for w in report["warnings"]) == 3
