"""The SGLang tests run against the real SGLang 0.5.23 on the CPU (``scripts/test.sh``, its
SGLang stage): an SGLang that cannot be imported fails them, it never skips them.

SGLang's KV pools import ``torchvision.transforms`` at load time (through
``sglang.srt.configs``), and no torchvision installs on the CPU torch here: where none is
installed, ``shims/`` (an import-only stand-in, see ``shims/torchvision.py``) goes on
``sys.path`` before anything imports SGLang.

Shared fixtures: ``sglang_context`` (SGLang's published server args, parallel ranks and
device for one test), ``gloo_group`` (a one-rank CPU process group), ``hooks``
(kvaudit's inline hooks installed through SGLang's ``HookRegistry`` for one test) and
``tp1_decode`` (a TP=1 decode's published context, the hooks installed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
# The CPU prefill/decode world of docs/sglang.md's walk-through, driven by the tests.
sys.path.insert(0, str(HERE.parent.parent / "examples" / "sglang_cpu"))
if importlib.util.find_spec("torchvision") is None:
    sys.path.insert(0, str(HERE / "shims"))

# An ImportError here fails the run (the modules kvaudit's SGLang integration meets).
import sglang.srt.disaggregation.decode  # noqa: E402
import sglang.srt.disaggregation.prefill  # noqa: E402
import sglang.srt.disaggregation.utils  # noqa: E402
import sglang.srt.mem_cache.memory_pool  # noqa: E402,F401
from sglang.srt.runtime_context import get_context, get_device, get_parallel  # noqa: E402


@pytest.fixture
def sglang_context() -> Iterator[Callable[..., Any]]:
    """Publish SGLang's runtime context for one test; everything is restored after it.

    Yields ``publish(*, parallel=None, gpu_id=0, **server_args)``, which:

    * publishes a dummy ``ServerArgs`` carrying ``server_args`` (real ``ServerArgs`` field
      names, e.g. ``disaggregation_mode="prefill"``,
      ``disaggregation_transfer_backend="fake"``, ``disaggregation_enable_kv_checksum=True``)
      through ``get_context().override_server_args(...).install()``, so that
      ``get_server_args()``, ``get_disagg()``, ``get_device()`` and the parallel config
      answer;
    * states this process's ranks and groups, ``get_parallel().override(**parallel)``
      (e.g. ``{"tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "attn_tp_rank": 0}``;
      ``attn_tp_group=SimpleNamespace(cpu_group=...)`` for the decode side): a rank is
      not published by the server args, and reading one raises until it is stated;
    * sets ``get_device().gpu_id`` (``None`` in the dummy config) unless ``gpu_id`` is None;

    and returns the published ``ServerArgs``. Call it once per test.
    """
    with contextlib.ExitStack() as stack:

        def publish(*, parallel: dict[str, Any] | None = None, gpu_id: int | None = 0, **fields):
            override = get_context().override_server_args(**fields)
            server_args = override.install()
            stack.callback(override.restore)
            if parallel:
                stack.enter_context(get_parallel().override(**parallel))
            if gpu_id is not None:
                stack.enter_context(get_device().override(gpu_id=gpu_id))
            return server_args

        yield publish


@pytest.fixture(scope="session")
def gloo_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A one-rank gloo process group (rank 0 of 1) on the CPU, for SGLang code that
    all-reduces over a CPU group (decode's checksum check over ``attn_tp_cpu_group``).
    The default group is initialized through a file (no port) and destroyed after the
    session."""
    import torch.distributed as dist

    init_file = tmp_path_factory.mktemp("gloo") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture
def hooks() -> Iterator[None]:
    """kvaudit's hooks installed in this process through ``HookRegistry``; the original
    methods restored afterwards."""
    from pd_world import register_inline
    from sglang.srt.disaggregation.decode import (
        DecodeTransferQueue,
        SchedulerDisaggregationDecodeMixin,
    )
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvaudit.integrations.sglang import inline

    saved = {
        (cls, name): cls.__dict__[name]
        for cls, name in (
            (SchedulerDisaggregationPrefillMixin, "send_kv_chunk"),
            (DecodeTransferQueue, "_commit_transfer_to_req"),
            (SchedulerDisaggregationDecodeMixin, "_verify_kv_checksums"),
        )
    }
    HookRegistry.reset()
    register_inline()
    HookRegistry.apply_hooks()
    inline.reset_inline_stats()
    try:
        yield
    finally:
        for (cls, name), original in saved.items():
            setattr(cls, name, original)
        HookRegistry.reset()


@pytest.fixture
def tp1_decode(gloo_group, sglang_context, monkeypatch, hooks) -> Any:
    """A TP=1 decode's context published (PP=1, rank 0, ``attn_tp_group`` on
    ``gloo_group``, the fake backend, SGLang's checksum on) with kvaudit's hooks installed
    and SGLang's CI mode off (it raises on a mismatch); returns ``gloo_group``."""
    from types import SimpleNamespace

    sglang_context(
        parallel={
            "tp_rank": 0,
            "pp_rank": 0,
            "attn_tp_rank": 0,
            "attn_tp_group": SimpleNamespace(cpu_group=gloo_group),
        },
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        disaggregation_enable_kv_checksum=True,
    )
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    return gloo_group
