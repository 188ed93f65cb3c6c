"""kvaudit's inline verification of an SGLang P/D transfer (``kvaudit.integrations.sglang.
inline``, docs/sglang.md "Inline verification"), run through SGLang 0.5.23's own code on
the CPU: a TP=2 prefill (two processes on a real 2-rank gloo group) hands requests to a
TP=1 decode (this process), and to a TP=2 decode with 32-token pages (two processes).

Real SGLang classes and methods: ``MHATokenToKVPool``, ``PagedTokenToKVPoolAllocator``,
``ReqToTokenPool`` and ``MetadataBuffers`` (checksum row on) on each rank, the real
``PrefillBootstrapQueue`` with the fake transfer backend (its ``FakeKVSender``, ``KVArgs``
and layout signature), ``kv_layout_signature`` on the decode, the real ``DecodeTransferQueue``
and ``DecodeRequest``; the hooks installed by ``inline.register()`` through SGLang's
``HookRegistry.apply_hooks()``; the real ``send_kv_chunk`` (with ``_send_kv_chunk`` and
``set_buf``), ``_commit_transfer_to_req``, ``_kv_checksum_comparable``,
``_verify_kv_checksums`` and ``_handle_kv_checksum_mismatch`` (with SGLang's
``prepare_abort``).

Stand-ins, and only these: the scheduler is a ``SimpleNamespace`` used ONLY as the ``self``
these real methods run on (a whole ``Scheduler`` is not constructed on the CPU); requests
are ``SimpleNamespace`` objects with the fields those methods read; SGLang's own digest
(``KvChecksumComputer.compute``, a CUDA kernel) is a zlib Adler-32 emulation of the same
bytes; ``release_kv_cache`` (which needs a real tree cache) is recorded instead of run;
the batch is a list with ``filter_batch`` keeping the given indices. The fake backend
moves no bytes, so the test moves the metadata rows from prefill to decode as a real
backend does (mooncake's ``send_aux``): each aux buffer's whole row of the prefill's slot
is copied byte for byte into the decode's slot, from both prefill ranks (the last
writer's row is what decode reads).

Expected values come from the test's own KV (which cell it changed) and, for the carried
sum, from ``tests/helpers/reference.py``'s independent computation of the spec.
"""

from __future__ import annotations

import ctypes
import json
import os
import zlib
from pathlib import Path
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import reference as ref
from sglang.srt.disaggregation import decode as sglang_decode
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.decode import (
    DecodeRequest,
    DecodeTransferQueue,
    SchedulerDisaggregationDecodeMixin,
)
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
from sglang.srt.disaggregation.utils import (
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    kv_layout_signature,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.plugins.hook_registry import HookRegistry

from kvaudit.integrations.sglang import inline, sglang_kv_heads

PAGE = 16
LAYERS = 2
HEADS = 4  # model KV heads; 2 per prefill rank
HEAD_DIM = 8
DTYPE = torch.bfloat16
NAME = "model.layers.{i}.self_attn.attn"
# rid: (tokens, decode prefix). None a multiple of the page size.
REQUESTS = {
    "req-plain": (21, 0),  # sent first, before the hooks are installed: no kvaudit
    "req-ok": (37, 0),
    "req-bad": (40, 0),
    "req-prefix": (50, 16),
    "HEALTH_CHECK_1": (17, 0),
}
CHANGED = ("req-bad", 1, 2, 33)  # the decode's corrupted cell: layer 1, head 2, token 33
HOOKED = {"send_kv_chunk", "_commit_transfer_to_req", "_verify_kv_checksums"}


def _register() -> None:
    """kvaudit's plug-in entry point with inline verification turned on, as a user turns
    it on (``KVAUDIT_SGLANG_INLINE=1``)."""
    os.environ["KVAUDIT_SGLANG_INLINE"] = "1"
    try:
        inline.register()
    finally:
        del os.environ["KVAUDIT_SGLANG_INLINE"]


def _kv(rid: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The request's global K and V ``[tokens, HEADS, HEAD_DIM]`` per layer."""
    gen = torch.Generator().manual_seed(sorted(REQUESTS).index(rid) + 1)
    n = REQUESTS[rid][0]
    return {
        layer: tuple(torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(DTYPE) for _ in range(2))
        for layer in range(LAYERS)
    }


class _World:
    """One rank's real pool, allocator, request rows and metadata buffers, the requests'
    KV written through the pool's own ``set_kv_buffer`` (this rank's heads only)."""

    def __init__(
        self, tp_rank: int, tp_size: int, order: list[str], junk: int, page: int = PAGE
    ) -> None:
        self.shard = sglang_kv_heads(tp_rank, tp_size, HEADS)
        self.pool = MHATokenToKVPool(
            size=page * 32,
            page_size=page,
            dtype=DTYPE,
            head_num=self.shard.count,
            head_dim=HEAD_DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=LAYERS,
        )
        self.allocator = PagedTokenToKVPoolAllocator(
            size=page * 32,
            page_size=page,
            dtype=DTYPE,
            device="cpu",
            kvcache=self.pool,
            need_sort=False,
        )
        self.req_to_token = ReqToTokenPool(
            size=8, max_context_len=128, device="cpu", enable_memory_saver=False
        )
        self.metadata = MetadataBuffers(
            size=8,
            hidden_size=16,
            hidden_states_dtype=DTYPE,
            max_sampling_mask_tokens=16,
            kv_checksum_enabled=True,
        )
        self.rows: dict[str, int] = {}
        self.allocator.alloc(junk * page)
        for rid in order:
            n = REQUESTS[rid][0]
            loc = self.allocator.alloc(-(-n // page) * page)[:n]
            (row,) = self.req_to_token.alloc_rows(1)
            self.req_to_token.write((row, slice(0, n)), loc.to(torch.int32))
            self.rows[rid] = row
            part = slice(self.shard.first, self.shard.first + self.shard.count)
            for layer, (k, v) in _kv(rid).items():
                self.pool.set_kv_buffer(
                    SimpleNamespace(layer_id=layer), loc.long(), k[:, part], v[:, part]
                )

    def sglang_digest(self):
        """SGLang's own digest (``KvChecksumComputer.compute``: Adler-32 of this rank's
        bytes, buffer-major, page-minor), on the CPU."""
        buffers = self.pool.k_buffer + self.pool.v_buffer
        _, _, item_lens = self.pool.get_contiguous_buf_infos()

        def compute(pages, state_indices=None):
            value = 1
            for buffer, item in zip(buffers, item_lens, strict=True):
                raw = buffer.view(torch.uint8).reshape(-1)
                for page in pages.tolist():
                    value = zlib.adler32(raw[page * item : (page + 1) * item].numpy(), value)
            return value

        return SimpleNamespace(compute=compute)


def _aux_rows(buffers: MetadataBuffers, index: int) -> list[str]:
    """Every aux buffer's row ``index``, as the bytes a transfer backend sends."""
    ptrs, _, item_lens = buffers.get_buf_infos()
    return [
        ctypes.string_at(ptr + index * item, item).hex()
        for ptr, item in zip(ptrs, item_lens, strict=True)
    ]


def _receive_aux(buffers: MetadataBuffers, index: int, rows: list[str]) -> None:
    """Write a prefill's aux rows into the decode's slot ``index`` (mooncake ``send_aux``)."""
    ptrs, _, item_lens = buffers.get_buf_infos()
    assert len(ptrs) == len(rows)
    for ptr, item, row in zip(ptrs, item_lens, rows, strict=True):
        data = bytes.fromhex(row)
        assert len(data) == item
        ctypes.memmove(ptr + index * item, data, item)


def _prefill_rank(rank: int, init_file: str, out_dir: str) -> None:
    """One prefill TP rank (a spawned process): the real ``send_kv_chunk`` of every
    request's last chunk, ``req-plain`` before kvaudit's hooks are installed."""
    import torch.distributed as dist
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_context, get_device, get_parallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")
    override = get_context().override_server_args(
        disaggregation_mode="prefill",
        tp_size=2,
        disaggregation_transfer_backend="fake",
        disaggregation_enable_kv_checksum=True,
    )
    server_args = override.install()
    world = _World(rank, 2, list(REQUESTS), junk=3 + rank)
    parallel = {"tp_rank": rank, "pp_rank": 0, "dp_rank": 0, "attn_tp_rank": rank}
    with get_parallel().override(**parallel), get_device().override(gpu_id=0):
        sched = SimpleNamespace(
            tp_worker=SimpleNamespace(
                model_runner=SimpleNamespace(
                    effective_logical_max_total_num_tokens=PAGE * 32, kv_cache_dtype_str="auto"
                )
            ),
            kv_shard_widening=1,
            token_to_kv_pool_allocator=world.allocator,
            rust_server=None,
            model_config=SimpleNamespace(
                hf_text_config=None,
                num_hidden_layers=LAYERS,
                get_total_num_kv_heads=lambda: HEADS,
            ),
            server_args=server_args,
            req_to_token_pool=world.req_to_token,
        )
        queue = PrefillBootstrapQueue(
            token_to_kv_pool=world.pool,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
            metadata_buffers=world.metadata,
            gpu_id=0,
            bootstrap_port=8998,
            max_total_num_tokens=PAGE * 32,
            scheduler=sched,
            scheduler_stage_metrics=None,
            transfer_backend=TransferBackend.FAKE,
        )
        sched.kv_checksum_computer = world.sglang_digest()  # compute() needs CUDA
        sched.disagg_prefill_bootstrap_queue = queue
        sched.disagg_metadata_buffers = world.metadata
        sched.enable_staging = False
        sched.disagg_prefill_pending_chunk_rids = set()
        sched.attn_tp_cpu_group = group
        sched._send_kv_chunk = MethodType(SchedulerDisaggregationPrefillMixin._send_kv_chunk, sched)
        sender_class = get_kv_class(TransferBackend.FAKE, KVClassType.SENDER)
        out: dict = {"signature": queue.kv_checksum_signature, "rows": {}, "polls": {}}
        for index, rid in enumerate(REQUESTS, start=1):
            if rid == "req-ok":  # the plain request went first; now install kvaudit
                _register()
                HookRegistry.apply_hooks()
            n, prefix = REQUESTS[rid]
            row = world.rows[rid]
            sender = sender_class(queue.kv_manager, "10.0.0.1:8998", 100 + index)
            sender.init(-(-n // PAGE), aux_index=index)
            req = SimpleNamespace(
                rid=rid,
                origin_input_ids=list(range(n)),
                extend_end=n,
                disagg_decode_prefix_len=prefix,
                start_send_idx=prefix,
                kv=SimpleNamespace(req_pool_idx=row),
                metadata_buffer_index=index,
                output_ids=[1000 + index],
                cached_tokens=0,
                cached_tokens_device=0,
                cached_tokens_host=0,
                cached_tokens_storage=0,
                get_mm_token_counts=lambda: (0, 0, 0),
                return_logprob=False,
                return_sampling_mask=False,
                hidden_states_tensor=None,
                bootstrap_room=100 + index,
                disagg_kv_sender=sender,
            )
            SchedulerDisaggregationPrefillMixin.send_kv_chunk(sched, req, last_chunk=True)
            out["rows"][rid] = _aux_rows(world.metadata, index)
            out["polls"][rid] = int(sender.poll())
        out["wrapped"] = sorted(
            name
            for name in HOOKED
            if hasattr(getattr(SchedulerDisaggregationPrefillMixin, name, None), "__wrapped__")
        )
        out["stats"] = inline.inline_stats()
    override.restore()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both prefill ranks' results: SGLang's signature, every request's aux rows, the
    fake sender's poll after the send, which methods the hooks wrap, kvaudit's counts."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("prefill")
    mp.spawn(_prefill_rank, args=(str(out / "init"), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture
def hooks():
    """kvaudit's hooks installed in this process through ``HookRegistry``; the original
    methods restored afterwards."""
    saved = {
        (cls, name): cls.__dict__[name]
        for cls, name in (
            (SchedulerDisaggregationPrefillMixin, "send_kv_chunk"),
            (DecodeTransferQueue, "_commit_transfer_to_req"),
            (SchedulerDisaggregationDecodeMixin, "_verify_kv_checksums"),
        )
    }
    HookRegistry.reset()
    _register()
    HookRegistry.apply_hooks()
    inline.reset_inline_stats()
    try:
        yield
    finally:
        for (cls, name), original in saved.items():
            setattr(cls, name, original)
        HookRegistry.reset()


class _Decode:
    """A decode rank: its world (pages in another order, after other pages; the
    ``CHANGED`` cell altered on the rank that holds its head), the real
    ``DecodeTransferQueue``, and a stub scheduler as ``self`` of the real methods."""

    def __init__(self, group, patch, tp_rank: int = 0, tp_size: int = 1, page: int = PAGE) -> None:
        self.world = _World(
            tp_rank,
            tp_size,
            ["req-prefix", "HEALTH_CHECK_1", "req-bad", "req-plain", "req-ok"],
            5 + tp_rank,
            page,
        )
        rid, layer, head, token = CHANGED
        shard = self.world.shard
        if shard.first <= head < shard.first + shard.count:
            slot = int(self.world.req_to_token.req_to_token[self.world.rows[rid], token])
            self.world.pool.k_buffer[layer][slot, head - shard.first, 3] += 1.0
        kv_args = KVArgs()
        kv_args.kv_data_ptrs, _, kv_args.kv_item_lens = self.world.pool.get_contiguous_buf_infos()
        kv_args.page_size, kv_args.kv_cache_dtype_str = page, "auto"
        kv_args.state_types, kv_args.state_item_lens = [], []
        kv_args.swa_kv_cache_layout = None
        self.signature = kv_layout_signature(kv_args)
        self.aborts: list[str] = []
        self.failed = []
        self.released = []
        # release_kv_cache needs a real tree cache: recorded instead.
        patch(sglang_decode, "release_kv_cache", lambda req, *a, **k: self.released.append(req.rid))
        sched = SimpleNamespace(
            kv_checksum_computer=self.world.sglang_digest(),
            req_to_token_pool=self.world.req_to_token,
            token_to_kv_pool_allocator=self.world.allocator,
            attn_tp_cpu_group=group,
            model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HEADS),
            disagg_decode_prealloc_queue=SimpleNamespace(
                kv_checksum_signature=self.signature,
                kv_manager=SimpleNamespace(should_verify_kv_checksum=lambda addr: True),
                kv_checksum_mismatch_injector=None,
            ),
            output_streamer=SimpleNamespace(
                stream_output=lambda reqs, logprob: self.aborts.extend(r.rid for r in reqs)
            ),
            tree_cache=None,
            metrics_reporter=SimpleNamespace(enable_metrics=True),
            metrics_collector=SimpleNamespace(
                increment_transfer_failed_reqs=lambda: self.failed.append(1)
            ),
            batch_result_processor=SimpleNamespace(
                _maybe_update_reasoning_tokens=lambda req, token: None
            ),
            spec_algorithm=SimpleNamespace(is_none=lambda: True),
        )
        sched._handle_kv_checksum_mismatch = MethodType(
            SchedulerDisaggregationDecodeMixin._handle_kv_checksum_mismatch, sched
        )
        self.sched = sched
        self.queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
            metadata_buffers=self.world.metadata,
            scheduler=sched,
            tree_cache=None,
        )

    def receive(self, rid: str, prefill: list[dict], index: int):
        """The transfer of ``rid``: the aux rows of the prefill ranks in ``prefill`` (its
        senders, in order) land in slot ``index``; the real ``_commit_transfer_to_req``
        commits it, then the slot is cleared as ``pop_transferred`` does."""
        for rank in prefill:
            _receive_aux(self.world.metadata, index, rank["rows"][rid])
        n, prefix = REQUESTS[rid]
        req = SimpleNamespace(
            rid=rid,
            origin_input_ids=list(range(n)),
            bootstrap_host="10.0.0.1",
            bootstrap_port=8998,
            bootstrap_room=100 + list(REQUESTS).index(rid) + 1,  # checked against the row
            kv=SimpleNamespace(req_pool_idx=self.world.rows[rid], cache_protected_len=prefix),
            output_ids=[],
            return_logprob=False,
            return_sampling_mask=False,
            time_stats=SimpleNamespace(set_wait_queue_entry_time=lambda: None),
            expected_kv_checksum=None,
        )
        receiver = SimpleNamespace(clear=lambda: None)
        decode_req = DecodeRequest(req=req, kv_receiver=receiver, metadata_buffer_index=index)
        self.queue._commit_transfer_to_req(decode_req)
        self.world.metadata.clear_slot(index)
        assert req.output_ids == [1000 + list(REQUESTS).index(rid) + 1]  # the row arrived
        return req

    def verify(self, reqs: list) -> list:
        """The real ``_verify_kv_checksums`` on a batch of ``reqs``; the requests kept."""
        batch = SimpleNamespace(reqs=list(reqs))
        batch.filter_batch = lambda keep_indices: setattr(
            batch, "reqs", [batch.reqs[i] for i in keep_indices]
        )
        SchedulerDisaggregationDecodeMixin._verify_kv_checksums(self.sched, batch)
        return batch.reqs


@pytest.fixture
def decode(gloo_group, sglang_context, monkeypatch, hooks) -> _Decode:
    sglang_context(
        parallel={
            "tp_rank": 0,
            "attn_tp_rank": 0,
            "attn_tp_group": SimpleNamespace(cpu_group=gloo_group),
        },
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        disaggregation_enable_kv_checksum=True,
    )
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    return _Decode(gloo_group, monkeypatch.setattr)


def _expected_sum(rid: str, first: int) -> int:
    """The spec's sum over the blocks from ``first`` of the request's global KV."""
    n = REQUESTS[rid][0]
    layers = tuple(
        ref.Layer(
            NAME.format(i=layer), torch.cat(kv, dim=-1).contiguous().view(torch.uint8).numpy()
        )
        for layer, kv in _kv(rid).items()
    )
    totals = ref.total(ref.block_checksums(ref.Group(PAGE, layers), n, start=first // PAGE))
    return int(totals.sum(dtype=np.uint64))


def _words(prefill: list[dict], rid: str, rank: int = 1) -> list[int]:
    """The checksum row (the last aux buffer) a prefill rank sent for ``rid``."""
    return np.frombuffer(bytes.fromhex(prefill[rank]["rows"][rid][-1]), dtype="<u8").tolist()


def test_prefill_ranks_write_one_identical_row(prefill):
    """Both prefill ranks send the same kvaudit words (2..6) in the checksum row, the
    spec's sum among them; word 0 is SGLang's own per-rank digest (it differs)."""
    assert prefill[0]["wrapped"] == prefill[1]["wrapped"] == ["send_kv_chunk"]
    for rid in REQUESTS:
        assert _words(prefill, rid, 0)[1:] == _words(prefill, rid, 1)[1:], rid
        assert prefill[0]["polls"][rid] == prefill[1]["polls"][rid] == 4  # KVPoll.Success
    for rid in ("req-ok", "req-bad", "req-prefix"):
        n, prefix = REQUESTS[rid]
        words = _words(prefill, rid)
        assert words[inline.SLOT_MARKER] == inline.MARKER
        assert words[inline.SLOT_SUM] == _expected_sum(rid, prefix)
        assert (words[inline.SLOT_FIRST], words[inline.SLOT_END]) == (prefix, n)
        assert words[0] != 0 and words[1] == prefill[0]["signature"]  # SGLang's own digest
    assert _words(prefill, "req-plain")[2:] == [0] * 6  # no kvaudit, SGLang's digest only
    assert _words(prefill, "req-plain")[0] != 0
    assert _words(prefill, "HEALTH_CHECK_1") == [0] * 8  # SGLang and kvaudit both skip it
    assert prefill[0]["stats"]["written"] == 3 and prefill[0]["stats"]["not_written"] == 0


def test_intact_transfer_verified_where_sglang_admits_unverified(prefill, decode):
    req = decode.receive("req-ok", prefill, index=2)
    # SGLang's own check: TP=2's layout signature is not the TP=1 decode's.
    assert prefill[0]["signature"] != decode.signature
    assert decode.queue._kv_checksum_comparable(prefill[0]["signature"]) is False
    assert req.expected_kv_checksum == 0  # SGLang admits it unverified
    prefix_req = decode.receive("req-prefix", prefill, index=3)
    assert decode.verify([req, prefix_req]) == [req, prefix_req]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (2, 0, 0)
    assert decode.aborts == [] and decode.failed == []
    # Verified once: a re-entry (retraction) is not checked again.
    assert decode.verify([req]) == [req]
    assert inline.inline_stats()["verified"] == 2


def test_changed_cell_aborts_through_sglang(prefill, decode, caplog):
    ok = decode.receive("req-ok", prefill, index=2)
    bad = decode.receive("req-bad", prefill, index=4)
    with caplog.at_level("ERROR"):
        kept = decode.verify([ok, bad])
    assert kept == [ok]
    assert decode.aborts == ["req-bad"] and decode.released == ["req-bad"]
    assert decode.failed == [1]
    assert bad.finished_reason.message == "KV checksum mismatch"
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (1, 1, 0)
    expected = _expected_sum("req-bad", 0)
    (line,) = [r.message for r in caplog.records if "kvaudit KV checksum" in r.message]
    assert "req=req-bad" in line and "tokens=0..40" in line and f"{expected:#018x}" in line


def test_prefill_without_kvaudit_is_unverified(prefill, decode):
    req = decode.receive("req-plain", prefill, index=5)
    assert decode.verify([req]) == [req]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["unverified"]) == (0, 1)
    assert stats["reasons"] == {"no kvaudit checksum from the prefill": 1}


def test_health_check_skipped(prefill, decode):
    req = decode.receive("HEALTH_CHECK_1", prefill, index=6)
    assert decode.verify([req]) == [req]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["unverified"], stats["skipped"]) == (0, 0, 1)


def test_range_not_on_a_decode_block_boundary_is_unverified(prefill, decode):
    rows = [dict(rank, rows=dict(rank["rows"])) for rank in prefill]
    for rank in rows:
        words = np.frombuffer(bytes.fromhex(rank["rows"]["req-ok"][-1]), dtype="<u8").copy()
        words[inline.SLOT_FIRST] = 8  # as from a prefill with 8-token pages
        rank["rows"]["req-ok"] = [*rank["rows"]["req-ok"][:-1], words.tobytes().hex()]
    req = decode.receive("req-ok", rows, index=2)
    assert decode.verify([req]) == [req]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["unverified"]) == (0, 1)
    assert "not a block boundary" in next(iter(stats["reasons"]))


def _decode_rank(rank: int, init_file: str, out_dir: str, prefill: list[dict]) -> None:
    """One rank of a TP=2 decode with 32-token pages (a spawned process): receives
    ``req-ok`` and ``req-bad`` (whose changed cell lies on rank 1) and verifies them in
    one batch."""
    import os

    import torch.distributed as dist
    from sglang.srt.runtime_context import get_context, get_parallel

    os.environ.pop("SGLANG_IS_IN_CI", None)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")
    override = get_context().override_server_args(
        disaggregation_mode="decode",
        tp_size=2,
        disaggregation_transfer_backend="fake",
        disaggregation_enable_kv_checksum=True,
    )
    override.install()
    parallel = {
        "tp_rank": rank,
        "attn_tp_rank": rank,
        "attn_tp_group": SimpleNamespace(cpu_group=group),
    }
    with get_parallel().override(**parallel):
        _register()
        HookRegistry.apply_hooks()
        decode = _Decode(group, setattr, tp_rank=rank, tp_size=2, page=2 * PAGE)
        senders = [prefill[rank]]  # equal TP widths: decode rank d pulls prefill rank d
        ok = decode.receive("req-ok", senders, index=2)
        bad = decode.receive("req-bad", senders, index=4)
        kept = [req.rid for req in decode.verify([ok, bad])]
        out = {
            "kept": kept,
            "aborts": decode.aborts,
            "failed": decode.failed,
            "sglang_comparable": decode.queue._kv_checksum_comparable(prefill[0]["signature"]),
            "stats": inline.inline_stats(),
        }
    override.restore()
    Path(out_dir, f"decode{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_decode_at_tp2(prefill, tmp_path):
    """A TP=2 decode with 32-token pages (two processes, one gloo group): SGLang's own
    check does not compare (another page size); kvaudit verifies the intact request on
    both ranks, and the change on rank 1 aborts the other on both ranks through SGLang's
    path."""
    import torch.multiprocessing as mp

    mp.spawn(_decode_rank, args=(str(tmp_path / "init"), str(tmp_path), prefill), nprocs=2)
    for rank in range(2):
        out = json.loads((tmp_path / f"decode{rank}.json").read_text())
        assert out["kept"] == ["req-ok"] and out["aborts"] == ["req-bad"], rank
        assert out["failed"] == [1]
        assert out["sglang_comparable"] is False
        stats = out["stats"]
        assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (1, 1, 0)


def test_installed_beside_sglang_it_turns_nothing_on() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.reset()
    assert "KVAUDIT_SGLANG_INLINE" not in os.environ
    inline.register()
    assert not HookRegistry._hooks
    _register()
    assert set(HookRegistry._hooks) == {
        inline.PREFILL_TARGET,
        inline.COMMIT_TARGET,
        inline.VERIFY_TARGET,
    }
    HookRegistry.reset()


_LOAD_PLUGINS = """
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.decode import DecodeTransferQueue, SchedulerDisaggregationDecodeMixin
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
methods = (
    SchedulerDisaggregationPrefillMixin.send_kv_chunk,
    DecodeTransferQueue._commit_transfer_to_req,
    SchedulerDisaggregationDecodeMixin._verify_kv_checksums,
)
print(sum(hasattr(method, "__wrapped__") for method in methods))
"""


def test_sglang_loads_the_entry_point_and_the_variable_turns_it_on() -> None:
    # SGLang's own load_plugins(), as every scheduler process runs it, in fresh processes:
    # kvaudit's installed entry point hooks the three methods only with the variable set.
    import subprocess
    import sys

    shims = str(Path(__file__).parent / "shims")
    runs = {}
    for value in ("1", None):
        env = {k: v for k, v in os.environ.items() if k != "KVAUDIT_SGLANG_INLINE"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (shims, env.get("PYTHONPATH"))))
        if value is not None:
            env["KVAUDIT_SGLANG_INLINE"] = value
        runs[value] = subprocess.Popen(
            [sys.executable, "-c", _LOAD_PLUGINS], env=env, stdout=subprocess.PIPE, text=True
        )
    hooked = {
        value: run.communicate(timeout=300)[0].strip().splitlines()[-1]
        for value, run in runs.items()
    }
    assert hooked == {"1": "3", None: "0"}
