"""Every Triton kernel variant that the plans produce for the test matrix and for real
models, found through the real path (description + tensors -> views -> plans).

Used by tests/checksum/test_kernel_compile.py and bench/kernel_resources.py. Only the layout of a
layer matters to a variant, so each model keeps two layers and a few blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from helpers import kvbuild as kb
from helpers.triton_compile import Variant
from kvaudit.checksum.kernels.triton_kernel import TritonLaunch
from kvaudit.checksum.plans import GroupPlan
from kvaudit.description import parse_description
from kvaudit.views import build_group_views

ALL_LAYOUTS = ("NTHC", "NHTC", "KNTHD", "KNHTD", "NKTHD", "NKHTD", "NTHD", "NHTD")


def variants_of(model: kb.Model, engine: kb.Engine, tokens: int = 40) -> list[Variant]:
    """The distinct variants every worker of ``engine`` launches, as producer and consumer."""
    requests = {"r": kb.make_request(model, tokens, 1, engine.tp_size)}
    found: dict[Variant, None] = {}
    for worker in kb.build_engine(model, requests, engine):
        description = parse_description(worker.description, "variants")
        groups = build_group_views(
            description, worker.tensors, tp_rank=worker.tp_rank, tp_size=worker.tp_size
        )
        for group in groups.values():
            if not group.covered:
                continue
            for producer in (True, False):
                plan = GroupPlan.create(group.views, first_replica_only=producer, backend="triton")
                if plan is None:
                    continue
                for launch in plan.launches:
                    assert isinstance(launch, TritonLaunch)
                    found[Variant.of_launch(launch, len(plan.replica_keys))] = None
    return list(found)


def _attn(
    heads: int,
    head_size: int,
    layout: str,
    block_size: int = 16,
    dtype: str = "bfloat16",
    kernel_block_size: int | None = None,
    **attn: object,
) -> kb.Model:
    layers = tuple(
        kb.Attn(f"model.layers.{i}.self_attn.attn", heads, head_size, dtype=dtype, **attn)
        for i in range(2)
    )
    group = kb.GroupModel(0, layers, block_size, kernel_block_size, layout=layout)
    return kb.Model((group,))


def _nemotron_h_mamba(block_size: int = 16) -> kb.Mamba:
    """A Mamba-2 mixer shaped like Nemotron-H 8B's: conv state (3, x + B + C) in bf16 and
    SSM state (128 heads, 64, 128) in fp32, both split over TP ranks."""
    return kb.Mamba(
        "model.layers.{}.mixer",
        shapes=((3, 8192 + 2 * 1024), (128, 64, 128)),
        dtypes=("bfloat16", "float32"),
        splits=((1, ((8192, 8), (1024, 8), (1024, 8))), (0, ((128, 8),))),
    )


def _hybrid() -> kb.Model:
    """Mamba-2 mixers in one group and GQA attention (8 KV heads of 128) in another."""
    mamba = _nemotron_h_mamba()
    mixers = tuple(kb.Mamba(**{**mamba.__dict__, "name": mamba.name.format(i)}) for i in (0, 2))
    attention = tuple(
        kb.Attn(f"model.layers.{i}.self_attn.attn", 8, 128, layout="NTHC") for i in (1, 3)
    )
    return kb.Model(
        (kb.GroupModel(0, mixers, block_size=16), kb.GroupModel(1, attention, 16)),
        model_kv_heads=8,
    )


def _matrix() -> dict[str, Callable[[], list[Variant]]]:
    """The test matrix's layouts and dtypes (tests/helpers/engine_runs.py), small shapes."""
    cases: dict[str, Callable[[], list[Variant]]] = {}
    for layout in ALL_LAYOUTS:
        cases[f"matrix {layout} bf16"] = lambda lay=layout: variants_of(
            _attn(4, 8, lay, block_size=8), kb.Engine(tp_size=2)
        )
    for dtype, head_size, layout in (
        ("float8_e4m3fn", 8, "KNTHD"),
        ("float32", 6, "NTHC"),
        ("float16", 4, "NHTC"),
    ):
        cases[f"matrix {layout} {dtype}"] = lambda d=dtype, s=head_size, lay=layout: variants_of(
            _attn(4, s, lay, block_size=8, dtype=d), kb.Engine(tp_size=2)
        )
    cases["matrix KNHTD kernel blocks"] = lambda: variants_of(
        _attn(4, 8, "KNHTD", block_size=8), kb.Engine(tp_size=2, kernel_block_sizes={0: 2})
    )
    cases["matrix MLA NTC fp8"] = lambda: variants_of(
        _attn(1, 16, "NTC", block_size=8, dtype="float8_e4m3fn", type="mla"), kb.Engine(tp_size=2)
    )
    for state_dtype, rows in (("uint8", 1), ("int32", 1), ("int16", 2)):
        cases[f"matrix split Mamba {state_dtype}"] = lambda d=state_dtype, r=rows: variants_of(
            _small_mamba(split=True), kb.Engine(tp_size=2, state_dtype=d, state_rows=r)
        )
    cases["matrix unsplit Mamba"] = lambda: variants_of(_small_mamba(split=False), kb.Engine())
    return cases


def _small_mamba(split: bool) -> kb.Model:
    """tests/helpers/engine_runs.py's Mamba models."""
    if split:
        layer = kb.Mamba(
            "model.layers.{}.mixer",
            shapes=((3, 24), (8, 4, 2)),
            dtypes=("bfloat16", "float32"),
            splits=((1, ((16, 8), (4, 1), (4, 1))), (0, ((8, 8),))),
            page_pad=12,
        )
    else:
        layer = kb.Mamba(
            "model.layers.{}.mixer",
            shapes=((3, 8), (2, 4, 4), (5,)),
            dtypes=("bfloat16", "float32", "float16"),
            checksummed_states=2,
        )
    mixers = tuple(kb.Mamba(**{**layer.__dict__, "name": layer.name.format(i)}) for i in (1, 3))
    return kb.Model((kb.GroupModel(0, mixers, block_size=8),))


def _models() -> dict[str, Callable[[], list[Variant]]]:
    """Real model shapes: the main variants."""
    cases: dict[str, Callable[[], list[Variant]]] = {}
    for layout in ("KNTHD", "NKHTD", "NTHC"):
        cases[f"Llama-3.1-8B {layout}"] = lambda lay=layout: variants_of(
            _attn(8, 128, lay), kb.Engine()
        )
    for tp in (1, 2, 4, 8):
        # Qwen2.5-7B: 4 KV heads of 128; at TP 8 two ranks hold each head.
        cases[f"Qwen2.5-7B GQA TP{tp}"] = lambda t=tp: variants_of(
            kb.Model(_attn(4, 128, "KNTHD").groups, model_kv_heads=4), kb.Engine(tp_size=t)
        )
    cases["DeepSeek-V3 MLA 576"] = lambda: variants_of(
        _attn(1, 576, "NTC", block_size=64, type="mla"), kb.Engine(tp_size=2)
    )
    for tp in (1, 4):
        cases[f"Nemotron-H hybrid Mamba TP{tp}"] = lambda t=tp: variants_of(
            _hybrid(), kb.Engine(tp_size=t)
        )
    return cases


MODELS = _models()
"""Real model shapes, by name: the main variants, compiled in every CI run."""

MATRIX = _matrix()
"""The test matrix's layouts and dtypes, by name."""
