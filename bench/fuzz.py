"""A longer fuzz run of kvaudit's readers than the suite's (``tests/helpers/fuzz_inputs.py``):
every input must end in a result or a one-line ``KvauditError``, within the per-example
time cap and the process's memory cap.

    python bench/fuzz.py 20000            # examples per target
    python bench/fuzz.py 20000 --seed 7   # another random seed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import fuzz_inputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", type=int, help="examples per target")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis' random seed")
    args = parser.parse_args()
    return fuzz_inputs.main(["--examples", str(args.examples), "--seed", str(args.seed)])


if __name__ == "__main__":
    sys.exit(main())
