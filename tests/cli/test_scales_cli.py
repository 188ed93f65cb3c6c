"""Quantized caches end to end: the per-layer K and V scales of fp8 (e4m3) KV that dumps
carry in their description, compared by ``kvaudit diff`` (table, JSON, JUnit, ``--numeric``,
``verify --against`` a record) and shown by ``inspect``; differing fingerprints name the
field that differs.

The producer (TP=2) and the consumer (TP=4, another layout, block size and block ids) hold
the same fp8 bytes, so their checksums agree whatever the scales: only the scales kept as
description data can tell them apart.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from helpers import kvbuild as kb
from helpers.valued_sets import CONSUMER, PRODUCER, draw, model, to_cells
from safetensors import safe_open

from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.cli import main
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import WorkerInfo

LAYER2 = "model.layers.2.self_attn.attn"
SCALE_LINE = f"scale differs: consumer k_scale 2.0, producer 1.0, {LAYER2}"


def dumps(
    folder: Path,
    engine: kb.Engine,
    role: str,
    dtype: str = "fp8_e4m3",
    scales: dict[str, dict[str, float]] | None = None,
) -> Path:
    """An engine's dumps of two requests of fixed values (seed 5) cast to ``dtype``, each
    layer of ``scales`` given those spec keys (``k_scale``, ``v_scale``, ``scale``)."""
    the_model = model(dtype)
    values = draw(5, the_model)
    requests = {
        rid: kb.RequestKV(
            next(iter(layers.values())).shape[0],
            {name: to_cells(array, dtype) for name, array in layers.items()},
        )
        for rid, layers in values.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    for w in kb.build_engine(the_model, requests, engine):
        for group in w.description["groups"]:
            group["layers"] = [
                {"name": layer, "spec": dict(scales[layer])}
                if isinstance(layer, str) and layer in (scales or {})
                else layer
                for layer in group["layers"]
            ]
        path = folder / f"tp{w.tp_rank}.safetensors"
        blocks = {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in w.requests.items()}
        info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, role, "test")
        write_dump(
            path, parse_description(w.description, str(path)), w.tensors, blocks, worker=info
        )
    return folder


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The producer with every scale 1.0; consumers of the same bytes with layer 2's
    k_scale doubled, and with every scale as the producer's."""
    root = tmp_path_factory.mktemp("scales")
    ones = {f"model.layers.{i}.self_attn.attn": {"scale": 1.0} for i in range(3)}
    doubled = {**ones, LAYER2: {"scale": 1.0, "k_scale": 2.0}}
    producer = dumps(root / "p", PRODUCER, "producer", scales=ones)
    consumer = dumps(root / "c", CONSUMER, "consumer", scales=doubled)
    same = dumps(root / "same", CONSUMER, "consumer", scales=ones)
    return producer, consumer, same


def test_the_scales_are_in_the_dumps_metadata_and_not_in_the_bytes(
    pair: tuple[Path, Path, Path],
) -> None:
    """The dump's ``kvaudit.cache`` holds layer 2's k_scale 2.0 (read with safetensors);
    the fp8 bytes of the consumers with and without the doubled scale are equal."""
    _, consumer, same = pair
    with safe_open(str(consumer / "tp0.safetensors"), "pt") as dump:
        cache = json.loads(dump.metadata()["kvaudit.cache"])
        doubled = dump.get_tensor(LAYER2).view(torch.uint8)
    layers = parse_description(cache, "metadata").groups[0].layers
    assert {layer.name: (layer.spec.k_scale, layer.spec.v_scale) for layer in layers} == {
        "model.layers.0.self_attn.attn": (1.0, 1.0),
        "model.layers.1.self_attn.attn": (1.0, 1.0),
        LAYER2: (2.0, 1.0),
    }
    with safe_open(str(same / "tp0.safetensors"), "pt") as dump:
        assert torch.equal(dump.get_tensor(LAYER2).view(torch.uint8), doubled)


def test_a_doubled_scale_of_byte_equal_fp8_kv_is_a_mismatch_named_in_every_form(
    pair: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Exit 1, the table names the scale, the layer and both values; the JSON's
    ``scales_differ`` and the JUnit failure carry the same line; the checksums all
    match."""
    producer, consumer, _ = pair
    table = run("diff", producer, consumer)
    assert table.exit_code == 1, table.output
    assert SCALE_LINE in table.output
    verdict = [line for line in table.output.splitlines() if line.startswith("MISMATCH")]
    assert verdict and SCALE_LINE in verdict[0]

    as_json = run("diff", producer, consumer, "--format", "json")
    assert as_json.exit_code == 1
    data = json.loads(as_json.output)
    assert data["ok"] is False and data["scales_differ"] == [SCALE_LINE]
    groups = [
        group for request in data["requests"].values() for group in request["groups"].values()
    ]
    assert groups and all(not group["mismatched_positions"] for group in groups)
    assert all(group["compared"] > 0 and group["unverified"] is None for group in groups)

    junit = run("diff", producer, consumer, "--format", "junit")
    assert junit.exit_code == 1
    root = ET.fromstring(junit.output.split("\n", 1)[1])
    failures = [case.find("failure") for case in root.iter("testcase")]
    messages = [failure.get("message") for failure in failures if failure is not None]
    assert messages == [SCALE_LINE]
    assert root.get("failures") == "1"


def test_equal_scales_pass(pair: tuple[Path, Path, Path]) -> None:
    """The same bytes under the same scales: exit 0, no scale line."""
    producer, _, same = pair
    result = run("diff", producer, same)
    assert result.exit_code == 0, result.output
    assert "scale differs" not in result.output


def test_numeric_names_the_scale(pair: tuple[Path, Path, Path]) -> None:
    """``--numeric``: layer 2's K values are twice the producer's (over the tolerance),
    and the report says why: the same scale line, in the table and the JSON."""
    producer, consumer, _ = pair
    table = run("diff", "--numeric", producer, consumer)
    assert table.exit_code == 1
    assert SCALE_LINE in table.output
    as_json = run("diff", "--numeric", producer, consumer, "--format", "json")
    data = json.loads(as_json.output)
    assert data["ok"] is False and data["scales_differ"] == [SCALE_LINE]


def test_a_record_keeps_the_scales_and_verify_against_it_names_them(
    pair: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """``checksum --format json`` keeps each layer's facts; a record of the producer
    diffed against the consumer's dumps, and ``verify --against`` it, name the scale."""
    producer, consumer, _ = pair
    saved = tmp_path / "producer.json"
    result = run("checksum", producer, "--format", "json", "--output", saved)
    assert result.exit_code == 0, result.output
    record = json.loads(saved.read_text())
    layers = record["workers"][0]["layers"]
    assert layers[LAYER2]["k_scale"] == 1.0 and layers[LAYER2]["dtype"] == "float8_e4m3fn"
    diffed = run("diff", saved, consumer)
    assert diffed.exit_code == 1 and SCALE_LINE in diffed.output
    verified = run("verify", consumer, "--against", saved)
    assert verified.exit_code == 1 and SCALE_LINE in verified.output


def test_a_record_without_layer_facts_compares_no_scale(
    pair: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A record written before layer facts were kept (no ``layers``) is still read, and
    its checksums compared: nothing to compare the scales with, so the bytes decide."""
    producer, consumer, _ = pair
    saved = tmp_path / "old.json"
    run("checksum", producer, "--format", "json", "--output", saved)
    record = json.loads(saved.read_text())
    for worker in record["workers"]:
        del worker["layers"]
    saved.write_text(json.dumps(record))
    result = run("diff", saved, consumer)
    assert result.exit_code == 0, result.output


def test_inspect_shows_the_scales(pair: tuple[Path, Path, Path]) -> None:
    """The table lists layer 2 with k_scale 2.0 apart from the other layers; the JSON
    gives every layer's scales."""
    _, consumer, _ = pair
    table = run("inspect", consumer)
    assert table.exit_code == 0, table.output
    assert "Scales" in table.output
    rows = [line for line in table.output.splitlines() if LAYER2 in line]
    assert rows and all("2.0" in row for row in rows)
    data = json.loads(run("inspect", consumer, "--format", "json").output)
    scales: dict[str, Any] = data["workers"][0]["groups"]["0"]["scales"]
    assert scales[LAYER2] == {"k_scale": 2.0, "v_scale": 1.0}
    assert scales["model.layers.0.self_attn.attn"] == {"k_scale": 1.0, "v_scale": 1.0}


def test_differing_fingerprints_name_the_dtype(tmp_path: Path) -> None:
    """A bf16 producer against an fp8 consumer: the group is unverified, and its reason
    names the dtypes, producer's first."""
    producer = dumps(tmp_path / "p", PRODUCER, "producer", dtype="bfloat16")
    consumer = dumps(tmp_path / "c", CONSUMER, "consumer")
    result = run("diff", producer, consumer, "--format", "json")
    assert result.exit_code == 1
    data = json.loads(result.output)
    reasons = {
        group["unverified"]
        for request in data["requests"].values()
        for group in request["groups"].values()
    }
    [reason] = reasons
    assert reason.startswith("fingerprints differ (")
    assert reason.endswith("): dtype bfloat16 vs float8_e4m3fn")


def test_scales_of_another_dtype_are_not_compared(tmp_path: Path) -> None:
    """A bf16 producer without scales against an fp8 consumer with k_scale 2.0: other
    bytes for the same values, compared by value through the scale; the scale itself is
    no mismatch (the fingerprints' dtype is what differs)."""
    producer = dumps(tmp_path / "p", PRODUCER, "producer", dtype="bfloat16")
    consumer = dumps(tmp_path / "c", CONSUMER, "consumer", scales={LAYER2: {"k_scale": 2.0}})
    result = run("diff", producer, consumer, "--format", "json")
    assert "scales_differ" not in json.loads(result.output)
