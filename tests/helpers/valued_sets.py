"""Dump sets of attention layers whose values the test chooses (floats cast to each
layer's dtype), dumped by a TP=2 producer and a TP=4 consumer in other block sizes,
layouts and block ids: what the numeric and HTML report tests share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from helpers import kvbuild as kb
from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import WorkerInfo

ATTN = "model.layers.{}.self_attn.attn"
HEADS, HEAD_SIZE = 4, 8
TOKENS = {"req-a": 37, "req-b": 20}
PRODUCER = kb.Engine(
    tp_size=2, block_sizes={0: 16}, kernel_block_sizes={0: 8}, layouts={0: "NHTC"}, seed=3
)
CONSUMER = kb.Engine(tp_size=4, block_sizes={0: 4}, layouts={0: "KNTHD"}, seed=4)


def model(dtype: str, layers: int = 3) -> kb.Model:
    """One group of attention layers of one dtype."""
    attn = tuple(kb.Attn(ATTN.format(i), HEADS, HEAD_SIZE, dtype=dtype) for i in range(layers))
    return kb.Model((kb.GroupModel(0, attn, 8),), model_kv_heads=HEADS)


def to_cells(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float values ``[tokens, heads, elements]`` as cells of ``dtype`` (uint8)."""
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(kb.DTYPES[dtype])
    raw = tensor.view(torch.uint8).numpy()
    return raw.reshape(values.shape[0], values.shape[1], -1)


def cell_values(cells: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 values of cells, decoded by torch (independently of kvaudit)."""
    tensor = torch.from_numpy(np.ascontiguousarray(cells)).view(kb.DTYPES[dtype])
    return tensor.to(torch.float64).numpy()


def dump(
    folder: Path,
    the_model: kb.Model,
    values: dict[str, dict[str, np.ndarray]],
    engine: kb.Engine,
    role: str,
    scale: float | None = None,
    positions: dict[str, dict[int, tuple[int, int]]] | None = None,
) -> Path:
    """An engine's dumps of requests whose layers hold ``values[rid][layer]`` (float
    ``[tokens, heads, elements]``, cast to each layer's dtype); ``positions`` lists only
    some block positions (``kvbuild.build_engine``)."""
    folder.mkdir(parents=True, exist_ok=True)
    requests = {}
    for rid, layers in values.items():
        tokens = next(iter(layers.values())).shape[0]
        data = {
            name: to_cells(array, the_model.layer(name).dtype) for name, array in layers.items()
        }
        requests[rid] = kb.RequestKV(tokens, data)
    for w in kb.build_engine(the_model, requests, engine, positions):
        if scale is not None:
            for group in w.description["groups"]:
                group["spec"]["scale"] = scale
        path = folder / f"tp{w.tp_rank}.safetensors"
        blocks = {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in w.requests.items()}
        info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, role, "test")
        write_dump(
            path, parse_description(w.description, str(path)), w.tensors, blocks, worker=info
        )
    return folder


def draw(seed: int, the_model: kb.Model, tokens: dict[str, int] = TOKENS) -> dict:
    """Normal values of every layer of the model, per request: float32 ``[tokens, heads,
    elements]``."""
    rng = np.random.default_rng(seed)
    return {
        rid: {
            layer.name: rng.normal(0, 2, (n, HEADS, 2 * HEAD_SIZE)).astype(np.float32)
            for layer in the_model.groups[0].layers
        }
        for rid, n in tokens.items()
    }


def errors_reference(p: np.ndarray, c: np.ndarray, atol: float, rtol: float) -> dict:
    """Errors of one (layer, head): p and c float64 ``[tokens, elements]``."""
    err = np.abs(c - p)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(err == 0, 0.0, err / np.abs(p))
    per_token = err.max(axis=1)
    order = sorted(range(len(per_token)), key=lambda t: (-per_token[t], t))
    return {
        "max_abs_error": err.max(),
        "max_rel_error": rel.max(),
        "rms_error": np.sqrt(np.mean(err**2)),
        "over_tolerance": int((err > atol + rtol * np.abs(p)).sum()),
        "worst": [int(t) for t in order[:5] if per_token[t] > 0],
    }
