"""End to end across two OS processes: a producer engine and a consumer engine, the KV
moving between them through vLLM's ExampleConnector (its files), kvaudit's connector
wrapped around it on both. One bit of one stored layer file is flipped between the two
processes; the consumer logs the mismatch, both dump the request, and ``kvaudit diff`` of
the two dumps locates the layer, head and token; the output folders are read by
``kvaudit checksum`` and ``diff`` as sources."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

PROMPT_A = list(range(500, 534))  # e2e_engine.PROMPTS["req-a"]
# The stored file of layer 1 holds [32 tokens, 4 heads, 16] bf16: 32 bytes per cell.
LAYER, TOKEN, HEAD, CELL_BYTES = 1, 20, 2, 32


def engine(role: str, folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE / "e2e_engine.py"), role, str(folder)],
        capture_output=True, text=True, env=ENV, timeout=600, check=True,
    )  # fmt: skip


def kvaudit(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvaudit", *map(str, args)],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip


def flip_stored_bit(folder: Path) -> None:
    """Flip one bit of token TOKEN, head HEAD in a stored file of layer LAYER."""
    target = folder / f"model.layers.{LAYER}.self_attn.attn.safetensors"
    data = bytearray(target.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + (TOKEN * 4 + HEAD) * CELL_BYTES + 6] ^= 0x10
    target.write_bytes(bytes(data))


def test_a_damaged_transfer_is_caught_logged_dumped_and_located(tmp_path: Path) -> None:
    engine("producer", tmp_path)
    params = json.loads((tmp_path / "params.json").read_text())
    assert set(params) == {"req-a", "req-b"} and all("kvaudit" in p for p in params.values())
    # The transfer breaks: one bit of req-a's stored KV of layer LAYER.
    assert len(list((tmp_path / "store").iterdir())) == 2
    flip_stored_bit(tmp_path / "store" / stored_folder(PROMPT_A))
    consumer = engine("consumer", tmp_path)
    mismatches = [line for line in consumer.stderr.splitlines() if "MISMATCH" in line]
    assert len(mismatches) == 1, consumer.stderr[-3000:]
    assert mismatches[0].startswith("kvaudit: MISMATCH request req-a group 0: positions [1] ")

    prefill, decode = tmp_path / "prefill", tmp_path / "decode"
    located = kvaudit("diff", prefill / "dumps" / "req-a", decode / "dumps" / "req-a",
                      "--format", "json")  # fmt: skip
    assert located.returncode == 1, located.stderr
    report = json.loads(located.stdout)
    group = report["requests"]["req-a"]["groups"]["0"]
    assert group["mismatched_positions"] == [1]
    [entry] = group["located"]
    assert entry["layer"] == f"model.layers.{LAYER}.self_attn.attn"
    assert (entry["position"], entry["head"], entry["tokens"]) == (1, HEAD, [TOKEN])

    # ExampleConnector loads whole blocks only (34 prompt tokens, blocks of 16): the decode
    # engine recomputes position 2, so it is missing on the consumer unless allowed.
    tail = kvaudit("diff", prefill / "dumps" / "req-b", decode / "dumps" / "req-b",
                   "--format", "json")  # fmt: skip
    assert tail.returncode == 1, tail.stdout + tail.stderr
    tail_group = json.loads(tail.stdout)["requests"]["req-b"]["groups"]["0"]
    assert (tail_group["missing_positions"], tail_group["mismatched_positions"]) == ([2], [])
    clean = kvaudit("diff", prefill / "dumps" / "req-b", decode / "dumps" / "req-b",
                    "--allow-missing")  # fmt: skip
    assert clean.returncode == 0, clean.stdout + clean.stderr

    # The output folders are sources too: the records the two engines appended.
    record = kvaudit("checksum", decode, "--format", "json")
    assert record.returncode == 0, record.stderr
    assert set(json.loads(record.stdout)["requests"]) == {"req-a", "req-b"}
    both = kvaudit("diff", prefill, decode, "--request", "req-a", "--format", "json")
    assert both.returncode == 1
    assert json.loads(both.stdout)["requests"]["req-a"]["groups"]["0"]["mismatched_positions"] == [
        1
    ]


def stored_folder(prompt: list[int]) -> str:
    """ExampleConnector's folder of a prompt: vLLM's hash of its first 32 token ids
    (``_generate_foldername_debug`` in example_connector.py)."""
    from vllm.utils.hashing import safe_hash

    tokens = torch.tensor(prompt)[:32].numpy().tobytes()
    return safe_hash(tokens, usedforsecurity=False).hexdigest()
