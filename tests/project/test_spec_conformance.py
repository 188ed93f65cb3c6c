"""Statements of the specs checked where no other test module asserts them.

- cli.md, "What a diff must never pass": a transfer group that neither side can checksum
  (here: cells of 12 bytes, not whole 8-byte pieces) is unverified in every request, so
  ``diff`` and ``verify`` exit 1 instead of passing the KV it moved unchecked; a group
  its description leaves out (``transfer: false``, ``host_resident: true``) is expected by
  neither side. ``verify --stored`` says the same of a group a worker cannot checksum.
- checksum.md, "Piece": K and V rows of 12 bytes make a group unsupported in every layout,
  K and V packed into one row of 24 bytes (``C``) as well as stored apart (``D``).
- checksum.md, "Layer number", and the group ids of dumps and records: only ASCII decimal
  digits make a number; a name or key with other Unicode digits is no layer number or bad
  input (exit 2), not an internal error.
- dump-format.md: a dump written with safetensors alone, rows in the order of
  ``kvaudit.blocks`` (not ascending), K/V planes, kernel blocks, junk past ``num_tokens``.
- cli.md: a closed stdout pipe keeps the exit status of checksum, inspect and corrupt.
- cli.md, ``corrupt SOURCE``: a record given as SOURCE is named as a record (exit 2).

Expectations are written by hand from the specs: which group cannot be checksummed and
why follows from its cell size.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from helpers import kvbuild as kb
from helpers import reference as ref
from safetensors.numpy import save_file

from kvaudit.cli import main
from kvaudit.core.errors import UnsupportedGroupError
from kvaudit.core.scheme import layer_module

GOOD = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
ODD = "model.layers.2.self_attn.attn"
TOKENS = {"r1": 30, "r2": 9}
ROOT = Path(__file__).resolve().parents[2]


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def two_group_model(**odd_group: bool) -> kb.Model:
    """Group 0 checksummable; group 1 one layer of 3-element bf16 heads (12-byte cells)."""
    good = kb.GroupModel(0, tuple(kb.Attn(name, 4, 8) for name in GOOD))
    odd = kb.GroupModel(1, (kb.Attn(ODD, 4, head_size=3),), **odd_group)
    return kb.Model((good, odd), model_kv_heads=4)


MODEL_ODD = kb.Model(
    (
        kb.GroupModel(0, tuple(kb.Attn(name, 4, 8) for name in GOOD)),
        kb.GroupModel(1, (kb.Attn(ODD, 4, head_size=3, dtype="float32"),)),
    ),
    model_kv_heads=4,
)
"""Group 1: float32 heads of 3 elements, K and V rows of 12 bytes, cells of 24 (3 words)."""


def engines(model: kb.Model, folder: Path) -> tuple[Path, Path]:
    requests = {rid: kb.make_request(model, n, seed=i) for i, (rid, n) in enumerate(TOKENS.items())}
    producer = kb.build_engine(model, requests, kb.Engine(tp_size=2, seed=1))
    consumer = kb.build_engine(model, requests, kb.Engine(tp_size=4, seed=2))
    return kb.write_workers(producer, folder / "producer", "producer"), kb.write_workers(
        consumer, folder / "consumer", "consumer"
    )


def test_a_group_neither_side_can_checksum_is_unverified(tmp_path: Path) -> None:
    producer, consumer = engines(two_group_model(), tmp_path)
    checksum = run("checksum", producer, "--format", "json", "-o", tmp_path / "p.json")
    assert checksum.exit_code == 0, checksum.output
    record = json.loads((tmp_path / "p.json").read_text())
    assert all("8-byte" in w["not_covered"]["1"] for w in record["workers"])

    for args in (
        ("diff", producer, consumer),
        ("diff", tmp_path / "p.json", consumer),
        ("diff", producer, consumer, "--allow-missing", "--allow-empty"),
        ("verify", consumer, "--against", tmp_path / "p.json"),
    ):
        result = run(*args, "--format", "json")
        assert result.exit_code == 1, result.output
        report = json.loads(result.stdout)
        assert report["ok"] is False
        for rid in TOKENS:
            groups = report["requests"][rid]["groups"]
            # Group 0 is compared and matches; group 1 says why it was not.
            assert groups["0"]["unverified"] is None and groups["0"]["compared"] > 0
            assert groups["0"]["mismatched_positions"] == []
            reason = groups["1"]["unverified"]
            assert "not covered on either side" in reason and "8-byte" in reason
            assert groups["1"]["compared"] == 0

    # verify --stored: the group is unverified on the worker that cannot checksum it.
    stored = json.loads(run("verify", producer, "--stored", "--format", "json").stdout)
    for rid in TOKENS:
        assert "8-byte" in stored["requests"][rid]["groups"]["1"]["unverified"]

    table = run("diff", producer, consumer)
    assert table.exit_code == 1
    assert "UNVERIFIED" in table.stdout and "not covered on either side" in table.stdout
    junit = run("diff", producer, consumer, "--format", "junit")
    assert junit.exit_code == 1 and 'errors="2"' in junit.stdout


@pytest.mark.parametrize("layouts", [("NTHC", "KNHTD"), ("NHTC", "NTHC"), ("KNTHD", "NHTD")])
def test_k_or_v_rows_of_part_words_are_covered_in_no_layout(
    tmp_path: Path, layouts: tuple[str, str]
) -> None:
    # checksum.md, "Piece": a K or V row that is not whole 8-byte words makes the group
    # unsupported, also where K and V are packed into one row whose total is (12 + 12).
    requests = {
        rid: kb.make_request(MODEL_ODD, n, seed=i) for i, (rid, n) in enumerate(TOKENS.items())
    }
    sides = []
    for role, tp, layout in (("producer", 2, layouts[0]), ("consumer", 4, layouts[1])):
        engine = kb.Engine(tp_size=tp, layouts={1: layout}, seed=tp)
        built = kb.build_engine(MODEL_ODD, requests, engine)
        sides.append(kb.write_workers(built, tmp_path / f"{role}-{layout}", role))
    for side in sides:
        record = json.loads(run("checksum", side, "--format", "json").stdout)
        assert all("8-byte" in w["not_covered"]["1"] for w in record["workers"])
    report = json.loads(run("diff", *sides, "--format", "json").stdout)
    for rid in TOKENS:
        reason = report["requests"][rid]["groups"]["1"]["unverified"]
        assert "not covered on either side" in reason


@pytest.mark.parametrize("left_out", ["transfer", "host_resident"])
def test_a_group_the_description_leaves_out_is_not_expected(tmp_path: Path, left_out: str) -> None:
    odd = {"transfer": False} if left_out == "transfer" else {"host_resident": True}
    producer, consumer = engines(two_group_model(**odd), tmp_path)
    result = run("diff", producer, consumer, "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True
    stored = json.loads(run("verify", producer, "--stored", "--format", "json").stdout)
    for rid in TOKENS:
        assert list(report["requests"][rid]["groups"]) == ["0"]
        assert list(stored["requests"][rid]["groups"]) == ["0"]


# A layer number and a group id are ASCII decimal integers: other Unicode digits ("²",
# which str.isdigit() accepts and int() refuses) are bad input or no layer number, never
# an internal error (exit 3).


def test_a_superscript_digit_is_no_layer_number() -> None:
    with pytest.raises(UnsupportedGroupError, match="no single layer number"):
        layer_module("model.layers.\u00b2.self_attn.attn")
    assert layer_module("model.layers.12.self_attn.attn") == (12, "model.layers.12")


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _superscript_group(header: dict) -> None:
    requests = json.loads(header["__metadata__"]["kvaudit.requests"])
    requests["r1"]["groups"]["\u00b2"] = requests["r1"]["groups"].pop("0")
    header["__metadata__"]["kvaudit.requests"] = json.dumps(requests)


def test_a_superscript_group_id_is_bad_input(tmp_path: Path) -> None:
    producer, _ = engines(two_group_model(), tmp_path)
    record = tmp_path / "p.json"
    assert run("checksum", producer, "--format", "json", "-o", record).exit_code == 0
    data = json.loads(record.read_text())
    data["requests"]["r1"]["groups"]["\u00b2"] = data["requests"]["r1"]["groups"].pop("0")
    record.write_text(json.dumps(data))
    dump = sorted(producer.iterdir())[0]
    _rewrite_header(dump, _superscript_group)
    for source in (record, dump):
        result = run("checksum", source)
        assert result.exit_code == 2, result.output
        message = result.output.strip()
        assert "\n" not in message and "internal error" not in message
        assert message.startswith(f"kvaudit: error: {source}")


def test_a_record_given_to_corrupt_is_named_as_a_record(tmp_path: Path) -> None:
    # cli.md: corrupt takes a dump file; a record holds no KV to corrupt.
    producer, _ = engines(two_group_model(), tmp_path)
    record = tmp_path / "p.json"
    assert run("checksum", producer, "--format", "json", "-o", record).exit_code == 0
    out = tmp_path / "out.safetensors"
    args = ("--request", "r1", "--group", "0", "--position", "0")
    result = run("corrupt", record, "-o", out, *args)
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"kvaudit: error: {record}: looks like a record (checksums only, from checksum "
        "--format json), not a dump"
    )
    assert not out.exists()


# dump-format.md, a dump written without kvaudit: the N axis holds the dumped blocks'
# kernel blocks in the order of kvaudit.blocks (any order), K and V planes apart (KNHTD),
# kernel blocks of half a block (cache-description.md, "Kernel blocks"); slots past
# num_tokens hold junk. Checked against tests/helpers/reference.py on the global KV.


def test_a_dump_written_with_safetensors_alone(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    names = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    tokens, block, kernel, heads, dim = 10, 4, 2, 2, 4
    table = [5, 2, 7]  # engine block ids of positions 0, 1, 2
    rows = [7, 5, 2]  # kvaudit.blocks: the dumped rows, not in ascending order
    # Global KV: per token and head a cell of K row then V row (4 fp16 each: 16 bytes).
    cells = {name: rng.integers(0, 256, (tokens, heads, 16), dtype=np.uint8) for name in names}
    tensors = {}
    for name in names:
        # [K/V plane, N kernel blocks, H, T, D] of fp16 bits, junk everywhere first.
        plane = rng.integers(0, 2**16, (2, len(rows) * 2, heads, kernel, dim), dtype=np.uint16)
        for position, block_id in enumerate(table):
            row = rows.index(block_id)
            for t in range(position * block, min((position + 1) * block, tokens)):
                k, slot = divmod(t - position * block, kernel)
                for h in range(heads):
                    for kv in (0, 1):
                        row_bytes = cells[name][t, h, kv * 8 : kv * 8 + 8]
                        plane[kv, row * 2 + k, h, slot] = row_bytes.view("<u2")
        tensors[name] = plane.view(np.float16)
    spec = {
        "type": "full_attention",
        "block_size": block,
        "kernel_block_size": kernel,
        "num_kv_heads": heads,
        "head_size": dim,
        "dtype": "float16",
        "layout": "KNHTD",
    }
    metadata = {
        "kvaudit.format": "1",
        "kvaudit.worker": json.dumps(
            {
                "tp_rank": 0,
                "tp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "role": "producer",
                "engine": "hand-written",
            }
        ),
        "kvaudit.cache": json.dumps(
            {"kvaudit": 1, "num_blocks": 8, "groups": [{"spec": spec, "layers": list(names)}]}
        ),
        "kvaudit.requests": json.dumps({"q": {"num_tokens": tokens, "groups": {"0": [0, table]}}}),
        "kvaudit.blocks": json.dumps(rows),
    }
    path = tmp_path / "rank0.safetensors"
    save_file(tensors, str(path), metadata=metadata)

    result = run("checksum", path, "--format", "json")
    assert result.exit_code == 0, result.output
    group = json.loads(result.stdout)["requests"]["q"]["groups"]["0"]
    model = ref.Group(block, tuple(ref.Layer(name, cells[name]) for name in names))
    expected = ref.total(ref.block_checksums(model, tokens))
    assert group["start"] == 0 and group["replica_keys"] == [[1, 0]]
    assert group["totals"] == [f"{int(value):016x}" for value in expected]
    identities = [(name, "FullAttentionSpec", "torch.float16") for name in names]
    assert group["fingerprint"] == f"{ref.fingerprint(identities):016x}"


# cli.md: a closed pipe on stdout does not change the exit status (said of diff; the same
# holds for every command): checksum and inspect keep 0 for a complete set and 1 for an
# incomplete one, corrupt its 0, whatever the reader of stdout does.


def test_a_closed_pipe_keeps_every_commands_status(tmp_path: Path) -> None:
    producer, _ = engines(two_group_model(), tmp_path)
    one_worker = sorted(producer.iterdir())[0]
    out = tmp_path / "corrupted.safetensors"
    plant = f"corrupt {one_worker} -o {out} --request r1 --group 0 --position 0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cases = [
        (f"checksum {producer} --format json", 0),
        (f"checksum {one_worker}", 1),
        (f"inspect {producer}", 0),
        (f"inspect {one_worker} --format json", 1),
        (plant, 0),
    ]
    for args, status in cases:
        # The reader exits at once: every write to stdout meets a closed pipe.
        command = f"{sys.executable} -m kvaudit {args} -q | true; exit ${{PIPESTATUS[0]}}"
        done = subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, env=env, check=False
        )
        assert done.returncode == status, (args, done.stderr)
        assert "Traceback" not in done.stderr
