"""The vLLM tests run against the real vLLM (``scripts/test.sh``, its vLLM stage): a vLLM
that cannot be imported fails them, it never skips them."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
# The CPU engine (vLLM's real scheduler) of docs/vllm.md's walk-through, driven by the tests.
sys.path.insert(0, str(HERE.parent.parent / "examples" / "vllm_cpu"))

import vllm  # noqa: E402,F401 - an ImportError here fails the run
from vllm.distributed.kv_transfer.kv_connector.v1 import base  # noqa: E402,F401
