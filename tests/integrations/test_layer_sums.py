"""Layer sums in the in-engine records (docs/checksum.md, "Layer sums"): each block's total
split per layer and K or V plane, computed by the real checksummer over torch tensors on
the CPU, equal to an independent numpy computation of the spec, additive over TP ranks,
written and read back through the output folder's own writer and reader, and what lets
``kvaudit diff`` of two output folders with no dumps name the layer and plane that differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers.output_folders import BLOCK, HEADS, LAYERS, TOKENS, Flip, write_folder

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.cli import main
from kvaudit.description import parse_description
from kvaudit.output_folders import read_output

MASK = (1 << 64) - 1
H = 65536


def spec_layer_sums(
    cells: np.ndarray, number: int, first_head: int, k_pieces: int, num_tokens: int, block: int
) -> dict[tuple[int, str], list[int]]:
    """The spec's slices (docs/checksum.md) summed per plane of one layer, per block
    position, in Python integers: ``cells[t, h]`` are token ``t``'s cells of the local
    heads (K row then V row, bytes)."""
    words = cells.reshape(cells.shape[0], cells.shape[1], -1).view("<u8")
    pieces = words.shape[-1]
    positions = -(-num_tokens // block)
    sums = {(number, "K"): [0] * positions, (number, "V"): [0] * positions}
    for t in range(num_tokens):
        for h in range(words.shape[1]):
            factor = 2 * (number * H + first_head + h) + 1
            for p in range(pieces):
                j = t * pieces + p
                plane = "K" if p < k_pieces else "V"
                term = int(words[t, h, p]) * (2 * j + 1) * factor
                sums[number, plane][t // block] = (sums[number, plane][t // block] + term) & MASK
    return sums


def make_layers(tp_rank: int, tp_size: int, layout: str) -> tuple[dict, dict, np.ndarray]:
    """Three layers of 4 KV heads (head size 8, bf16) in ``layout`` on one of ``tp_size``
    ranks, 6 blocks of 4 tokens of random bits; the full (unsharded) cells too."""
    heads, block, blocks, size = 4, 4, 6, 8
    generator = torch.Generator().manual_seed(11)
    full = torch.randint(-(2**15), 2**15, (3, blocks, block, heads, 2, size), generator=generator)
    full = full.to(torch.int16).view(torch.bfloat16)
    local = heads // tp_size
    mine = full[:, :, :, tp_rank * local : (tp_rank + 1) * local]
    tensors = {}
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    for i, name in enumerate(names):
        if layout == "KNTHD":  # (2, blocks, tokens, heads, size)
            tensors[name] = mine[i].permute(3, 0, 1, 2, 4).contiguous()
        else:  # NHTC: (blocks, heads, tokens, K row then V row)
            tensors[name] = mine[i].permute(0, 2, 1, 3, 4).reshape(blocks, local, block, -1)
            tensors[name] = tensors[name].contiguous()
    spec = {
        "type": "full_attention",
        "block_size": block,
        "num_kv_heads": local,
        "head_size": size,
        "dtype": "bfloat16",
        "layout": layout,
    }
    description = {
        "kvaudit": 1,
        "num_blocks": blocks,
        "groups": [{"id": 0, "spec": spec, "layers": names}],
    }
    # Logical cells [layer, block, token, head, K then V bytes].
    cells = full.reshape(3, blocks, block, heads, -1).view(torch.uint8).numpy()
    return description, tensors, cells


def layer_sums_of(tp_size: int, layout: str, role: str, block_ids: list[int], tokens: int):
    """Every rank's checksummed record of one request, with and without layer sums."""
    with_sums, without = [], []
    for rank in range(tp_size):
        description, tensors, cells = make_layers(rank, tp_size, layout)
        parsed = parse_description(description, "test")
        request = {"r": RequestBlocks(tokens, {0: (0, block_ids)})}
        for flag, out in ((True, with_sums), (False, without)):
            summer = Checksummer(
                parsed, tensors, tp_rank=rank, tp_size=tp_size, role=role, layer_sums=flag
            )
            out.append(summer.checksum(request).requests["r"].groups[0])
    return with_sums, without, cells


@pytest.mark.parametrize("layout", ["KNTHD", "NHTC"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_layer_sums_are_the_spec_and_add_up_to_the_block_checksum(layout: str, tp_size: int):
    block_ids, tokens = [4, 1, 3], 10  # the last block holds 2 valid tokens of 4
    with_sums, without, cells = layer_sums_of(tp_size, layout, "producer", block_ids, tokens)
    # Summed over the ranks, per label: the spec's per-layer, per-plane sums of the full KV.
    summed: dict[tuple[int, str], np.ndarray] = {}
    for group in with_sums:
        assert group.layer_sums is not None
        for k, label in enumerate(group.layer_sums.parts):
            previous = summed.get(label, np.zeros(len(block_ids), np.uint64))
            summed[label] = previous + group.layer_sums.values[:, k]
    expected: dict[tuple[int, str], list[int]] = {}
    for number in range(3):
        request_cells = np.concatenate([cells[number, b] for b in block_ids])  # [t, h, bytes]
        expected.update(spec_layer_sums(request_cells, number, 0, 2, tokens, 4))
    assert sorted(summed) == sorted(expected)
    for label, values in expected.items():
        assert summed[label].tolist() == values, label
    # The labels of every block add up to its block checksum, with or without layer sums.
    for group, plain in zip(with_sums, without, strict=True):
        assert group.layer_sums is not None
        np.testing.assert_array_equal(group.values, plain.values)
        total = group.layer_sums.values.sum(axis=1, dtype=np.uint64)
        np.testing.assert_array_equal(total, group.totals())
    whole = sum(int(v) for label in expected for v in expected[label][:1]) & MASK
    assert int(sum(g.totals()[0] for g in without)) & MASK == whole


def test_a_consumer_checks_every_replica_and_sums_replica_zero():
    """GQA with more ranks than heads: a consumer's columns keep each replica key, and the
    layer sums are the replica-0 part (the totals') alone."""
    description, tensors, _ = make_layers(0, 1, "KNTHD")
    description["model_kv_heads"] = 4
    parsed = parse_description(description, "test")
    request = {"r": RequestBlocks(8, {0: (0, [0, 2])})}
    group = Checksummer(parsed, tensors, role="consumer", layer_sums=True).checksum(request)
    checks = group.requests["r"].groups[0]
    assert checks.layer_sums is not None
    assert checks.layer_sums.parts == [(n, p) for n in range(3) for p in ("K", "V")]
    total = checks.layer_sums.values.sum(axis=1, dtype=np.uint64)
    np.testing.assert_array_equal(total, checks.totals())


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


# Byte 20 of a cell (K row of 16 bytes then V) is in V; byte 3 in K.
V_FLIP = Flip("r1", LAYERS[1], head=2, token=20, byte=20)
K_FLIP = Flip("r3", LAYERS[0], head=1, token=5, byte=3)


@pytest.mark.parametrize(
    "flip, named", [(V_FLIP, "layer 1 V differs"), (K_FLIP, "layer 0 K differs")]
)
def test_diff_of_two_output_folders_names_the_layer_and_plane(
    tmp_path: Path, flip: Flip, named: str
) -> None:
    """A producer at TP 2 and a consumer at TP 1, written by the real writer with no dumps:
    the fault planted in one layer's V (or K) of one block is named by layer and plane."""
    write_folder(tmp_path / "p", "producer", tp_size=2, layer_sums=True)
    write_folder(tmp_path / "c", "consumer", tp_size=1, layer_sums=True, flip=flip)
    status, text = run("diff", str(tmp_path / "p"), str(tmp_path / "c"))
    assert status == 1, text
    lines = [line for line in text.splitlines() if line.startswith(f"{flip.request} group 0")]
    assert lines == [
        f"{flip.request} group 0: differs: the block at position {flip.position}: {named}"
        " (by the records' layer sums; heads and tokens not located)"
    ], text
    status, text = run("diff", str(tmp_path / "p"), str(tmp_path / "c"), "--format", "json")
    assert status == 1
    assert named in text
    # Without layer sums on one side the same fault is found but not located.
    write_folder(tmp_path / "p0", "producer", tp_size=2, layer_sums=False)
    status, text = run("diff", str(tmp_path / "p0"), str(tmp_path / "c"))
    assert status == 1
    assert f"position {flip.position} differs (not located" in text
    assert named not in text


def test_layer_sums_of_tp_2_and_tp_1_folders_agree_when_intact(tmp_path: Path) -> None:
    write_folder(tmp_path / "p", "producer", tp_size=2, layer_sums=True)
    write_folder(tmp_path / "c", "consumer", tp_size=1, layer_sums=True)
    producer, consumer = (read_output(tmp_path / side).record for side in ("p", "c"))
    for rid in TOKENS:
        left, right = producer.requests[rid].groups[0], consumer.requests[rid].groups[0]
        assert left.layer_sums is not None and right.layer_sums is not None
        assert left.layer_sums.parts == right.layer_sums.parts
        assert len(left.layer_sums.parts) == 2 * len(LAYERS)
        np.testing.assert_array_equal(left.layer_sums.values, right.layer_sums.values)
        total = left.layer_sums.values.sum(axis=1, dtype=np.uint64)
        np.testing.assert_array_equal(total, left.totals())
    assert run("diff", str(tmp_path / "p"), str(tmp_path / "c"))[0] == 0
    assert HEADS == 4 and BLOCK == 16  # the flips above are placed for these


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda s: s.update(parts=[[0, "Q"]]), "expected [layer, one of K, V, KV]"),
        (lambda s: s.update(parts=s["parts"] + s["parts"][:1]), "listed twice"),
        (lambda s: s.update(sums=s["sums"][:-4]), "bytes, expected"),
        (lambda s: s.update(sums="%%%%"), "not base64"),
        (lambda s: s.update(extra=1), "unknown key"),
    ],
)
def test_a_bad_layer_sums_entry_is_one_line_exit_2(tmp_path: Path, change, words: str) -> None:
    write_folder(tmp_path / "c", "consumer", layer_sums=True)
    path = tmp_path / "c" / "workers" / "pp0-tp0" / "checksums.jsonl"
    lines = path.read_text().splitlines()
    line = json.loads(lines[1])
    change(line["groups"]["0"]["layer_sums"])
    path.write_text("\n".join([lines[0], json.dumps(line), *lines[2:]]) + "\n")
    status, text = run("checksum", str(tmp_path / "c"))
    assert status == 2, text
    assert text.count("\n") == 1 and words in text and "line 2" in text, text
    assert 'groups["0"].layer_sums' in text, text


def test_the_settings_turn_layer_sums_on_by_default_and_refuse_bad_values() -> None:
    from kvaudit.core.errors import KvauditError
    from kvaudit.integrations.sglang.recording import settings_from_environment
    from kvaudit.integrations.vllm.config import parse_config

    assert parse_config({}).layer_sums is True
    assert parse_config({"layer_sums": False}).layer_sums is False
    with pytest.raises(KvauditError, match="layer_sums: expected true or false, got 'yes'"):
        parse_config({"layer_sums": "yes"})
    assert settings_from_environment({}).layer_sums is True
    assert settings_from_environment({"KVAUDIT_SGLANG_LAYER_SUMS": "0"}).layer_sums is False
    with pytest.raises(KvauditError, match="KVAUDIT_SGLANG_LAYER_SUMS: expected 0 or 1"):
        settings_from_environment({"KVAUDIT_SGLANG_LAYER_SUMS": "2"})


def test_layer_sums_compare_at_the_coarser_block_and_whole_where_planes_differ() -> None:
    from kvaudit.compare.groups import layer_differences
    from kvaudit.records import GroupChecksums, LayerSums

    def side(block: int, parts: list, rows: list[list[int]]) -> GroupChecksums:
        values = np.array(rows, dtype=np.uint64)
        totals = values.sum(axis=1, dtype=np.uint64).reshape(-1, 1)
        return GroupChecksums(block, 0, [(1, 0)], totals, 0, layer_sums=LayerSums(parts, values))

    kv = [(0, "K"), (0, "V"), (1, "K"), (1, "V")]
    # Two 16-token blocks against one 32-token block: (1+3, 2+4) = (4, 6) against (4, 7).
    fine = side(16, kv, [[1, 2, 5, 6], [3, 4, 7, 8]])
    coarse = side(32, kv, [[4, 7, 12, 14]])
    assert layer_differences(fine, coarse, (32, 32), [0]) == {0: [(0, "V")]}
    # A consumer that stores layer 1 as whole cells: layer 1 is compared whole.
    whole = side(32, [(0, "K"), (0, "V"), (1, "KV")], [[4, 6, 27]])
    assert layer_differences(fine, whole, (32, 32), [0]) == {0: [(1, "KV")]}
    assert layer_differences(fine, side(32, kv, [[4, 6, 12, 14]]), (32, 32), [0]) == {}


def test_the_differing_layer_sums_in_words() -> None:
    from kvaudit.diagnosis.findings import layer_parts_text

    assert layer_parts_text([(2, "V")]) == "layer 2 V differs"
    assert layer_parts_text([(5, "KV")]) == "layer 5 differs"
    every = [(n, p) for n in range(4) for p in ("K", "V")]
    assert layer_parts_text(every) == "layers 0-3 K and V differ"
    assert layer_parts_text([(1, "K"), (3, "V"), (4, "V")]) == "layer 1 K, layers 3-4 V differ"


TRITON_CHILD = """
import numpy as np
from test_layer_sums import make_layers
from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.description import parse_description

for layout in ("KNTHD", "NHTC"):
    description, tensors, _ = make_layers(0, 1, layout)
    parsed = parse_description(description, "test")
    request = {"r": RequestBlocks(10, {0: (0, [4, 1, 3])})}
    groups = [
        Checksummer(parsed, tensors, role="consumer", backend=backend, layer_sums=True)
        .checksum(request).requests["r"].groups[0]
        for backend in ("numpy", "triton")
    ]
    assert groups[0].layer_sums.parts == groups[1].layer_sums.parts
    np.testing.assert_array_equal(groups[0].layer_sums.values, groups[1].layer_sums.values)
    np.testing.assert_array_equal(groups[0].values, groups[1].values)
print("same")
"""


def test_the_triton_kernel_gives_the_same_layer_sums() -> None:
    """The Triton kernel (under Triton's interpreter where no GPU is here) with its parts'
    columns per layer and plane, the whole-cell layout split into K and V halves."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    root = here.parents[1]
    path = os.pathsep.join([str(here), str(root / "tests"), str(root)])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CHILD], capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]
