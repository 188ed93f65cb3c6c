"""``kvaudit diff`` of two engines' output folders: differences located to layer, head,
token and byte from the dumps the folders hold (and said why not where a side has no
dump of the request); a folder of per-request dump folders (``OUTPUT/dumps``) read as one
dump set; requests two engines name differently (vLLM's offline P/D) paired by their
prompts. Folders are written by kvaudit's own writers (``helpers.output_folders``), the
planted byte known to the test."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers.output_folders import LAYERS, TOKENS, Flip, token_ids, write_folder

from kvaudit import output_folders as output
from kvaudit.cli import main
from kvaudit.output_folders import read_output

FLIP = Flip("r1", LAYERS[1], head=3, token=21, byte=5)


def diff(*args: str) -> tuple[int, dict, str]:
    """``kvaudit diff ARGS --format json``: the status, the report and stderr."""
    result = CliRunner().invoke(main, ["diff", *args, "--format", "json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout), result.stderr


def assert_located(report: dict, request: str, flip: Flip) -> None:
    """The report locates exactly the flipped byte in the request."""
    group = report["requests"][request]["groups"]["0"]
    assert group["mismatched_positions"] == [flip.position]
    [entry] = group["located"]
    assert (entry["position"], entry["layer"], entry["head"]) == (
        flip.position,
        flip.layer,
        flip.head,
    )
    assert (entry["tokens"], entry["first_byte"]) == ([flip.token], flip.byte)
    assert entry["differing_bytes"] == 1 and entry["differing_bits"] == 1


def finding_texts(report: dict, request: str) -> list[str]:
    return [item["text"] for item in report["diagnosis"] if item["request"] == request]


def test_a_diff_of_output_folders_locates_from_their_dumps(tmp_path: Path) -> None:
    write_folder(tmp_path / "prefill", "producer", tp_size=2, dumped={"r1", "r2"})
    write_folder(tmp_path / "decode", "consumer", tp_size=1, dumped={"r1", "r3"}, flip=FLIP)
    status, report, _ = diff(str(tmp_path / "prefill"), str(tmp_path / "decode"))
    assert status == 1
    assert_located(report, "r1", FLIP)
    # Byte 5 is the high byte of bf16 element 2 of the K row; its bit 0x10 was flipped.
    said = f"single bit: {FLIP.layer} head 3 token 21 (position 1), one bit of byte 5 of its cell"
    [text] = finding_texts(report, "r1")
    before, after = text.removeprefix(f"{said}: K element 2 (bfloat16): ").split(" -> ")
    bits = [
        torch.tensor(float(v)).to(torch.bfloat16).view(torch.int16).item() for v in (before, after)
    ]
    assert bits[0] ^ bits[1] == 0x10 << 8
    assert not report["requests"]["r2"]["groups"]["0"]["mismatched_positions"]
    # Without --locate nothing is read from the dumps; --locate is allowed with them.
    _, quiet, _ = diff(str(tmp_path / "prefill"), str(tmp_path / "decode"), "--no-locate")
    assert quiet["requests"]["r1"]["groups"]["0"]["located"] == []
    _, located, _ = diff(str(tmp_path / "prefill"), str(tmp_path / "decode"), "--locate")
    assert_located(located, "r1", FLIP)


@pytest.mark.parametrize(
    ("producer_dumps", "consumer_dumps", "why"),
    [
        ({"r2"}, {"r1"}, "no dump of this request on the producer"),
        ({"r1"}, {"r2"}, "no dump of this request on the consumer"),
        ({"r2"}, {"r2"}, "no dump of this request on either side"),
        (set(), set(), None),
    ],
)
def test_a_request_without_dumps_says_why_it_was_not_located(
    tmp_path: Path, producer_dumps: set, consumer_dumps: set, why: str | None
) -> None:
    write_folder(tmp_path / "p", "producer", tp_size=2, dumped=producer_dumps)
    write_folder(tmp_path / "d", "consumer", dumped=consumer_dumps, flip=FLIP)
    status, report, _ = diff(str(tmp_path / "p"), str(tmp_path / "d"))
    assert status == 1
    assert report["requests"]["r1"]["groups"]["0"]["located"] == []
    suffix = f" (not located: {why})" if why else " (not located)"
    assert finding_texts(report, "r1") == [f"differs: the block at position 1 differs{suffix}"]


def test_dumps_taken_apart_from_the_checksums_are_said_to_agree(tmp_path: Path) -> None:
    """Dumps of both sides that hold no difference where the checksums differ."""
    write_folder(tmp_path / "p", "producer", dumped={"r1"})
    write_folder(tmp_path / "d", "consumer", dumped={"r1"}, flip=FLIP)
    shutil.rmtree(tmp_path / "d" / "dumps")
    write_folder(tmp_path / "clean", "consumer", dumped={"r1"})
    shutil.copytree(tmp_path / "clean" / "dumps", tmp_path / "d" / "dumps")
    _, report, _ = diff(str(tmp_path / "p"), str(tmp_path / "d"))
    [text] = finding_texts(report, "r1")
    assert text.endswith(
        "(not located: the dumps of this request do not differ at these positions)"
    )


def test_an_unreadable_dump_leaves_the_verdict_and_warns(tmp_path: Path) -> None:
    write_folder(tmp_path / "p", "producer", dumped={"r1", "r2"})
    write_folder(tmp_path / "d", "consumer", dumped={"r1", "r2"}, flip=FLIP)
    broken = tmp_path / "d" / "dumps" / "r2" / "pp0-tp0.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])
    status, report, stderr = diff(str(tmp_path / "p"), str(tmp_path / "d"))
    assert status == 1
    assert_located(report, "r1", FLIP)
    [warning] = [w for w in report["warnings"] if "not read for locating" in w]
    assert str(broken) in warning and warning in stderr.replace("kvaudit: warning: ", "")


def test_a_folder_of_request_dump_folders_is_one_dump_set(tmp_path: Path) -> None:
    write_folder(tmp_path / "p", "producer", tp_size=2, dumped=set(TOKENS))
    write_folder(tmp_path / "d", "consumer", dumped={"r1", "r3"}, flip=FLIP)
    status, report, _ = diff(str(tmp_path / "p" / "dumps"), str(tmp_path / "d" / "dumps"))
    assert status == 1
    assert report["only_in_producer"] == ["r2"]
    assert_located(report, "r1", FLIP)
    assert report["requests"]["r3"]["groups"]["0"]["compared"] == 3
    # Its checksums are the engine's: those its checksum lines hold (TP=2 summed).
    result = CliRunner().invoke(
        main, ["checksum", str(tmp_path / "p" / "dumps"), "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    dumped = json.loads(result.stdout)
    lines = read_output(tmp_path / "p").record
    assert list(dumped["requests"]) == list(TOKENS)
    for rid in TOKENS:
        totals = [int(t, 16) for t in dumped["requests"][rid]["groups"]["0"]["totals"]]
        np.testing.assert_array_equal(totals, lines.requests[rid].groups[0].totals())


def test_a_worker_without_a_dump_of_a_request_makes_it_partial(tmp_path: Path) -> None:
    write_folder(tmp_path / "p", "producer", tp_size=2, dumped={"r1", "r2"})
    (tmp_path / "p" / "dumps" / "r2" / "pp0-tp1.safetensors").unlink()
    result = CliRunner().invoke(
        main, ["checksum", str(tmp_path / "p" / "dumps"), "--format", "json"]
    )
    assert result.exit_code == 1, result.output  # a partial group
    record = json.loads(result.stdout)
    assert record["complete"] is True
    assert "partial" not in record["requests"]["r1"]["groups"]["0"]
    worker = tmp_path / "p" / "dumps" / "*" / "pp0-tp1.safetensors"
    assert record["requests"]["r2"]["groups"]["0"]["partial"] == f"{worker} does not hold it"


def test_dump_folders_mixed_with_dumps_are_refused(tmp_path: Path) -> None:
    write_folder(tmp_path / "p", "producer", dumped={"r1", "r2"})
    single = str(tmp_path / "p" / "dumps" / "r1" / "pp0-tp0.safetensors")
    result = CliRunner().invoke(main, ["checksum", str(tmp_path / "p" / "dumps"), single])
    assert result.exit_code == 2
    assert "holds a folder of dumps per request (an output folder's dumps/)" in result.output


def test_prompt_digest_is_sha256_of_little_endian_int64() -> None:
    ids = token_ids("r2")
    want = hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()[:16]
    assert output.prompt_digest(ids) == want
    assert output.prompt_digest(np.array(ids, dtype=np.int32)) == want
    assert output.prompt_digest([]) == hashlib.sha256(b"").hexdigest()[:16]
    assert output.prompt_digest([-1]) == hashlib.sha256(b"\xff" * 8).hexdigest()[:16]
    for bad in ([1.5], [2**64], [[1, 2]], [True], np.array([2**63], dtype=np.uint64)):
        with pytest.raises(ValueError):
            output.prompt_digest(bad)


def test_lines_carry_their_prompt(tmp_path: Path) -> None:
    write_folder(tmp_path / "p", "producer")
    line = json.loads(
        (tmp_path / "p" / "workers" / "pp0-tp0" / "checksums.jsonl").read_text().splitlines()[1]
    )
    assert line["prompt"] == output.prompt_digest(token_ids("r2"))
    assert read_output(tmp_path / "p").prompts == {
        rid: output.prompt_digest(token_ids(rid)) for rid in TOKENS
    }
    write_folder(tmp_path / "q", "producer", prompts=False)
    text = (tmp_path / "q" / "workers" / "pp0-tp0" / "checksums.jsonl").read_text()
    assert '"prompt"' not in text and read_output(tmp_path / "q").prompts == {}


def test_lines_of_one_request_give_one_prompt(tmp_path: Path) -> None:
    write_folder(tmp_path / "p", "producer", tp_size=2)
    path = tmp_path / "p" / "workers" / "pp0-tp1" / "checksums.jsonl"
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    lines[0]["prompt"] = "0" * 16
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["checksum", str(tmp_path / "p")])
    assert result.exit_code == 2
    assert f'{path}: line 1: request "r1": prompt {"0" * 16}, but ' in result.output


PREFILL = {"r1": "0-8162a3ba", "r2": "1-0c1d2e3f", "r3": "2-77aa1100"}
DECODE = {"r1": "0-a67d174a", "r2": "1-99887766", "r3": "2-5544ee00"}


def test_offline_pd_requests_are_paired_by_prompt(tmp_path: Path) -> None:
    """Two engines that name every request differently: paired by prompt, located from
    the dumps under each engine's own ids, and a consumer id accepted by --request."""
    write_folder(tmp_path / "p", "producer", tp_size=2, names=PREFILL, dumped={"r1"})
    write_folder(tmp_path / "d", "consumer", names=DECODE, dumped={"r1"}, flip=FLIP)
    status, report, stderr = diff(str(tmp_path / "p"), str(tmp_path / "d"))
    assert status == 1
    assert report["only_in_producer"] == [] and report["only_in_consumer"] == []
    assert list(report["requests"]) == [PREFILL[rid] for rid in TOKENS]
    assert report["warnings"] == [
        f"paired by prompt: producer {PREFILL[rid]} = consumer {DECODE[rid]}" for rid in TOKENS
    ]
    assert "kvaudit: warning: paired by prompt: producer 0-8162a3ba = consumer 0-a67d174a" in (
        stderr
    )
    assert_located(report, PREFILL["r1"], FLIP)
    for rid in ("r2", "r3"):
        assert report["requests"][PREFILL[rid]]["groups"]["0"]["mismatched_positions"] == []
    # The consumer's id or the producer's picks the pair.
    for wanted in (DECODE["r1"], PREFILL["r1"]):
        _, one, _ = diff(str(tmp_path / "p"), str(tmp_path / "d"), "--request", wanted)
        assert list(one["requests"]) == [PREFILL["r1"]]
        assert_located(one, PREFILL["r1"], FLIP)


def test_ids_both_sides_hold_pair_by_id_first(tmp_path: Path) -> None:
    """r1 keeps its id on both engines; r2 and r3 are paired by prompt; a request of a
    prompt the other side lacks stays unpaired."""
    write_folder(tmp_path / "p", "producer", names={"r2": "p-2", "r3": "p-3"})
    write_folder(tmp_path / "d", "consumer", names={"r2": "d-2"}, requests=["r1", "r2"], engine="d")
    status, report, _ = diff(str(tmp_path / "p"), str(tmp_path / "d"))
    assert status == 1  # p-3 is missing on the consumer
    assert report["only_in_producer"] == ["p-3"]
    assert report["warnings"] == ["paired by prompt: producer p-2 = consumer d-2"]
    assert set(report["requests"]) == {"r1", "p-2"}


def test_requests_of_one_prompt_pair_in_order_of_appearance(tmp_path: Path) -> None:
    """Two requests of one prompt on each side (the prompt sent twice): paired in the
    order each side lists them, and the report says so."""
    _same_prompt_folder(tmp_path / "p", "producer", ["a-1", "a-2"])
    _same_prompt_folder(tmp_path / "d", "consumer", ["b-1", "b-2"])
    status, report, _ = diff(str(tmp_path / "p"), str(tmp_path / "d"))
    assert status == 0, report
    digest = output.prompt_digest(token_ids("r1"))
    assert report["warnings"] == [
        "paired by prompt: producer a-1 = consumer b-1",
        "paired by prompt: producer a-2 = consumer b-2",
        f"2 producer and 2 consumer requests share prompt {digest}: paired in order of "
        "appearance (a-1 = b-1, a-2 = b-2); each holds the KV of the same tokens",
    ]


def _same_prompt_folder(folder: Path, role: str, names: list[str]) -> None:
    """A folder holding r1's KV under each of ``names``, every line with r1's prompt."""
    write_folder(folder, role, names={"r1": names[0]}, requests=["r1"])
    path = folder / "workers" / "pp0-tp0" / "checksums.jsonl"
    [line] = path.read_text().splitlines()
    copies = [{**json.loads(line), "request": name} for name in names[1:]]
    path.write_text(line + "\n" + "".join(json.dumps(copy) + "\n" for copy in copies))


def test_more_requests_of_one_prompt_on_one_side_leave_the_rest_unpaired(tmp_path: Path) -> None:
    _same_prompt_folder(tmp_path / "p", "producer", ["a-1", "a-2", "a-3"])
    _same_prompt_folder(tmp_path / "d", "consumer", ["b-1"])
    status, report, _ = diff(str(tmp_path / "p"), str(tmp_path / "d"))
    assert status == 1
    assert report["only_in_producer"] == ["a-2", "a-3"]
    digest = output.prompt_digest(token_ids("r1"))
    assert report["warnings"][1] == (
        f"3 producer and 1 consumer requests share prompt {digest}: paired in order of "
        "appearance (a-1 = b-1); each holds the KV of the same tokens"
    )


def test_sides_without_prompts_are_not_paired(tmp_path: Path) -> None:
    write_folder(tmp_path / "p", "producer", names=PREFILL)
    write_folder(tmp_path / "d", "consumer", names=DECODE, prompts=False)
    status, report, _ = diff(str(tmp_path / "p"), str(tmp_path / "d"))
    assert status == 1
    assert report["only_in_producer"] == list(PREFILL.values())
    assert report["warnings"] == []
