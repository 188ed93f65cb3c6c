"""What vLLM 0.33's own ExampleConnector saves, read by kvaudit under the engine's own
description: a producer engine (``e2e_engine.py``, layout NHTC) stores two prompts through
ExampleConnector; ``kvaudit checksum -c cache.yaml STORE`` reads both request folders at
once, each named by vLLM's hash of the prompt, and their checksums equal those of the
dumps kvaudit's connector wrote of the same requests from the engine's paged cache, over
the whole blocks ExampleConnector saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from vllm.utils.hashing import safe_hash

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
PROMPTS = {"req-a": list(range(500, 534)), "req-b": list(range(900, 934))}  # e2e_engine.py


def kvaudit_json(*args: object) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "kvaudit", *map(str, args), "-q", "--format", "json"],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_store_reads_under_the_engines_layout(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(HERE / "e2e_engine.py"), "producer", str(tmp_path)],
        capture_output=True, text=True, env=ENV, timeout=600, check=True,
    )  # fmt: skip
    cache = tmp_path / "prefill" / "cache.yaml"
    spec = yaml.safe_load(cache.read_text())["groups"][0]["spec"]
    assert "N" in spec["layout"] and spec["layout"] != "NTHC"  # not the saved token order
    block_size = spec["block_size"]

    stored = kvaudit_json("checksum", "-c", cache, tmp_path / "store")
    for request_id, prompt in PROMPTS.items():
        # ExampleConnector saves whole blocks, the last token's block left out, in a
        # folder named by the hash of those tokens' ids.
        saved = (len(prompt) - 1) // block_size * block_size
        folder = safe_hash(torch.tensor(prompt[:saved]).numpy().tobytes(), usedforsecurity=False)
        from_store = stored["requests"][folder.hexdigest()]
        assert from_store["num_tokens"] == saved
        dumped = kvaudit_json("checksum", tmp_path / "prefill" / "dumps" / request_id)
        engine = dumped["requests"][request_id]
        assert engine["num_tokens"] == len(prompt)
        totals = from_store["groups"]["0"]["totals"]
        assert len(totals) == saved // block_size
        assert totals == engine["groups"]["0"]["totals"][: len(totals)]
    assert len(stored["requests"]) == len(PROMPTS)
