"""``kvaudit diff``, ``verify`` and ``corrupt`` end to end.

The example's producer (TP=2) and consumer (TP=4, another layout and block ids) and its
consumer with a planted stale block are diffed in every output form; the located
differences are checked against the dump files decoded with safetensors and the model's
KV (bfloat16 values), never against kvaudit's own reading. Small ``kvbuild`` engines,
whose checksums, fingerprints and wire bytes the tests compute from the spec alone
(``tests/helpers/reference.py``, ``struct``), carry received producer checksums and stored
checksums of offloaded blocks for ``verify``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from helpers import kvbuild as kb
from helpers import reference as ref
from helpers.example_module import example
from helpers.report_keys import DIFF_KEYS, GROUP_KEYS, OPTIONAL_GROUP_KEYS
from safetensors import safe_open

from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.cli import main
from kvaudit.corrupt import MODES
from kvaudit.description import description_to_dict, parse_description
from kvaudit.description.fingerprint import block_checksum_tag
from kvaudit.dumps import open_dump, write_dump
from kvaudit.records import WorkerInfo

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "make_example.py"
SEED = 4
LOCATED_KEYS = {
    "position",
    "layer",
    "head",
    "tokens",
    "first_byte",
    "max_abs_error",
    "max_rel_error",
    "scaled_error",
    "consumer_worker",
    "file",
    "differing_bytes",
    "differing_bits",
    "consumer_zeros",
    "nonfinite",
}


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def strict_json(text: str) -> dict:
    """JSON that holds no NaN or Infinity."""

    def reject(name: str) -> float:
        raise AssertionError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=reject)


def diff_json(*args: object, status: int) -> dict:
    result = run("diff", *args, "--format", "json")
    assert result.exit_code == status, result.output
    report = strict_json(result.stdout)
    check_shape(report)
    assert report["ok"] is (status == 0)
    return report


def check_shape(report: dict) -> None:
    """The ``kvaudit.diff/1`` shape of docs/cli.md."""
    assert set(report) == DIFF_KEYS
    assert report["format"] == "kvaudit.diff/1"
    assert report["positions"] in ("request", "block")
    for request in report["requests"].values():
        assert set(request) == {"num_tokens", "groups"}
        for gid, group in request["groups"].items():
            assert gid.isdigit() and GROUP_KEYS <= set(group) <= GROUP_KEYS | OPTIONAL_GROUP_KEYS
            assert isinstance(group["compared"], int)
            assert all(isinstance(p, int) for p in group["mismatched_positions"])
            assert all(len(pair) == 2 for pair in group["replicas_differing"])
            assert group["unverified"] is None or isinstance(group["unverified"], str)
            assert all(isinstance(p, int) for p in group["missing_positions"])
            for entry in group["located"]:
                optional = {"replica", "holds", "kv_exchanged", "element"}
                assert LOCATED_KEYS <= set(entry) <= LOCATED_KEYS | optional
                assert set(entry["consumer_worker"]) == {"tp_rank", "pp_rank"}
                for key in ("max_abs_error", "max_rel_error", "scaled_error"):
                    assert entry[key] is None or isinstance(entry[key], float)


def assert_one_line_error(result: Result, *names: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvaudit: error: "), result.stderr
    for name in names:
        assert name in lines[0], lines[0]


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example: producer, consumer and consumer-broken."""
    root = tmp_path_factory.mktemp("example")
    example.make_example(root, seed=SEED)
    return root


# The example's files decoded independently.


def consumer_cells(path: Path, request_id: str) -> dict[tuple[str, int, int], np.ndarray]:
    """``(layer, global head, token) -> uint8 cell`` (K row then V row) of a request in
    one of the example consumer's dumps (KNHTD, 2 heads per rank), via safetensors."""
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name) for name in example.LAYERS}
    worker = json.loads(metadata["kvaudit.worker"])
    rows = {block: row for row, block in enumerate(json.loads(metadata["kvaudit.blocks"]))}
    request = json.loads(metadata["kvaudit.requests"])[request_id]
    _, block_ids = request["groups"]["0"]
    heads = example.KV_HEADS // worker["tp_size"]
    cells = {}
    for name, tensor in tensors.items():
        for token in range(request["num_tokens"]):
            row = rows[block_ids[token // example.BLOCK_SIZE]]
            slot = token % example.BLOCK_SIZE
            for h in range(heads):
                kv = tensor[:, row, h, slot]  # [2, head_size]: K then V
                cell = kv.contiguous().view(torch.uint8).numpy().reshape(-1)
                cells[name, worker["tp_rank"] * heads + h, token] = cell
    return cells


def model_cell(kv: dict[str, torch.Tensor], request_id: str, name: str, head: int, token: int):
    """The model's cell and its bfloat16 values as float64."""
    values = kv[request_id][example.LAYERS.index(name), token, head]  # [2, head_size]
    raw = values.contiguous().view(torch.uint8).numpy().reshape(-1)
    return raw, values.to(torch.float64).numpy().reshape(-1)


def expected_located(sets: Path, folder: str, rank: int, request_id: str) -> list[dict]:
    """The located entries of the differences between one consumer rank's dump and the
    model's KV, from the bytes and bfloat16 values: per (layer, head), the differing
    tokens, the first differing byte and the largest errors, and the rank's file."""
    kv = example.model_kv(SEED)
    path = Path(os.path.normpath(sets / folder / f"rank{rank}.safetensors"))
    cells = consumer_cells(path, request_id)
    found: dict[tuple[int, str, int], list] = {}
    largest: dict[tuple[int, str, int], float] = {}  # the producer's, per slice and block
    for (name, head, token), cell in cells.items():
        raw, values = model_cell(kv, request_id, name, head, token)
        magnitudes = np.abs(values[np.isfinite(values)])
        key = (token // example.BLOCK_SIZE, name, head)
        largest[key] = max(largest.get(key, 0.0), float(magnitudes.max(initial=0.0)))
        if np.array_equal(raw, cell):
            continue
        mine = torch.from_numpy(cell.copy()).view(torch.bfloat16).to(torch.float64).numpy()
        differ = (raw.reshape(-1, 2) != cell.reshape(-1, 2)).any(axis=1)  # bf16 elements
        errors = np.abs(values[differ] - mine[differ])
        with np.errstate(divide="ignore"):
            relative = errors / np.abs(values[differ])
        key = (token // example.BLOCK_SIZE, name, head)
        flipped = [int(x) ^ int(y) for x, y in zip(raw.tolist(), cell.tolist())]
        found.setdefault(key, []).append(
            (
                token,
                int(np.flatnonzero(raw != cell)[0]),
                errors.max(),
                relative.max(),
                sum(1 for value in flipped if value),
                sum(bin(value).count("1") for value in flipped),
                not cell.any(),
                int((np.isfinite(values) & ~np.isfinite(mine)).sum()),
                [(int(k), float(values[k]), float(mine[k])) for k in np.flatnonzero(differ)],
                np.array_equal(cell.reshape(2, -1)[::-1], raw.reshape(2, -1)),
            )
        )
    entries = []
    heads = kv[request_id].shape[2]
    for (position, name, head), items in sorted(found.items()):
        items.sort()
        # The other model slice whose cells at the block's tokens this slice holds.
        size = example.BLOCK_SIZE
        held = sorted(t for (n, h, t) in cells if (n, h) == (name, head) and t // size == position)
        holds = [
            {"layer": other, "head": h}
            for other in example.LAYERS
            for h in range(heads)
            if (other, h) != (name, head)
            and all(
                np.array_equal(cells[name, head, t], model_cell(kv, request_id, other, h, t)[0])
                for t in held
            )
        ]
        worst = float(max(item[2] for item in items))
        scale = largest[position, name, head]
        scaled = 0.0 if worst == 0 else (worst / scale if scale and np.isfinite(worst) else None)
        entries.append(
            {
                "position": position,
                "layer": name,
                "head": head,
                "tokens": [item[0] for item in items],
                "first_byte": items[0][1],
                "max_abs_error": float(max(item[2] for item in items)),
                "max_rel_error": float(max(item[3] for item in items)),
                "scaled_error": scaled,
                "consumer_worker": {"tp_rank": rank, "pp_rank": 0},
                "file": str(path),
                "differing_bytes": sum(item[4] for item in items),
                "differing_bits": sum(item[5] for item in items),
                "consumer_zeros": all(item[6] for item in items),
                "nonfinite": sum(item[7] for item in items),
                **({"holds": holds[0]} if holds else {}),
                **({"kv_exchanged": True} if all(item[9] for item in items) else {}),
                **element_of(items),
            }
        )
    return entries


def element_of(items: list) -> dict:
    """The one changed element of a slice's differing cells (K then V rows of
    ``HEAD_SIZE`` bf16 elements each), as the JSON says it; empty where not one."""
    if len(items) != 1 or len(items[0][8]) != 1:
        return {}
    [(k, before, after)] = items[0][8]
    part, index = ("K", k) if k < example.HEAD_SIZE else ("V", k - example.HEAD_SIZE)
    element = {"part": part, "index": index, "dtype": "bfloat16"}
    return {"element": element | {"before": before, "after": after}}


# diff on the example.


def test_clean_diff_table(sets: Path) -> None:
    result = run("diff", sets / "producer", sets / "consumer")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "OK: 3 requests, 27 blocks compared, all match" in text
    for request_id in example.REQUESTS:
        assert request_id in text
    assert "Located" not in text and "MISMATCH" not in text


def test_broken_diff_table_names_the_fault(sets: Path) -> None:
    result = run("diff", sets / "producer", sets / "consumer-broken", "--all")
    assert result.exit_code == 1, result.output
    text = result.stdout
    assert "MISMATCH: 1 of 27 blocks compared differ, in 1 of 3 requests" in text
    located = [line for line in text.splitlines() if "req-medium" in line and "layers." in line]
    # Rank 1 of the TP=4 consumer holds heads 2 and 3: every layer, both heads, 64-79.
    assert len(located) == 8
    for line in located:
        assert " 64-79 " in line
    assert {line.split("│")[5].strip() for line in located} == {"2", "3"}


def test_broken_diff_json_locates_exactly(sets: Path) -> None:
    report = diff_json(sets / "producer", sets / "consumer-broken", status=1)
    assert report["positions"] == "request"
    assert report["only_in_producer"] == report["only_in_consumer"] == []
    groups = {rid: request["groups"]["0"] for rid, request in report["requests"].items()}
    assert set(groups) == set(example.REQUESTS)
    for rid, num_tokens in example.REQUESTS.items():
        assert groups[rid]["compared"] == -(-num_tokens // 16)
        assert groups[rid]["unverified"] is None and groups[rid]["replicas_differing"] == []
    assert groups["req-short"]["located"] == groups["req-long"]["located"] == []
    medium = groups["req-medium"]
    assert medium["mismatched_positions"] == [4]
    expected = expected_located(sets, "consumer-broken", example.BROKEN_RANK, "req-medium")
    assert len(expected) == 8
    assert medium["located"] == expected
    # The intact consumer's same rank agrees with the model everywhere.
    assert expected_located(sets, "consumer", example.BROKEN_RANK, "req-medium") == []


def test_junit(sets: Path) -> None:
    result = run("diff", sets / "producer", sets / "consumer-broken", "--format", "junit")
    assert result.exit_code == 1
    root = ET.fromstring(result.stdout.split("\n", 1)[1])
    suite = root.find("testsuite")
    # Named after the sides, so that several consumers' reports stay apart in one CI view.
    assert suite is not None and suite.get("name") == "kvaudit.diff producer->consumer-broken"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "0")
    cases = {case.get("classname"): case for case in suite.iter("testcase")}
    prefix = "kvaudit.producer->consumer-broken"
    assert set(cases) == {f"{prefix}.{rid}" for rid in example.REQUESTS}
    failure = cases[f"{prefix}.req-medium"].find("failure")
    assert failure is not None and "positions 4" in failure.get("message", "")
    assert "model.layers.3.self_attn.attn" in (failure.text or "")
    assert cases[f"{prefix}.req-short"].find("failure") is None

    clean = run("diff", sets / "producer", sets / "consumer", "--format", "junit")
    assert clean.exit_code == 0 and 'failures="0"' in clean.stdout
    named = run("diff", sets / "producer", sets / "consumer", "--format", "junit", "--name", "d7")
    assert '<testsuite name="kvaudit.diff d7"' in named.stdout
    assert 'classname="kvaudit.d7.req-short"' in named.stdout


def test_output_file(sets: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run("diff", sets / "producer", sets / "consumer-broken", "--format", "json", "-o", out)
    assert result.exit_code == 1 and result.stdout == ""
    assert strict_json(out.read_text()) == diff_json(
        sets / "producer", sets / "consumer-broken", status=1
    )
    table = tmp_path / "report.txt"
    assert run("diff", sets / "producer", sets / "consumer-broken", "-o", table).exit_code == 1
    text = table.read_text()
    assert "MISMATCH" in text and "64-79" in text and "\x1b[" not in text
    junit = tmp_path / "report.xml"
    assert run("diff", sets / "producer", sets / "consumer", "--format", "junit", "-o", junit)
    ET.parse(junit)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.txt", "report.xml"]
    # A failed run writes nothing and leaves an existing file alone.
    out.write_text("previous\n")
    failed = run("diff", sets / "producer", sets / "nothing", "--format", "json", "-o", out)
    assert_one_line_error(failed, "nothing")
    assert out.read_text() == "previous\n"


def test_request_filter_and_no_locate(sets: Path) -> None:
    report = diff_json(
        sets / "producer", sets / "consumer-broken", "--request", "req-short", status=0
    )
    assert list(report["requests"]) == ["req-short"]
    report = diff_json(
        sets / "producer",
        sets / "consumer-broken",
        "--request",
        "req-medium",
        "--request",
        "req-long",
        "--no-locate",
        status=1,
    )
    assert list(report["requests"]) == ["req-medium", "req-long"]
    assert report["requests"]["req-medium"]["groups"]["0"]["mismatched_positions"] == [4]
    assert report["requests"]["req-medium"]["groups"]["0"]["located"] == []
    unknown = run("diff", sets / "producer", sets / "consumer", "--request", "req-x")
    assert_one_line_error(unknown, "req-x")


def test_records_on_one_or_both_sides(sets: Path, tmp_path: Path) -> None:
    saved = {}
    for name in ("producer", "consumer", "consumer-broken"):
        saved[name] = tmp_path / f"{name}.json"
        result = run("checksum", sets / name, "--format", "json", "-o", saved[name])
        assert result.exit_code == 0
    for producer, consumer in (
        (saved["producer"], sets / "consumer-broken"),
        (sets / "producer", saved["consumer-broken"]),
        (saved["producer"], saved["consumer-broken"]),
    ):
        report = diff_json(producer, consumer, status=1)
        medium = report["requests"]["req-medium"]["groups"]["0"]
        assert medium["mismatched_positions"] == [4] and medium["located"] == []
    assert diff_json(saved["producer"], saved["consumer"], status=0)["ok"] is True
    # Locating needs the raw KV on both sides.
    result = run("diff", saved["producer"], sets / "consumer-broken", "--locate")
    assert_one_line_error(result, "producer.json", "--locate")


def test_block_numbering_follows_the_record(sets: Path, tmp_path: Path) -> None:
    by_block = tmp_path / "block.json"
    assert (
        run(
            "checksum",
            sets / "producer",
            "--positions",
            "block",
            "--format",
            "json",
            "-o",
            by_block,
        ).exit_code
        == 0
    )
    # The consumer's dumps are checksummed with the record's numbering.
    report = diff_json(by_block, sets / "consumer", status=0)
    assert report["positions"] == "block"
    by_request = tmp_path / "request.json"
    run("checksum", sets / "consumer", "--format", "json", "-o", by_request)
    assert_one_line_error(run("diff", by_block, by_request), "numbering")


def test_verify_against(sets: Path, tmp_path: Path) -> None:
    saved_producer = tmp_path / "producer.json"
    saved_consumer = tmp_path / "consumer.json"
    run("checksum", sets / "producer", "--format", "json", "-o", saved_producer)
    run("checksum", sets / "consumer", "--format", "json", "-o", saved_consumer)
    for saved in (saved_producer, saved_consumer):
        ok = run("verify", sets / "consumer", "--against", saved)
        assert ok.exit_code == 0, ok.output
        assert "OK: 3 requests, 27 blocks compared, all match" in ok.stdout
        result = run("verify", sets / "consumer-broken", "--against", saved, "--format", "json")
        assert result.exit_code == 1
        report = strict_json(result.stdout)
        check_shape(report)
        assert report["requests"]["req-medium"]["groups"]["0"]["mismatched_positions"] == [4]
    # The record of another set: a request it lacks is a failure.
    short = tmp_path / "short.json"
    run("checksum", sets / "consumer", "--request", "req-short", "--format", "json", "-o", short)
    result = run("verify", short, "--against", saved_producer, "--format", "json")
    assert result.exit_code == 1
    assert strict_json(result.stdout)["only_in_producer"] == ["req-long", "req-medium"]


# corrupt, then diff finds it.


PLANTED_KINDS = {
    "flip": "bit_flip",
    "zero": "zeros",
    "swap-tokens": "foreign_tokens",
    "swap-heads": "heads_exchanged",
    "stale": "stale_block",
    "shift": "tokens_shifted",
}
"""The fault kind the diagnosis names for each planted mode."""


@pytest.mark.parametrize("mode", MODES)
def test_corrupt_every_mode_then_diff_finds_it(sets: Path, tmp_path: Path, mode: str) -> None:
    broken = tmp_path / "consumer"
    broken.mkdir()
    for rank in (0, 1, 3):
        shutil.copy(sets / "consumer" / f"rank{rank}.safetensors", broken)
    target = broken / "rank2.safetensors"
    args = ["--request", "req-long", "--group", "0", "--position", "5", "--mode", mode]
    result = run("corrupt", sets / "consumer" / "rank2.safetensors", "-o", target, *args,
                 "--seed", "3", "--format", "json")  # fmt: skip
    assert result.exit_code == 0, result.output
    planted = json.loads(result.stdout)
    assert planted["mode"] == mode and planted["position"] == 5
    text = run("corrupt", sets / "consumer" / "rank2.safetensors", "-o", tmp_path / "t", *args,
               "--seed", "3")  # fmt: skip
    assert text.exit_code == 0 and f"planted {mode}" in text.stdout

    report = diff_json(sets / "producer", broken, status=1)
    group = report["requests"]["req-long"]["groups"]["0"]
    assert group["mismatched_positions"] == [5]
    located = {(e["layer"], e["head"], tuple(e["tokens"])) for e in group["located"]}
    changed = {(c["layer"], c["head"], tuple(c["tokens"])) for c in planted["changes"]}
    assert located == changed
    assert all(e["position"] == 5 for e in group["located"])
    assert group["located"] == expected_located_in(sets, broken, "req-long")
    # The diagnosis names what was planted, every located entry explained.
    kinds = [finding["kind"] for finding in report["diagnosis"]]
    assert kinds == [PLANTED_KINDS[mode]]
    assert report["diagnosis"][0]["located"] == len(group["located"])
    assert report["diagnosis"][0]["positions"] == [5]


def expected_located_in(sets: Path, folder: Path, request_id: str) -> list[dict]:
    relative = os.path.relpath(folder, sets)
    return expected_located(sets, relative, 2, request_id)


# Small engines for verify --received and --stored.

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
MODEL = kb.Model(
    (kb.GroupModel(0, tuple(kb.Attn(name, 4, 8) for name in LAYERS), block_size=16),),
    model_kv_heads=4,
)
TOKENS = {"r1": 40, "r2": 21}
FINGERPRINT = ref.fingerprint([(name, "FullAttentionSpec", "torch.bfloat16") for name in LAYERS])


@dataclass
class Small:
    """The requests' KV, their totals from the reference, and engines built from them."""

    requests: dict[str, kb.RequestKV]
    totals: dict[str, list[int]]


@pytest.fixture(scope="module")
def small() -> Small:
    requests = {
        rid: kb.make_request(MODEL, n, seed=i + 7) for i, (rid, n) in enumerate(TOKENS.items())
    }
    totals = {
        rid: [
            int(v)
            for v in ref.total(
                ref.block_checksums(kb.reference_group(MODEL, 0, kv, 1), kv.num_tokens)
            )
        ]
        for rid, kv in requests.items()
    }
    return Small(requests, totals)


def wire(
    totals: list[int], fingerprint: int = FINGERPRINT, start: int = 0, num_tokens: int = 0
) -> bytes:
    """The spec's KVC2 bytes of one request's one group (group 0, block size 16, request
    positions)."""
    header = b"KVC2" + struct.pack("<QBH", num_tokens, 0, 1)
    group = struct.pack("<IQIII", 0, fingerprint, 16, start, len(totals))
    return header + group + struct.pack(f"<{len(totals)}Q", *totals)


def write_engine(
    workers: list[kb.Worker], folder: Path, role: str, **extra: dict
) -> list[kb.Worker]:
    """Each worker's dump in ``folder``; ``extra`` maps a keyword of ``write_dump`` to its
    value per TP rank."""
    folder.mkdir(parents=True, exist_ok=True)
    for w in workers:
        path = folder / f"rank{w.tp_rank}.safetensors"
        blocks = {rid: RequestBlocks(n, dict(t)) for rid, (n, t) in w.requests.items()}
        info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, role, "test")
        kwargs = {key: value[w.tp_rank] for key, value in extra.items()}
        write_dump(path, parse_description(w.description, str(path)), w.tensors, blocks,
                   worker=info, **kwargs)  # fmt: skip
    return workers


def test_verify_received(small: Small, tmp_path: Path) -> None:
    workers = kb.build_engine(MODEL, small.requests, kb.Engine(tp_size=2, seed=3))
    good = {rid: wire(small.totals[rid], num_tokens=TOKENS[rid]) for rid in TOKENS}
    write_engine(workers, tmp_path / "good", "consumer", received=[good, good])
    result = run("verify", tmp_path / "good", "--received")
    assert result.exit_code == 0, result.output
    assert "OK: 2 requests, 5 blocks compared, all match" in result.stdout

    wrong_totals = [*small.totals["r1"][:2], small.totals["r1"][2] ^ 1]
    wrong = dict(good, r1=wire(wrong_totals, num_tokens=TOKENS["r1"]))
    write_engine(workers, tmp_path / "wrong", "consumer", received=[wrong, wrong])
    report = strict_json(run("verify", tmp_path / "wrong", "--received", "--format", "json").stdout)
    check_shape(report)
    assert report["requests"]["r1"]["groups"]["0"]["mismatched_positions"] == [2]
    assert report["requests"]["r2"]["groups"]["0"]["mismatched_positions"] == []

    partial = {"r1": good["r1"]}
    write_engine(workers, tmp_path / "partial", "consumer", received=[partial, partial])
    result = run("verify", tmp_path / "partial", "--received", "--format", "json")
    assert result.exit_code == 1
    report = strict_json(result.stdout)
    assert report["requests"]["r2"]["groups"]["0"]["unverified"] == "no producer checksums received"
    assert report["requests"]["r1"]["groups"]["0"]["unverified"] is None

    cut = {rid: data[:-3] for rid, data in good.items()}
    write_engine(workers, tmp_path / "cut", "consumer", received=[cut, cut])
    # The message names the dump file that carries the bytes (cli.md, exit status 2).
    cut_file = str(tmp_path / "cut" / "rank0.safetensors")
    assert_one_line_error(run("verify", tmp_path / "cut", "--received"), "r1", cut_file)

    write_engine(workers, tmp_path / "split", "consumer", received=[good, wrong])
    assert_one_line_error(run("verify", tmp_path / "split", "--received"), "received")


def test_verify_stored(small: Small, tmp_path: Path) -> None:
    # One offload worker (TP=1): its partial sum of a block is the block's checksum.
    workers = kb.build_engine(MODEL, small.requests, kb.Engine(tp_size=1, seed=5))
    num_blocks = workers[0].description["num_blocks"]

    def block_hash(rid: str, position: int) -> bytes:
        return hashlib.sha256(f"{rid}/{position}".encode()).digest()

    stored = np.zeros(num_blocks, dtype=np.uint64)
    hashes: dict[str, dict[int, list[bytes]]] = {}
    for rid, (_, tables) in workers[0].requests.items():
        _, block_ids = tables[0]
        hashes[rid] = {0: [block_hash(rid, p) for p in range(len(block_ids))]}
        for position, block_id in enumerate(block_ids):
            tag = block_checksum_tag(block_hash(rid, position), FINGERPRINT)
            stored[block_id] = small.totals[rid][position] ^ tag
    write_engine(workers, tmp_path / "good", "offload", stored_checksums=[stored],
                 block_hashes=[hashes])  # fmt: skip
    result = run("verify", tmp_path / "good", "--stored")
    assert result.exit_code == 0, result.output
    assert "OK: 2 requests, 5 blocks checked, all match" in result.stdout

    # A wrong stored entry, a block that holds another block's hash, and corrupted KV.
    r1_blocks = workers[0].requests["r1"][1][0][1]
    bad = stored.copy()
    bad[r1_blocks[1]] ^= np.uint64(1 << 40)
    moved = {"r1": hashes["r1"], "r2": {0: [block_hash("r2", 1), block_hash("r2", 1)]}}
    write_engine(workers, tmp_path / "bad", "offload", stored_checksums=[bad],
                 block_hashes=[moved])  # fmt: skip
    report = strict_json(run("verify", tmp_path / "bad", "--stored", "--format", "json").stdout)
    check_shape(report)
    assert report["requests"]["r1"]["groups"]["0"]["mismatched_positions"] == [1]
    assert report["requests"]["r2"]["groups"]["0"]["mismatched_positions"] == [0]

    good_file = tmp_path / "good" / "rank0.safetensors"
    corrupted = tmp_path / "corrupted" / "rank0.safetensors"
    corrupted.parent.mkdir()
    assert run("corrupt", good_file, "-o", corrupted, "--request", "r2", "--group", "0",
               "--position", "1", "--mode", "zero").exit_code == 0  # fmt: skip
    result = run("verify", corrupted.parent, "--stored", "--format", "json")
    assert result.exit_code == 1
    report = strict_json(result.stdout)
    assert report["requests"]["r2"]["groups"]["0"]["mismatched_positions"] == [1]
    assert report["requests"]["r1"]["groups"]["0"]["mismatched_positions"] == []

    # Hashes of the leading blocks only: those are checked; none at all, or no stored
    # checksums in the dump: unverified.
    leading = {"r1": {0: hashes["r1"][0][:2]}}
    write_engine(workers, tmp_path / "leading", "offload", stored_checksums=[stored],
                 block_hashes=[leading])  # fmt: skip
    result = run("verify", tmp_path / "leading", "--stored", "--format", "json")
    assert result.exit_code == 1
    report = strict_json(result.stdout)
    assert report["requests"]["r1"]["groups"]["0"]["compared"] == 2
    assert report["requests"]["r1"]["groups"]["0"]["unverified"] is None
    assert "block hash" in report["requests"]["r2"]["groups"]["0"]["unverified"]
    assert run("verify", tmp_path / "leading", "--stored", "--request", "r1").exit_code == 0

    write_engine(workers, tmp_path / "none", "offload", block_hashes=[hashes])
    result = run("verify", tmp_path / "none", "--stored", "--format", "json")
    assert result.exit_code == 1
    report = strict_json(result.stdout)
    assert "no stored checksums" in report["requests"]["r1"]["groups"]["0"]["unverified"]


def test_non_finite_errors_are_null(small: Small, tmp_path: Path) -> None:
    """A NaN where the producer has a number: an infinite error, null in JSON."""
    producer = kb.build_engine(MODEL, small.requests, kb.Engine(tp_size=2, seed=8))
    consumer = kb.build_engine(MODEL, small.requests, kb.Engine(tp_size=1, seed=9))
    _, block_ids = consumer[0].requests["r1"][1][0]
    row = kb.slot_rows(consumer[0], LAYERS[1], block_ids[1], 3, 2)[0]
    row[6:8] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)  # element 3 of K: bf16 NaN
    original = small.requests["r1"].data[LAYERS[1]][19, 2]
    changed = original.copy()
    changed[6:8] = [0xC0, 0x7F]
    write_engine(producer, tmp_path / "producer", "producer")
    write_engine(consumer, tmp_path / "consumer", "consumer")
    report = diff_json(tmp_path / "producer", tmp_path / "consumer", status=1)
    located = report["requests"]["r1"]["groups"]["0"]["located"]
    assert located == [
        {
            "position": 1,
            "layer": LAYERS[1],
            "head": 2,
            "tokens": [19],
            "first_byte": int(np.flatnonzero(original != changed)[0]),
            "max_abs_error": None,
            "max_rel_error": None,
            "scaled_error": None,
            "consumer_worker": {"tp_rank": 0, "pp_rank": 0},
            "file": str(tmp_path / "consumer" / "rank0.safetensors"),
            "differing_bytes": int(np.count_nonzero(original != changed)),
            "differing_bits": sum(
                bin(int(x) ^ int(y)).count("1") for x, y in zip(original, changed)
            ),
            "consumer_zeros": False,
            "nonfinite": 1,
            "element": {
                "part": "K",
                "index": 3,
                "dtype": "bfloat16",
                "before": torch.from_numpy(original[6:8].copy()).view(torch.bfloat16).item(),
                "after": "nan",
            },
        }
    ]
    assert [finding["kind"] for finding in report["diagnosis"]] == ["nonfinite"]
    table = run("diff", tmp_path / "producer", tmp_path / "consumer")
    assert table.exit_code == 1 and "NaN/Inf: 1 consumer element is NaN" in table.stdout
    table = run("diff", tmp_path / "producer", tmp_path / "consumer", "--all")
    assert table.exit_code == 1 and " inf " in table.stdout


# Bad input.


def test_bad_inputs(sets: Path, tmp_path: Path) -> None:
    producer, consumer = sets / "producer", sets / "consumer"
    assert_one_line_error(run("diff", producer, tmp_path / "absent"), "absent")
    truncated = tmp_path / "cut" / "rank0.safetensors"
    truncated.parent.mkdir()
    data = (consumer / "rank0.safetensors").read_bytes()
    truncated.write_bytes(data[: len(data) // 3])
    assert_one_line_error(run("diff", producer, truncated.parent), "rank0.safetensors")
    assert_one_line_error(run("diff", producer, consumer, "--format", "csv"), "--format")
    assert_one_line_error(run("diff", producer), "CONSUMER")
    assert_one_line_error(run("verify", consumer), "--against")
    assert_one_line_error(run("verify", consumer, "--received", "--stored"), "--received")
    record = tmp_path / "record.json"
    run("checksum", producer, "--format", "json", "-o", record)
    assert_one_line_error(run("verify", record, "--stored"), "record.json")
    assert_one_line_error(run("verify", consumer, "--against", tmp_path / "none.json"), "none.json")

    source = consumer / "rank0.safetensors"
    out = tmp_path / "out.safetensors"
    base = ["corrupt", source, "-o", out, "--request", "req-short", "--group", "0"]
    assert_one_line_error(run(*base, "--position", "9"), "position 9")
    assert_one_line_error(run(*base, "--position", "0", "--mode", "melt"), "--mode")
    assert_one_line_error(run(*base, "--position", "0", "--layer", "nope"), "nope")
    assert_one_line_error(run(*base, "--position", "0", "--head", "7"), "head 7")
    assert_one_line_error(run(*base[:-2], "--group", "3", "--position", "0"), "group 3")
    assert_one_line_error(run("corrupt", consumer, "-o", out, "--request", "req-short",
                              "--group", "0", "--position", "0"), "directory")  # fmt: skip
    assert_one_line_error(run("corrupt", source, "-o", source, "--request", "req-short",
                              "--group", "0", "--position", "0"), "SOURCE")  # fmt: skip
    assert_one_line_error(run(*base, "--position", "0", "-c", tmp_path / "c.yaml"), "c.yaml")
    assert_one_line_error(run("corrupt", source, "--request", "req-short", "--group", "0",
                              "--position", "0"), "-o")  # fmt: skip
    assert not out.exists()


def test_corrupt_with_a_config(sets: Path, tmp_path: Path) -> None:
    """``-c`` gives corrupt the description (here the one the dump embeds, as YAML)."""
    source = sets / "consumer" / "rank1.safetensors"
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump(description_to_dict(open_dump(source).description)))
    broken = tmp_path / "consumer"
    shutil.copytree(sets / "consumer", broken)
    target = broken / "rank1.safetensors"
    result = run("corrupt", source, "-o", target, "-c", config, "--request", "req-long",
                 "--group", "0", "--position", "3", "--mode", "zero")  # fmt: skip
    assert result.exit_code == 0, result.output
    diff = run("diff", sets / "producer", broken, "--format", "json")
    assert diff.exit_code == 1
    groups = strict_json(diff.stdout)["requests"]["req-long"]["groups"]
    assert groups["0"]["mismatched_positions"] == [3]


def test_python_m_kvaudit_diff(sets: Path) -> None:
    """The real command in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "kvaudit", "diff", str(sets / "producer"),
         str(sets / "consumer-broken"), "--format", "json", "-q"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr == ""
    report = strict_json(done.stdout)
    check_shape(report)
    assert report["requests"]["req-medium"]["groups"]["0"]["mismatched_positions"] == [4]


def test_incomplete_consumer_is_unverified(sets: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for rank in (0, 1, 3):
        shutil.copy(sets / "consumer" / f"rank{rank}.safetensors", partial)
    report = diff_json(sets / "producer", partial, status=1)
    for request in report["requests"].values():
        group = request["groups"]["0"]
        assert group["compared"] == 0 and group["mismatched_positions"] == []
        assert "a worker is missing on the consumer (pp 0, tp 2)" in group["unverified"]
    table = run("diff", sets / "producer", partial)
    assert "UNVERIFIED: 3 requests, 0 blocks compared; 3 groups could not be verified" in (
        table.stdout
    )


def test_live_handle_as_a_side(sets: Path, tmp_path: Path) -> None:
    """A live TP=1 producer (one handle, its own block ids) against the dumps."""
    handle = tmp_path / "producer_live.py"
    handle.write_text(
        f"""
import importlib.util
import sys

import numpy as np

spec = importlib.util.spec_from_file_location("ex_live", {str(EXAMPLE)!r})
ex = sys.modules["ex_live"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)


def kvaudit_live():
    engine = ex.Engine("live", 1, "NTHC", 40, "producer", "live prefill")
    rng = np.random.default_rng(1)
    tables = ex.block_tables(engine, rng)
    tensors = ex.worker_cache(engine, 0, ex.model_kv({SEED}), tables, rng)
    requests = {{
        rid: {{"num_tokens": n, "groups": {{0: [0, tables[rid]]}}}}
        for rid, n in ex.REQUESTS.items()
    }}
    return ex.description(engine), tensors, {{"role": "producer"}}, requests
"""
    )
    live = f"py:{handle}"
    assert diff_json(live, sets / "consumer", status=0)["ok"] is True
    report = diff_json(live, sets / "consumer-broken", status=1)
    medium = report["requests"]["req-medium"]["groups"]["0"]
    assert medium["located"] == expected_located(
        sets, "consumer-broken", example.BROKEN_RANK, "req-medium"
    )


def test_config_per_side(sets: Path, tmp_path: Path) -> None:
    paths = {}
    for engine in (example.PRODUCER, example.CONSUMER):
        paths[engine.name] = tmp_path / f"{engine.name}.yaml"
        paths[engine.name].write_text(yaml.safe_dump(example.description(engine)))
    both = ["--producer-config", paths["producer"], "--consumer-config", paths["consumer"]]
    assert run("diff", sets / "producer", sets / "consumer", *both).exit_code == 0
    report = diff_json(sets / "producer", sets / "consumer-broken", *both, status=1)
    assert report["requests"]["req-medium"]["groups"]["0"]["mismatched_positions"] == [4]
    # One description for both: the producer's dumps (4 heads per rank) do not match it.
    result = run("diff", sets / "producer", sets / "consumer", "-c", paths["consumer"])
    assert_one_line_error(result, "rank0.safetensors")
    # -c for both, --producer-config overriding it on the producer's side.
    ok = run("diff", sets / "producer", sets / "consumer", "-c", paths["consumer"],
             "--producer-config", paths["producer"])  # fmt: skip
    assert ok.exit_code == 0, ok.output
