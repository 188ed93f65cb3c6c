"""A CI check of a KV connector: the consumer must hold exactly the producer's KV.

A connector's own test runs a transfer and writes both engines' KV caches as kvaudit
dumps (``kvaudit.dumps.write_dump``), one directory per engine:

    $KVAUDIT_DUMPS/producer/rank0.safetensors ...     what the prefill engine computed
    $KVAUDIT_DUMPS/consumer/rank0.safetensors ...     what the decode engine received

Several cases may sit side by side (``$KVAUDIT_DUMPS/<case>/producer``,
``<case>/consumer``), and a directory may hold several consumers (``consumer``,
``consumer-tp4``, ...) of one producer. Each consumer becomes one test, which fails with
the located report (request, group, block, layer, head, tokens, first byte) when the KV
differs. No dumps at all is a failure, not a skip: a connector test that stopped writing
them must not pass silently.

    KVAUDIT_DUMPS=out/example python -m pytest examples/ci/test_kv_transfer.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvaudit.testing import assert_kv_equal

DUMPS = Path(os.environ.get("KVAUDIT_DUMPS", "kv-dumps"))


def transfer_cases(root: Path) -> list[tuple[Path, Path]]:
    """Every ``(producer, consumer)`` pair of directories under ``root``: a ``consumer*``
    directory next to a ``producer`` directory."""
    if not root.is_dir():
        return []
    cases = []
    for producer in sorted([root / "producer", *root.glob("**/producer")]):
        if not producer.is_dir():
            continue
        for consumer in sorted(producer.parent.glob("consumer*")):
            if consumer.is_dir() and (producer, consumer) not in cases:
                cases.append((producer, consumer))
    return cases


CASES = transfer_cases(DUMPS)


def case_name(case: tuple[Path, Path]) -> str:
    return str(case[1].relative_to(DUMPS))


def test_dumps_were_written() -> None:
    assert CASES, f"no producer/consumer dump directories under {DUMPS} (KVAUDIT_DUMPS)"


@pytest.mark.parametrize("case", CASES, ids=[case_name(case) for case in CASES])
def test_consumer_holds_the_producers_kv(case: tuple[Path, Path]) -> None:
    producer, consumer = case
    assert_kv_equal(producer, consumer)
