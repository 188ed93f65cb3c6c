"""Fuzzing kvaudit's readers: every input ends in a result or a one-line ``KvauditError``.

Five targets, each fed by a ``hypothesis`` strategy that mutates a valid seed (and draws
hostile values: huge or negative integers, deep nesting, lone surrogates, YAML tags and
aliases): a dump's safetensors header, a dump's metadata, a description's YAML, a
record's JSON and a received wire. Each input is read the way the command line reads it,
then checksummed or compared. Run as a script (``tests/project/test_fuzz.py`` and
``bench/fuzz.py`` do), the process caps its own memory (``RLIMIT_AS``) after its imports
and each example's time (``setitimer``); a ``MemoryError``, a timeout or any other
exception is a failure that ``hypothesis`` shrinks and prints.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import resource
import signal
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from kvaudit.checksum import checksum_dump_set
from kvaudit.compare import compare_records, verify_received
from kvaudit.core.errors import KvauditError
from kvaudit.description import load_description, parse_description
from kvaudit.dumps import open_dump_set, write_dump
from kvaudit.dumps.safetensors_io import read_header
from kvaudit.formats import record_to_json
from kvaudit.records import WorkerInfo
from kvaudit.records.wire import encode_wire
from kvaudit.sources import load_record
from kvaudit.views.inputs import RequestBlocks

DESCRIPTION: dict[str, Any] = {
    "kvaudit": 1,
    "num_blocks": 4,
    "groups": [
        {
            "spec": {
                "type": "full_attention",
                "block_size": 4,
                "num_kv_heads": 1,
                "head_size": 2,
                "dtype": "float32",
                "layout": "NTHC",
            },
            "layers": ["model.layers.0.attn"],
        },
        {
            "id": 1,
            "spec": {
                "type": "sliding_window",
                "block_size": 2,
                "num_kv_heads": 1,
                "head_size": 2,
                "dtype": "float16",
                "layout": "NTHC",
                "sliding_window": 4,
            },
            "layers": ["model.layers.1.attn"],
        },
    ],
}
YAML_TEXT = yaml.safe_dump(DESCRIPTION, sort_keys=False)
REQUESTS = {
    "r": RequestBlocks(10, {0: (0, [1, 2, 3]), 1: (2, [0, 3, 1])}),
    "s": RequestBlocks(3, {0: (0, [2])}),
}
EDGE_INTS = [-1, 0, 1, 2, 3, 4, 10, 2**31, 2**32, 2**40 + 1, 2**62, 2**63, 2**64, 10**12, 10**30]
TEXTS = ["", "r", "0", "\ud800", "producer", "consumer", "offload", "\x1b]0;t\x07", "é" * 3]
MEMORY_CAP = 1 << 30  # bytes the fuzzing process may add to what its imports took
TIME_CAP = 5.0  # seconds per example


def seed_tensors() -> dict[str, torch.Tensor]:
    return {
        "model.layers.0.attn": torch.arange(64, dtype=torch.float32).reshape(4, 4, 1, 4),
        "model.layers.1.attn": torch.arange(32, dtype=torch.float16).reshape(4, 2, 1, 4),
    }


class Seeds:
    """Valid inputs of each kind, written once in a temporary directory."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.description = parse_description(DESCRIPTION, "fuzz")
        self.dump = folder / "seed.safetensors"
        write_dump(
            self.dump,
            self.description,
            seed_tensors(),
            REQUESTS,
            worker=WorkerInfo(role="producer", engine="fuzz"),
        )
        data = self.dump.read_bytes()
        (length,) = struct.unpack_from("<Q", data)
        self.header = json.loads(data[8 : 8 + length])
        self.payload = data[8 + length :]
        self.metadata = {
            key: json.loads(value) if key != "kvaudit.format" else value
            for key, value in read_header(str(self.dump)).metadata.items()
        }
        self.record = checksum_dump_set(open_dump_set([self.dump]))
        self.record_json = record_to_json(self.record)
        self.wire = self.record.requests["r"].to_wire("request")


def safetensors_bytes(header: object, payload: bytes, length: int | None = None) -> bytes:
    """A safetensors file: the header's JSON padded to 64-byte alignment, then the data."""
    text = deep(json.dumps(header)).encode("utf-8", "surrogatepass")
    text += b" " * (-(8 + len(text)) % 64)
    return struct.pack("<Q", len(text) if length is None else length) + text + payload


# Strategies.


DEEP = "\x00deep:"  # a string that stands for lists nested that many levels deep


def nested(depth: int) -> str:
    """A stand-in for lists nested ``depth`` levels deep, expanded in the text (``deep``)
    so that neither the strategies nor ``json.dumps`` recurse through it."""
    return f"{DEEP}{depth}\x00"


def deep(text: str) -> str:
    """JSON or YAML text with each stand-in (quoted as JSON or YAML quotes it) expanded."""
    return _STAND_IN.sub(lambda match: "[" * int(match[1]) + "]" * int(match[1]), text)


_STAND_IN = re.compile(r'"(?:\\u0000|\\0)deep:(\d+)(?:\\u0000|\\0)"')


SCALARS = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.integers(),
    st.sampled_from(TEXTS),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(TEXTS), inner, max_size=4)
    ),
    max_leaves=12,
) | st.integers(60, 5000).map(nested)


def _paths(value: object, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def _replace(value: object, path: tuple[Any, ...], new: object) -> object:
    if not path:
        return new
    result = copy.copy(value)
    result[path[0]] = _replace(value[path[0]], path[1:], new)  # type: ignore[index]
    return result


@st.composite
def mutated(draw: st.DrawFn, seed_value: object, mutations: int = 3) -> object:
    """The seed (a dict) with a few values replaced by hostile ones, or a key renamed or
    dropped."""
    value = seed_value
    for _ in range(draw(st.integers(1, mutations))):
        path = draw(st.sampled_from(list(_paths(value))[1:]))
        action = draw(st.sampled_from(["replace", "replace", "rename", "drop"]))
        parent_path, parent = path[:-1], None
        if path:
            parent = value
            for key in parent_path:
                parent = parent[key]  # type: ignore[index]
        if action == "replace" or not isinstance(parent, dict):
            value = _replace(value, path, draw(JSON_VALUES))
        else:
            changed = dict(parent)
            item = changed.pop(path[-1])
            if action == "rename":
                changed[draw(st.sampled_from(TEXTS))] = item
            value = _replace(value, parent_path, changed)
    return value


YAML_PIECES = st.sampled_from(
    [
        "!!int x",
        "!!timestamp x",
        "!!timestamp 2001-13-45",
        "!!float y",
        "!!bool maybe",
        "!!python/object:os.system x",
        "!!binary '!!'",
        "!!set {a, b}",
        "&a [*a]",
        "*undefined",
        "[" * 300 + "]" * 300,
        "9" * 5000,
        '"\\ud800"',
        "{a: 1, a: 2}",
        "<<: {x: 1}",
        "- - -",
        "18446744073709551616",
        "1e999",
    ]
)


@st.composite
def yaml_texts(draw: st.DrawFn) -> str:
    """The seed description's YAML with a line's value replaced, an alias bomb, or a
    mutated description dumped as YAML."""
    kind = draw(st.sampled_from(["piece", "bomb", "dict", "bytes"]))
    if kind == "piece":
        lines = YAML_TEXT.splitlines()
        index = draw(st.integers(0, len(lines) - 1))
        head, _, _ = lines[index].partition(":")
        lines[index] = f"{head}: {draw(YAML_PIECES)}"
        return "\n".join(lines) + "\n"
    if kind == "bomb":
        width, levels = draw(st.integers(2, 12)), draw(st.integers(2, 12))
        text = "a0: &a0 [x]\n"
        for level in range(1, levels):
            text += f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]\n"
        return text
    if kind == "dict":
        return deep(yaml.safe_dump(draw(mutated(DESCRIPTION)), allow_unicode=True, width=10**6))
    return draw(st.binary(max_size=200)).decode("utf-8", "replace")


@st.composite
def wire_bytes(draw: st.DrawFn, seed_bytes: bytes) -> bytes:
    """The seed wire with bytes or fields overwritten, cut or extended."""
    data = bytearray(seed_bytes)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["field", "byte", "cut", "extend"]))
        if action == "field":
            width = draw(st.sampled_from([1, 2, 4, 8]))
            offset = draw(st.integers(0, max(0, len(data) - width)))
            value = draw(st.integers(0, 2 ** (8 * width) - 1) | st.sampled_from([0, 2**width]))
            data[offset : offset + width] = value.to_bytes(width, "little")[: len(data) - offset]
        elif action == "byte" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif action == "cut":
            del data[draw(st.integers(0, len(data))) :]
        else:
            data += draw(st.binary(max_size=24))
    return bytes(data)


# Targets: read an input as the command line does; return what was read.


class Targets:
    """Each target writes its input where a reader expects it and reads it."""

    def __init__(self, seeds: Seeds) -> None:
        self.seeds = seeds
        self.count = 0

    def _file(self, suffix: str, data: bytes) -> Path:
        self.count += 1
        path = self.seeds.folder / f"input{self.count % 8}{suffix}"
        path.write_bytes(data)
        return path

    def dump(self, data: bytes) -> object:
        dump_set = open_dump_set([self._file(".safetensors", data)])
        return checksum_dump_set(dump_set)

    def header(self, header: object, length: int | None) -> object:
        return self.dump(safetensors_bytes(header, self.seeds.payload, length))

    def metadata(self, metadata: dict[str, object]) -> object:
        header = dict(self.seeds.header)
        header["__metadata__"] = {
            key: value if isinstance(value, str) else deep(json.dumps(value))
            for key, value in metadata.items()
        }
        return self.dump(safetensors_bytes(header, self.seeds.payload))

    def description(self, text: str) -> object:
        path = self._file(".yaml", text.encode("utf-8", "surrogatepass"))
        return load_description(path)

    def record(self, data: object) -> object:
        text = deep(json.dumps(data)).encode("utf-8", "surrogatepass")
        record = load_record(str(self._file(".json", text)))
        return compare_records(record, self.seeds.record)

    def wire(self, data: bytes) -> object:
        return verify_received(self.seeds.record, {"r": data}, source="fuzz")


# Running under the caps.


class ExampleTimeout(Exception):
    """An example ran past ``TIME_CAP``."""


def _on_alarm(signum: int, frame: object) -> None:
    raise ExampleTimeout(f"an example ran past {TIME_CAP} s")


@contextmanager
def time_cap() -> Iterator[None]:
    signal.setitimer(signal.ITIMER_REAL, TIME_CAP)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def outcome(read: Callable[[], object]) -> None:
    """Run one input's reader: a result, or a one-line ``KvauditError`` that names a
    source; anything else propagates as a failure."""
    with time_cap():
        try:
            read()
        except KvauditError as error:
            text = str(error)
            assert "\n" not in text and "\r" not in text, text
            assert text.encode("utf-8"), text  # printable: no lone surrogate
            assert error.source or ": " in text, text


def cap_memory(extra: int = MEMORY_CAP) -> None:
    """Limit the address space to what the process holds now plus ``extra`` bytes."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[0])
    limit = pages * resource.getpagesize() + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run(examples: int, random_seed: int) -> dict[str, float]:
    """Fuzz each target with ``examples`` examples; the seconds each took."""
    signal.signal(signal.SIGALRM, _on_alarm)
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        seeds = Seeds(Path(folder))
        targets = Targets(seeds)
        wire_seed = encode_wire(seeds.wire)
        cap_memory()
        configured = settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
            # No "explain" phase: its line tracing slows examples past the time cap.
            phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
        )
        header_lengths = st.none() | st.sampled_from([0, 7, 2**31, 6 << 30, 2**64 - 1])
        tests: dict[str, Callable[[], None]] = {
            "safetensors header": given(mutated(seeds.header), header_lengths)(
                lambda header, length: outcome(lambda: targets.header(header, length))
            ),
            "dump metadata": given(mutated(seeds.metadata))(
                lambda metadata: outcome(lambda: targets.metadata(metadata))
            ),
            "description YAML": given(yaml_texts())(
                lambda text: outcome(lambda: targets.description(text))
            ),
            "record JSON": given(mutated(seeds.record_json))(
                lambda data: outcome(lambda: targets.record(data))
            ),
            "wire bytes": given(wire_bytes(wire_seed))(
                lambda data: outcome(lambda: targets.wire(data))
            ),
        }
        for name, test in tests.items():
            began = time.perf_counter()
            seed(random_seed)(configured(test))()
            timings[name] = time.perf_counter() - began
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100, help="examples per target")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis' random seed")
    args = parser.parse_args(argv)
    timings = run(args.examples, args.seed)
    for name, seconds in timings.items():
        print(f"{name}: {args.examples} examples in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
