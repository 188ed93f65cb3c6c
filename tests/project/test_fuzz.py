"""The fuzz test: ``tests/helpers/fuzz_inputs.py`` run as its own process, whose memory it caps
(``RLIMIT_AS``) and whose examples it times, over the five readers of hostile input. A
longer run is ``bench/fuzz.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
EXAMPLES = 250  # per target: about 20 s on a loaded 2-core machine


def test_every_fuzzed_input_ends_in_a_result_or_a_one_line_error() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    result = subprocess.run(
        [sys.executable, str(TESTS / "helpers" / "fuzz_inputs.py"), "--examples", str(EXAMPLES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and all(f"{EXAMPLES} examples" in line for line in lines), lines
