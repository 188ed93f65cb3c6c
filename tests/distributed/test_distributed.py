"""kvaudit under torchrun: 2 processes on gloo (CPU), each holding part of the workers.

The producer (TP=2 x PP=2) and consumer (TP=4) dump sets of ``dumped_sets`` are split
between the folders ``n0`` and ``n1`` (``{rank}`` in the SOURCE path): the record must
equal the single-process record of all the files, and a diff of a faulty pair must
locate the planted faults as the decoded cells say (``dumped_sets.expected_located``),
as one process does; ``verify --received`` of consumer dumps that carry the producer's
wire bytes (intact, and one total wrong) reports what one process reports. A process that
cannot read its files, one that never comes and one that is killed make every process exit
within the timeout; processes given different commands, or one failing where the others do
not, all end with the same status, and a lost process's line carries gloo's own text only
with ``--debug``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.dumped_sets import (
    COMPARED,
    MODEL,
    TOKENS,
    Sets,
    all_positions,
    build_sets,
    decode_set,
    expected_located,
)
from safetensors import safe_open
from safetensors.torch import save_file

from kvaudit.compare import CompareOptions, diff_sources
from kvaudit.corrupt import corrupt_dump
from kvaudit.description import description_to_dict
from kvaudit.distributed.comm import Comm, Place
from kvaudit.distributed.placement import Unit, assign, fill
from kvaudit.dumps import open_dump
from kvaudit.formats import diff_to_json, inventory_to_json, record_to_json
from kvaudit.formats.json import located_to_json
from kvaudit.records.wire import encode_wire
from kvaudit.sources import RecordQuery, Runtime, open_source

ROOT = Path(__file__).resolve().parents[2]
CPU = Runtime("torch", "cpu")
TIMEOUT = 20
"""The collectives' timeout the tests give (KVAUDIT_DIST_TIMEOUT), in seconds."""
SPLIT = {  # worker file -> the rank whose folder holds it
    "producer": {"pp0-tp0": 0, "pp1-tp1": 0, "pp0-tp1": 1, "pp1-tp0": 1},
    "consumer": {"pp0-tp0": 0, "pp0-tp2": 0, "pp0-tp1": 1, "pp0-tp3": 1},
}
FAULTS = [  # (consumer worker, request, group, position, mode): on both ranks' files
    ("pp0-tp3", "req-a", 0, 1, "flip"),
    ("pp0-tp1", "req-b", 2, 1, "zero"),
    ("pp0-tp0", "req-a", 1, 2, "flip"),
    ("pp0-tp2", "req-b", 0, 3, "stale"),  # tokens 12..15: part of compared position 0
]


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> tuple[Sets, Path, list[str]]:
    """The sets, a folder ``n{rank}/{producer,consumer}`` per rank with its share of the
    files (the consumer's with the planted faults), and the faulty consumer's paths."""
    root = tmp_path_factory.mktemp("dist")
    sets = build_sets(root / "sets")
    faulty = list(sets.consumer.paths)
    for worker, request_id, group_id, position, mode in FAULTS:
        index = next(i for i, path in enumerate(faulty) if Path(path).stem == worker)
        target = root / "faulty" / f"{worker}.safetensors"
        target.parent.mkdir(exist_ok=True)
        corrupt_dump(
            faulty[index], target, request_id=request_id, group_id=group_id,
            position=position, mode=mode, seed=3,
        )  # fmt: skip
        faulty[index] = str(target)
    for side, paths in (("producer", sets.producer.paths), ("consumer", faulty)):
        for path in paths:
            folder = root / f"n{SPLIT[side][Path(path).stem]}" / side
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, folder / Path(path).name)
    return sets, root, faulty


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["KVAUDIT_DIST_TIMEOUT"] = str(TIMEOUT)
    env.update(extra)
    return env


def torchrun(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m kvaudit ARGS``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "kvaudit", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=timeout)


def launch(
    args: list[str] | dict[int, list[str]],
    ranks: list[int],
    cwd: dict[int, Path] | None = None,
    **extra: str,
) -> list[subprocess.Popen]:
    """Processes of a world of 2 started as torchrun starts them (its variables), without
    its agent: only ``ranks`` are started, each with ``args`` (or its own, by rank) and in
    its folder of ``cwd`` (else this one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = []
    for rank in ranks:
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GROUP_RANK="0", **extra)
        own = args[rank] if isinstance(args, dict) else args
        command = [sys.executable, "-m", "kvaudit", *own]
        processes.append(
            subprocess.Popen(
                command,
                env=env,
                cwd=None if cwd is None else cwd[rank],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return processes


def ended(processes: list[subprocess.Popen]) -> tuple[list[int], list[tuple[str, str]]]:
    """The processes' exit statuses and their (stdout, stderr), once all ended."""
    outputs = [process.communicate(timeout=120) for process in processes]
    return [process.returncode for process in processes], outputs


def _sources_by_name(data: dict) -> dict:
    """A record's JSON with each worker's source reduced to its file name."""
    for worker in data["workers"]:
        worker["source"] = Path(worker["source"]).name
    return data


def _groups(*reports: dict):
    """Each ``(request, group id, group)`` of the reports' JSON."""
    for report in reports:
        for request_id, request in report["requests"].items():
            for gid, group in request["groups"].items():
                yield request_id, gid, group


def _cells(entry: dict) -> dict:
    """A located entry without its file (the holder's path differs from the reference's)."""
    return {key: value for key, value in entry.items() if key != "file"}


def expected_stale(
    produced: dict, consumed: dict, request_id: str, group_id: int, index: int, size: int
) -> list[dict]:
    """The producer blocks of ``size`` tokens (any request) whose cells equal, in every
    (layer, head) where the consumer's block ``index`` (at ``size``) of the request
    differs from the producer's, the consumer's cells there: its stale sources."""
    tokens = range(index * size, (index + 1) * size)
    layers = {layer.name for layer in MODEL.group(group_id).layers}
    slices = {
        (name, head)
        for (rid, name, head, token, replica), cell in consumed.items()
        if (rid, replica) == (request_id, 0) and name in layers and token in tokens
        and not np.array_equal(cell.data, produced[rid, name, head, token, 0].data)
    }  # fmt: skip
    found = []
    for rid, count in TOKENS.items():
        for q in range(count // size):
            if all(
                np.array_equal(
                    consumed[request_id, name, head, token, 0].data,
                    produced[rid, name, head, q * size + token - tokens.start, 0].data,
                )
                for name, head in slices
                for token in tokens
            ):
                found.append({"request": rid, "group": group_id, "position": q,
                              "block_size": size, "consumer_position": index})  # fmt: skip
    return found if slices else []


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kvaudit: error:")]


# Placement.


def test_rank_fields_and_assignment() -> None:
    place = Place(rank=5, world=16, local_rank=5, node_rank=0)
    assert fill("/d/n{node_rank}/r{rank}/l{local_rank}/{other}", place) == "/d/n0/r5/l5/{other}"
    shared = [Unit("shared:/a", ("/a",), 100), Unit("shared:/b", ("/b",), 60)]
    shared.append(Unit("shared:/c", ("/c",), 50))
    # Every process sees every file: the largest first, each to the least loaded.
    assert [[u.key for u in own] for own in assign([shared, shared])] == [
        ["shared:/a"],
        ["shared:/b", "shared:/c"],
    ]
    # A file only one process sees goes to it, however loaded.
    own = [Unit("node 0:/x", ("/x",), 10)]
    assert [[u.key for u in mine] for mine in assign([shared, own])] == [
        ["shared:/a", "shared:/b", "shared:/c"],
        ["node 0:/x"],
    ]


def test_how_the_processes_settle() -> None:
    """The status of an exchange where processes ended: the lowest ending rank's, its line
    relayed naming it; 2 when one ended with 0 or 1 while others still ran."""
    rank1 = Comm(Place(rank=1, world=3, local_rank=1, node_rank=0), TIMEOUT)
    rank0 = Comm(Place(rank=0, world=3, local_rank=0, node_rank=0), TIMEOUT)
    going = {"ok": None}
    failed = {"end": 3, "line": "kvaudit: internal error (a bug in kvaudit) at x:1: E"}
    assert rank0._verdict([going, failed, {"end": 2, "line": "kvaudit: error: b"}]) == (
        3,
        "kvaudit: rank 1: internal error (a bug in kvaudit) at x:1: E",
    )
    assert rank1._verdict([going, failed, going]) == (3, None)  # its own line: printed
    together = [{"end": 1, "line": None}, {"end": 2, "line": "kvaudit: error: a"}, failed]
    assert rank0._verdict(together) == (1, None)
    early = [going, {"end": 2, "line": "kvaudit: error: /x: gone"}, going]
    assert rank0._verdict(early) == (2, "kvaudit: error: rank 1: /x: gone")
    for status in (0, 1):
        verdict = rank0._verdict([going, {"end": status, "line": None}, going])
        assert verdict[0] == 2 and verdict[1].startswith("kvaudit: error: rank 1 ended its")


# Split between two processes.


@pytest.mark.slow
def test_checksum_split_equals_one_process(split: tuple[Sets, Path, list[str]]) -> None:
    sets, root, _ = split
    folders = root / "n{rank}" / "producer"
    done = torchrun("checksum", folders, "--format", "json", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data.pop("processes") == 2
    whole = open_source(sets.producer.paths).checksum(RecordQuery(CPU))
    assert _sources_by_name(data) == _sources_by_name(record_to_json(whole))


def with_received(path: Path, target: Path, wires: dict[str, bytes]) -> None:
    """A copy of a dump whose requests carry the producer's wire bytes ``wires``."""
    with safe_open(str(path), framework="pt") as file:
        metadata = dict(file.metadata())
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
    requests = json.loads(metadata["kvaudit.requests"])
    for request_id, request in requests.items():
        request["received"] = base64.b64encode(wires[request_id]).decode("ascii")
    metadata["kvaudit.requests"] = json.dumps(requests)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target), metadata)


def test_verify_received_split_equals_one_process(
    split: tuple[Sets, Path, list[str]], tmp_path: Path
) -> None:
    sets, _, _ = split
    sent = open_source(sets.producer.paths).checksum(RecordQuery(CPU, positions="request"))
    wires = {rid: encode_wire(request.to_wire("request")) for rid, request in sent.requests.items()}
    wrong = dict(wires)
    totals = sent.requests["req-a"].to_wire("request")
    totals.groups[0].totals[1] ^= 1
    wrong["req-a"] = encode_wire(totals)
    for name, carried in (("good", wires), ("wrong", wrong)):
        for path in map(Path, sets.consumer.paths):
            rank = SPLIT["consumer"][path.stem]
            with_received(path, tmp_path / f"n{rank}" / name / path.name, carried)
            with_received(path, tmp_path / "whole" / name / path.name, carried)
    for name, status in (("good", 0), ("wrong", 1)):
        args = ("verify", "--received", "--format", "json", "--device", "cpu")
        done = torchrun(*args, tmp_path / "n{rank}" / name)
        assert done.returncode == status, done.stderr
        data = json.loads(done.stdout)
        assert data.pop("processes") == 2
        one = subprocess.run(
            [sys.executable, "-m", "kvaudit", *args, tmp_path / "whole" / name],
            capture_output=True, text=True, env=_env(), check=False,
        )  # fmt: skip
        assert one.returncode == status, one.stderr
        assert data["requests"] == json.loads(one.stdout)["requests"]
        assert data["ok"] is (status == 0)
    group = data["requests"]["req-a"]["groups"]["0"]
    assert group["mismatched_positions"] == [1]


@pytest.mark.slow
def test_diff_locates_the_faults_as_one_process(split: tuple[Sets, Path, list[str]]) -> None:
    sets, root, faulty = split
    producer, consumer = root / "n{rank}" / "producer", root / "n{rank}" / "consumer"
    done = torchrun("diff", producer, consumer, "--format", "json", "--device", "cpu")
    assert done.returncode == 1, done.stderr  # torchrun's status when a process returns 1
    data = json.loads(done.stdout)
    assert data.pop("processes") == 2
    one = diff_to_json(
        diff_sources(
            open_source(sets.producer.paths), open_source(faulty), CompareOptions(runtime=CPU)
        )
    )
    for _, _, group in _groups(data, one):
        for entry in group["located"]:
            entry["file"] = Path(entry["file"]).name
    assert data["untraced"] is None
    assert data == one
    # The stale 4-token block is traced to the producer blocks holding its cells.
    produced, consumed = sets.producer_cells, decode_set(sets.consumer, faulty)
    stale = data["requests"]["req-b"]["groups"]["0"]["stale_sources"]
    expected = expected_stale(produced, consumed, "req-b", 0, 3, 4)
    assert expected and stale == {"0": expected}
    # Every planted fault is located, as the decoded cells say.
    for _, request_id, group_id, _, _ in FAULTS:
        group = data["requests"][request_id]["groups"][str(group_id)]
        assert group["mismatched_positions"] or group["replicas_differing"]
        positions = all_positions(group_id, TOKENS[request_id])
        expected = expected_located(
            produced, consumed, request_id, group_id, positions, COMPARED[group_id],
            TOKENS[request_id],
        )  # fmt: skip
        assert expected and [_cells(e) for e in group["located"]] == [
            _cells(located_to_json(e)) for e in expected
        ]


@pytest.mark.slow
def test_diff_against_a_record_is_traced_by_checksums_only(
    split: tuple[Sets, Path, list[str]], tmp_path: Path
) -> None:
    sets, root, _ = split
    record = tmp_path / "producer.json"
    record.write_text(
        json.dumps(record_to_json(open_source(sets.producer.paths).checksum(RecordQuery(CPU))))
    )
    done = torchrun(
        "diff", record, root / "n{rank}" / "consumer", "--format", "json", "--device", "cpu"
    )
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    # Traced by checksums only, as in one process: the stale slices of one rank leave no
    # producer block holding the whole block.
    assert data["untraced"].startswith(
        f"traced by checksums only ({record} is a record that holds only checksums, not the KV)"
    )
    differing = [group for _, _, group in _groups(data) if group["mismatched_positions"]]
    assert differing
    for group in differing:
        assert group["stale_sources"] == {str(q): [] for q in group["mismatched_positions"]}


@pytest.mark.slow
def test_shared_paths_inspect(split: tuple[Sets, Path, list[str]]) -> None:
    """Without rank fields both processes see every file and share them; ``inspect``
    says what one process says, and only rank 0 writes."""
    sets, _, _ = split
    folder = str(Path(sets.producer.paths[0]).parent)
    processes = launch(["inspect", folder, "--format", "json", "--device", "cpu"], [0, 1])
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs[0][1]
    assert outputs[1] == ("", "")  # only rank 0 writes
    data = json.loads(outputs[0][0])
    assert data.pop("processes") == 2
    assert data == json.loads(json.dumps(inventory_to_json(open_source([folder]).inventory())))


# Failures.


@pytest.mark.slow
def test_unreadable_file_on_one_rank(split: tuple[Sets, Path, list[str]], tmp_path: Path) -> None:
    _, root, _ = split
    for rank in (0, 1):
        shutil.copytree(root / f"n{rank}" / "producer", tmp_path / f"n{rank}")
    broken = tmp_path / "n1" / "pp0-tp1.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])
    start = time.monotonic()
    done = torchrun("checksum", tmp_path / "n{rank}", "--format", "json", "--device", "cpu")
    assert time.monotonic() - start < 120
    assert done.returncode == 1  # torchrun's status when a process fails; rank 0's was 2
    assert done.stdout == ""
    errors = _errors(done.stderr)
    assert len(errors) == 1 and errors[0].startswith(f"kvaudit: error: rank 1: {broken}"), errors
    assert "exitcode  : 2" in done.stderr


@pytest.mark.slow
def test_a_process_that_never_comes(split: tuple[Sets, Path, list[str]]) -> None:
    _, root, _ = split
    args = ["checksum", str(root / "n{rank}" / "producer"), "--device", "cpu"]
    (process,) = launch(args, [0], KVAUDIT_DIST_TIMEOUT="3")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2 and out == ""
    (error,) = _errors(err)
    assert error.startswith("kvaudit: error: rank 0: joining the process group failed")
    assert "within 3 s" in error


def kill_rank_1_while_it_reads(
    split: tuple[Sets, Path, list[str]], tmp_path: Path, *options: str
) -> tuple[int, str, str, float]:
    """Run ``kvaudit OPTIONS checksum`` on 2 processes and kill rank 1 while it reads its
    dumps (they are mapped): rank 0's exit status, stdout and stderr, and the seconds it
    took to end after the kill."""
    _, root, _ = split
    # Rank 1 checksums its small dumps in a few milliseconds: it is stopped the moment
    # its mapping shows, and the run is tried again in the rare case that its results had
    # already reached rank 0 (which then rightly ends with status 0).
    for attempt in range(5):
        folder = tmp_path / f"attempt{attempt}"
        for rank in (0, 1):
            shutil.copytree(root / f"n{rank}" / "producer", folder / f"n{rank}")
        args = [*options, "checksum", str(folder / "n{rank}"), "--device", "cpu"]
        rank0, rank1 = launch(args, [0, 1])
        maps = Path(f"/proc/{rank1.pid}/maps")
        deadline = time.monotonic() + 60
        while str(folder / "n1") not in maps.read_text():  # until rank 1 mapped a dump
            assert time.monotonic() < deadline and rank1.poll() is None
            time.sleep(0.002)
        rank1.send_signal(signal.SIGSTOP)
        killed = time.monotonic()
        rank1.send_signal(signal.SIGKILL)
        rank1.wait()
        out, err = rank0.communicate(timeout=TIMEOUT + 30)
        if rank0.returncode != 0:
            break
    return rank0.returncode, out, err, time.monotonic() - killed


@pytest.mark.slow
def test_a_killed_process(split: tuple[Sets, Path, list[str]], tmp_path: Path) -> None:
    """Rank 1 is killed while it reads its dumps: rank 0, which waits for its results,
    exits with status 2 within the timeout."""
    status, out, err, took = kill_rank_1_while_it_reads(split, tmp_path)
    assert took < TIMEOUT + 10
    assert status == 2 and out == ""
    (error,) = _errors(err)
    assert error.startswith("kvaudit: error: rank 0: exchanging results failed"), error


@pytest.mark.slow
def test_a_lost_process_without_gloo_text(
    split: tuple[Sets, Path, list[str]], tmp_path: Path
) -> None:
    """The line names the cause, not gloo's report of it ("[.../third_party/gloo/...]
    Connection closed by peer ..."), which only ``--debug`` adds."""
    status, _, err, _ = kill_rank_1_while_it_reads(split, tmp_path / "plain")
    assert status == 2
    assert _errors(err) == [
        "kvaudit: error: rank 0: exchanging results failed: another process was lost or did "
        f"not answer within {TIMEOUT} s"
    ]
    assert "gloo" not in err and "Connection" not in err and "[" not in err
    status, _, err, _ = kill_rank_1_while_it_reads(split, tmp_path / "debug", "--debug")
    assert status == 2
    (error,) = _errors(err)
    assert error.startswith(
        "kvaudit: error: rank 0: exchanging results failed: another process was lost or did "
        f"not answer within {TIMEOUT} s (RuntimeError: ["
    )
    assert "gloo" in error, error


# Every process ends with the same status.


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "second"),
    [
        (["checksum", "{source}", "--device", "cpu"], ["inspect", "{source}", "--device", "cpu"]),
        (["--version"], ["checksum", "{source}", "--device", "cpu"]),
        (["checksum", "{source}", "--device", "cpu"], ["--debug", "checksum", "{source}"]),
    ],
    ids=["checksum-inspect", "version-checksum", "debug-options"],
)
def test_ranks_given_different_commands(
    split: tuple[Sets, Path, list[str]], first: list[str], second: list[str]
) -> None:
    """Whichever process would end first (``inspect`` needs fewer exchanges than
    ``checksum``, ``--version`` none), every process refuses the mismatch with status 2,
    and rank 0 says so in one line."""
    _, root, _ = split
    source = str(root / "n{rank}" / "producer")
    args = {0: first, 1: second}
    filled = {rank: [arg.replace("{source}", source) for arg in own] for rank, own in args.items()}
    start = time.monotonic()
    statuses, outputs = ended(launch(filled, [0, 1]))
    assert statuses == [2, 2], outputs
    assert time.monotonic() - start < TIMEOUT  # no process waited for the other to time out
    assert _errors(outputs[0][1]) == [
        "kvaudit: error: rank 1 was given another command than rank 0: every process must "
        "run the same kvaudit command"
    ], outputs[0][1]
    assert outputs[1] == ("", "")


@pytest.mark.slow
def test_an_error_only_rank_0_sees(split: tuple[Sets, Path, list[str]]) -> None:
    """Rank 0 alone writes the output: when writing it fails, after the last exchange,
    rank 1 (which did all its work) ends with rank 0's status 2, not 0."""
    _, root, _ = split
    args = ["checksum", str(root / "n{rank}" / "producer"), "--device", "cpu", "-o", "/dev/full"]
    statuses, outputs = ended(launch(args, [0, 1]))
    assert statuses == [2, 2], outputs
    assert _errors(outputs[0][1]) == [
        "kvaudit: error: /dev/full: cannot write: No space left on device"
    ]


@pytest.mark.slow
def test_an_error_only_rank_1_sees(split: tuple[Sets, Path, list[str]], tmp_path: Path) -> None:
    """Rank 1 fails before its first exchange (a description its working folder lacks):
    rank 0 ends with rank 1's status at once, printing rank 1's error."""
    sets, root, _ = split
    folders = {rank: tmp_path / f"cwd{rank}" for rank in (0, 1)}
    for folder in folders.values():
        folder.mkdir()
    description = description_to_dict(open_dump(sets.producer.paths[0]).description)
    (folders[0] / "desc.yaml").write_text(json.dumps(description))  # JSON is YAML
    args = ["checksum", str(root / "n{rank}" / "producer"), "--device", "cpu", "-c", "desc.yaml"]
    start = time.monotonic()
    statuses, outputs = ended(launch(args, [0, 1], cwd=folders))
    assert time.monotonic() - start < TIMEOUT
    assert statuses == [2, 2], outputs
    assert _errors(outputs[0][1]) == ["kvaudit: error: rank 1: desc.yaml: no such file"]
