"""Hints for common mistakes: a cache description given where a dump or a record was
expected, the other engine's description applied to a dump, a ``model_kv_heads`` that
contradicts the heads per rank times TP, and ``write_dump`` given a layer the description
does not have. Each is bad input: one line naming the file, exit status 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from helpers.example_module import example
from safetensors import safe_open
from safetensors.torch import save_file

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.dumps import open_dump, write_dump
from kvaudit.records import WorkerInfo

HINT = "looks like a cache description: pass it with -c"


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("example")
    example.make_example(root, seed=1)
    return root


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def embedded(path: Path) -> dict:
    """A dump's metadata, read with safetensors."""
    with safe_open(str(path), framework="pt") as file:
        return file.metadata()


def bad_input(result: Result, source: Path) -> str:
    """The one-line message of exit status 2, which names ``source``."""
    assert result.exit_code == 2, result.output
    message = result.output.strip()
    assert "\n" not in message and "Traceback" not in message
    assert str(source) in message
    return message


# A description given where a dump or record was expected.


@pytest.mark.parametrize("form", ["yaml", "json", "yaml-flow"])
def test_a_description_given_as_a_source_is_named_as_one(
    tmp_path: Path, sets: Path, form: str
) -> None:
    data = example.description(example.PRODUCER)
    if form == "yaml":
        path, text = tmp_path / "cache.yaml", yaml.safe_dump(data)
    elif form == "json":
        path, text = tmp_path / "cache.json", json.dumps(data, indent=2)
    else:  # flow-style YAML starts with "{", which a record sniffer claims
        path, text = tmp_path / "cache.yml", yaml.safe_dump(data, default_flow_style=True)
    path.write_text(text)
    assert bad_input(run("checksum", str(path)), path).endswith(
        f"{HINT} (--config), not as a dump or record"
    )
    assert HINT in bad_input(run("diff", str(path), str(sets / "consumer")), path)
    assert HINT in bad_input(run("diff", str(sets / "producer"), str(path)), path)
    assert HINT in bad_input(run("verify", str(sets / "consumer"), "--against", str(path)), path)
    # Given with -c, the same file is read as the description it is.
    assert run("checksum", "-q", "-c", str(path), str(sets / "producer")).exit_code == 0


@pytest.mark.parametrize(
    ("name", "content"),
    [("notes.txt", b"kvaudit: 1\nnot a description\n"), ("blob.bin", b"\x01" * 64)],
)
def test_other_files_keep_their_own_message(tmp_path: Path, name: str, content: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    message = bad_input(run("checksum", str(path)), path)
    assert HINT not in message
    assert "not a safetensors file" in message


def test_a_record_is_not_taken_for_a_description(tmp_path: Path, sets: Path) -> None:
    record = tmp_path / "record.json"
    assert run("checksum", "-q", str(sets / "producer"), "--format", "json", "-o", str(record))
    assert run("diff", "-q", str(record), str(sets / "consumer")).exit_code == 0


# The other engine's description.


def test_the_producers_description_applied_to_the_consumer(tmp_path: Path, sets: Path) -> None:
    producer_yaml = tmp_path / "producer.yaml"
    consumer_yaml = tmp_path / "consumer.yaml"
    producer_yaml.write_text(yaml.safe_dump(example.description(example.PRODUCER)))
    consumer_yaml.write_text(yaml.safe_dump(example.description(example.CONSUMER)))
    # Independently: some consumer dump holds a block past the producer's last block.
    num_blocks = example.PRODUCER.num_blocks
    consumer_files = sorted((sets / "consumer").glob("*.safetensors"))
    past = [
        path
        for path in consumer_files
        if max(json.loads(embedded(path)["kvaudit.blocks"])) >= num_blocks
    ]
    assert past
    result = run(
        "diff", "-q", "-c", str(producer_yaml), str(sets / "producer"), str(sets / "consumer")
    )
    message = bad_input(result, past[0])
    assert "does not fit this consumer's dump" in message
    assert "--consumer-config" in message
    assert "expected a block id" not in message
    result = run(
        "diff",
        "-q",
        "-c",
        str(producer_yaml),
        "--consumer-config",
        str(consumer_yaml),
        str(sets / "producer"),
        str(sets / "consumer"),
    )
    assert result.exit_code == 0, result.output


def test_a_description_of_the_wrong_shape_given_for_both_sides_names_the_option(
    tmp_path: Path, sets: Path
) -> None:
    # The producer's description with room for every block: the consumer's tensors then
    # differ in shape (another layout, other heads), and the line says how to give its own.
    description = example.description(example.PRODUCER)
    description["num_blocks"] = 4096
    producer_yaml = tmp_path / "producer.yaml"
    producer_yaml.write_text(yaml.safe_dump(description))
    consumer = sorted((sets / "consumer").glob("*.safetensors"))[0]
    result = run(
        "diff", "-q", "-c", str(producer_yaml), str(sets / "producer"), str(sets / "consumer")
    )
    message = bad_input(result, consumer)
    assert "expected shape" in message
    assert "give the consumer's description (--consumer-config with diff" in message


def _whole_cache_dump(path: Path, num_blocks: int, role: str) -> dict:
    data = {
        "kvaudit": 1,
        "num_blocks": num_blocks,
        "groups": [
            {
                "spec": {
                    "type": "full_attention",
                    "block_size": 4,
                    "num_kv_heads": 2,
                    "head_size": 4,
                    "dtype": "float16",
                    "layout": "NTHC",
                },
                "layers": ["model.layers.0.attn"],
            }
        ],
    }
    tensors = {"model.layers.0.attn": torch.zeros(num_blocks, 4, 2, 8, dtype=torch.float16)}
    write_dump(
        path,
        parse_description(data, "test"),
        tensors,
        {"r": RequestBlocks(4, {0: (0, [1])})},
        worker=WorkerInfo(role=role),
        whole_cache=True,
    )
    return data


@pytest.mark.parametrize("role", ["producer", "consumer", "offload"])
def test_a_whole_cache_dump_under_the_other_engines_num_blocks(tmp_path: Path, role: str) -> None:
    path = tmp_path / "rank0.safetensors"
    data = _whole_cache_dump(path, 6, role)
    other = parse_description({**data, "num_blocks": 9}, "other.yaml")
    with pytest.raises(KvauditError) as error:
        open_dump(path, other)
    message = str(error.value)
    assert message.startswith(f"{path}: layer model.layers.0.attn holds 6 blocks")
    assert f"does not fit this {role}'s dump" in message
    option = f"--{role}-config" if role != "offload" else "(-c)"
    assert option in message
    # Its own description, embedded or given, reads.
    assert open_dump(path).num_rows == 6
    assert open_dump(path, parse_description(data, "own.yaml")).num_rows == 6


def test_a_dump_that_embeds_a_bad_block_id_keeps_its_message(tmp_path: Path) -> None:
    """Without a description given, a block id past num_blocks is a bad dump, not a hint."""
    path = tmp_path / "rank0.safetensors"
    _whole_cache_dump(path, 6, "consumer")
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
    tensors["model.layers.0.attn"] = tensors["model.layers.0.attn"][:2].clone()
    metadata["kvaudit.blocks"] = "[0,7]"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(KvauditError, match=r"expected a block id from 0 to 5, got 7"):
        open_dump(path)


# model_kv_heads against heads x TP.


def _attention(heads: int, model_kv_heads: int | None, max_tp_shards: int | None = None):
    spec = {
        "type": "full_attention",
        "block_size": 4,
        "num_kv_heads": heads,
        "head_size": 4,
        "dtype": "float16",
        "layout": "NTHC",
    }
    if max_tp_shards is not None:
        spec["max_tp_shards"] = max_tp_shards
    data = {
        "kvaudit": 1,
        "num_blocks": 4,
        "groups": [{"spec": spec, "layers": ["model.layers.0.attn"]}],
    }
    if model_kv_heads is not None:
        data["model_kv_heads"] = model_kv_heads
    description = parse_description(data, "cache.yaml")
    tensors = {"model.layers.0.attn": torch.zeros(4, 4, heads, 8, dtype=torch.float16)}
    return description, tensors


@pytest.mark.parametrize(
    ("heads", "tp_size", "max_tp_shards", "model_kv_heads"),
    [
        (4, 2, None, 8),
        (4, 2, None, 4),
        (4, 2, None, 16),
        (8, 1, None, 8),
        (8, 1, None, 4),
        (1, 4, None, 2),
        (1, 4, None, 4),
        (1, 4, None, 1),
        (1, 4, None, 8),
        (1, 4, None, 3),
        (2, 4, 2, 4),
        (2, 4, 2, 8),
        (2, 2, 4, 4),
    ],
)
def test_model_kv_heads_must_agree_with_heads_times_tp(
    heads: int, tp_size: int, max_tp_shards: int | None, model_kv_heads: int
) -> None:
    # Independently: the ranks hold heads x shards distinct heads (shards: the TP size,
    # capped by max_tp_shards), or, one head per rank, any count that divides the TP size.
    shards = tp_size if max_tp_shards is None else min(tp_size, max_tp_shards)
    if heads == 1 and max_tp_shards is None and tp_size > 1:
        agrees = tp_size % model_kv_heads == 0
    else:
        agrees = heads * shards == model_kv_heads
    description, tensors = _attention(heads, model_kv_heads, max_tp_shards)
    if agrees:
        checksummer = Checksummer(description, tensors, tp_size=tp_size, backend="torch")
        assert checksummer.not_covered == {}
        return
    with pytest.raises(KvauditError) as error:
        Checksummer(description, tensors, tp_size=tp_size, backend="torch")
    message = str(error.value)
    assert message.startswith(f"cache.yaml: model_kv_heads {model_kv_heads} contradicts layer ")
    assert "model.layers.0.attn" in message


def test_without_model_kv_heads_nothing_is_checked() -> None:
    description, tensors = _attention(4, None)
    assert Checksummer(description, tensors, tp_size=2, backend="torch").not_covered == {}


def test_a_contradicting_model_kv_heads_on_the_command_line(tmp_path: Path, sets: Path) -> None:
    data = example.description(example.PRODUCER)
    for wrong in (4, 16):
        path = tmp_path / f"cache-{wrong}.yaml"
        path.write_text(yaml.safe_dump({**data, "model_kv_heads": wrong}))
        result = run(
            "diff",
            "-q",
            "--producer-config",
            str(path),
            str(sets / "producer"),
            str(sets / "consumer"),
        )
        message = bad_input(result, path)
        assert f"model_kv_heads {wrong} contradicts" in message
        assert "4 KV heads per rank x 2 TP shards = 8" in message


# write_dump and layers the description does not have.


@pytest.mark.parametrize("extra", ["model.layers.9.attn", "lm_head"])
def test_write_dump_refuses_a_layer_not_in_the_description(tmp_path: Path, extra: str) -> None:
    description, tensors = _attention(2, None)
    tensors[extra] = tensors["model.layers.0.attn"].clone()
    path = tmp_path / "rank0.safetensors"
    with pytest.raises(KvauditError) as error:
        write_dump(path, description, tensors, {}, worker=WorkerInfo())
    assert str(error.value) == (
        f"{path}: tensor given for layer {extra}, which is not in the cache description"
    )
    assert os.listdir(tmp_path) == []
