"""vLLM against SGLang: a request's KV that vLLM 0.33.0 computed and kvaudit's vLLM
connector dumped is compared by ``kvaudit diff`` with the same KV held in SGLang 0.5.23's
pools at another TP width, served ``live:`` by kvaudit's agent (docs/sglang.md, "vLLM
against SGLang").

The vLLM side is real: docs/vllm.md's CPU walk-through (examples/vllm_cpu/walkthrough.py:
vLLM's own Scheduler, kvaudit's connector around vLLM's ExampleConnector) runs in the vLLM
stage's environment (``.venv-vllm``, which scripts/test.sh builds before this stage) and
leaves the prefill's dump of ``req-7`` (TP=1, 4 KV heads, vLLM's ``NHTC`` view). The SGLang
side holds that request's K and V, read from the dump, in two real ``MHATokenToKVPool``
ranks (TP=2, 2 heads each, pages from SGLang's own allocator after other pages), written
through the pool's ``set_kv_buffer``. The layer names are the same in both engines
(``model.layers.{i}.self_attn.attn``, SGLang's default here). What the diff must find
follows from the element the test changes.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from kvaudit.cli import main
from kvaudit.dumps import open_dump
from kvaudit.integrations.sglang import sglang_agent, sglang_kv_heads
from kvaudit.live import socket_path

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RID = "req-7"


@pytest.fixture(scope="module")
def vllm_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM prefill's dump of ``req-7``, from a real vLLM run."""
    assert VLLM_PYTHON.is_file(), (
        f"{VLLM_PYTHON} is missing: build the vLLM stage's environment first "
        "(scripts/test.sh, 'Stage: vLLM')"
    )
    out = tmp_path_factory.mktemp("vllm")
    done = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "examples" / "vllm_cpu" / "walkthrough.py"), str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / "prefill" / "dumps" / RID


def request_kv(folder: Path) -> tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The request's tokens and, per layer, K and V ``[tokens, heads, head_size]`` from
    the vLLM dump (``NHTC``: blocks, heads, tokens, K then V)."""
    (path,) = folder.glob("*.safetensors")
    dump = open_dump(path)
    request = dump.requests[RID]
    _, block_ids = request.groups[0]
    size = dump.description.groups[0].spec.head_size
    kv = {}
    for name, tensor in dump.tensors.items():
        rows = torch.stack([tensor[dump.row_of(b)] for b in block_ids])  # [blocks, H, T, C]
        tokens = rows.permute(0, 2, 1, 3).reshape(-1, rows.shape[1], rows.shape[3])
        tokens = tokens[: request.num_tokens].clone()
        kv[name] = (tokens[..., :size].contiguous(), tokens[..., size:].contiguous())
    return request.num_tokens, kv


@pytest.fixture
def sglang_engine(vllm_dump: Path, tmp_path: Path):
    """The request's KV in a TP=2 SGLang engine's pools, each rank served live."""
    tokens, kv = request_kv(vllm_dump)
    (k0, _) = next(iter(kv.values()))
    heads, head_dim, page = k0.shape[1], k0.shape[2], 16
    root = tmp_path / "run"
    ranks, agents = [], []
    for tp_rank in range(2):
        shard = sglang_kv_heads(tp_rank, 2, heads)
        pool = MHATokenToKVPool(
            size=page * 16, page_size=page, dtype=k0.dtype, head_num=shard.count,
            head_dim=head_dim, layer_num=len(kv), device="cpu", enable_memory_saver=False,
            start_layer=0, end_layer=len(kv),
        )  # fmt: skip
        allocator = PagedTokenToKVPoolAllocator(
            size=page * 16, page_size=page, dtype=k0.dtype, device="cpu", kvcache=pool,
            need_sort=False,
        )  # fmt: skip
        allocator.alloc((3 + tp_rank) * page)  # other requests' pages first
        loc = allocator.alloc(-(-tokens // page) * page)[:tokens]
        table = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
        (row,) = table.alloc_rows(1)
        table.write((row, slice(0, tokens)), loc.to(torch.int32))
        part = slice(shard.first, shard.first + shard.count)
        for layer_id, (k, v) in enumerate(kv.values()):
            pool.set_kv_buffer(
                SimpleNamespace(layer_id=layer_id), loc.long(), k[:, part], v[:, part]
            )
        ranks.append(SimpleNamespace(pool=pool, table=table, row=row, shard=shard))
        agents.append(
            sglang_agent(
                socket_path("sglang", 0, tp_rank, str(root)), pool, table,
                lambda row=row: {RID: (row, tokens)}, tp_rank=tp_rank, tp_size=2,
                total_kv_heads=heads, role="consumer", engine="sglang", lock=threading.Lock(),
            )
        )  # fmt: skip
    try:
        yield vllm_dump, root / "sglang", ranks
    finally:
        for agent in agents:
            agent.close()


def diff(producer: Path, consumer: Path) -> tuple[int, dict]:
    result = CliRunner().invoke(
        main,
        ["diff", str(producer), f"live:{consumer}", "--request", RID, "--format", "json",
         "--device", "cpu"],
    )  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def test_vllms_dump_and_sglangs_pools_agree(sglang_engine) -> None:
    dump, live, _ = sglang_engine
    code, report = diff(dump, live)
    assert (code, report["ok"]) == (0, True), report
    assert report["requests"][RID]["groups"]["0"]["compared"] == 5


def test_a_change_in_sglangs_pool_is_located(sglang_engine) -> None:
    dump, live, ranks = sglang_engine
    rank = ranks[1]  # global heads 2 and 3
    slot = int(rank.table.req_to_token[rank.row, 50])
    cells = rank.pool.v_buffer[1].view(torch.int16)  # one bit of layer 1, head 3, token 50
    cells[slot, 3 - rank.shard.first, 5] ^= 0x10
    code, report = diff(dump, live)
    assert code == 1
    group = report["requests"][RID]["groups"]["0"]
    assert group["mismatched_positions"] == [50 // 16]
    (entry,) = group["located"]
    assert (entry["layer"], entry["head"], entry["tokens"]) == (
        "model.layers.1.self_attn.attn",
        3,
        [50],
    )
