"""The SGLang stage's own footing: the SGLang it installs, and SGLang's KV pools allocated on
the CPU with the shapes that kvaudit's description of them rests on (page 0 a padding page
that the allocator never hands out)."""

from __future__ import annotations

import sglang
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

PAGE = 16
PAGES = 4
SIZE = PAGE * PAGES


def test_sglang_version():
    assert sglang.__version__ == "0.5.23"


def test_mha_pool_on_the_cpu():
    pool = MHATokenToKVPool(
        size=SIZE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
        v_head_dim=4,
        start_layer=4,
    )
    assert pool.start_layer == 4
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    # One row per token slot, plus the padding page 0: size + page_size rows.
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        assert k.shape == (SIZE + PAGE, 2, 8) and k.dtype == torch.bfloat16
        assert v.shape == (SIZE + PAGE, 2, 4) and v.dtype == torch.bfloat16
        assert k.is_contiguous() and v.is_contiguous()
    # Global layer ids: global layer 5 is the pool's second layer.
    key, value = pool.get_kv_buffer(5)
    assert key.data_ptr() == pool.k_buffer[1].data_ptr()
    assert value.data_ptr() == pool.v_buffer[1].data_ptr()
    # What PD transfer registers (and SGLang's checksum walks): k0..k2, v0..v2, one page an item.
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.k_buffer + pool.v_buffer]
    assert item_lens == [PAGE * 2 * 8 * 2] * 3 + [PAGE * 2 * 4 * 2] * 3
    assert lens == [b.nbytes for b in pool.k_buffer + pool.v_buffer]


def test_mha_pool_with_equal_k_and_v_shares_one_allocation_per_layer():
    pool = MHATokenToKVPool(
        size=SIZE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        assert k.shape == v.shape == (SIZE + PAGE, 2, 8)
        assert v.data_ptr() - k.data_ptr() == k.nbytes


def test_mla_pool_on_the_cpu():
    pool = MLATokenToKVPool(
        size=SIZE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    assert len(pool.kv_buffer) == 2
    for buffer in pool.kv_buffer:
        # One latent row (kv_lora_rank + rope) per token slot, a head axis of 1, page 0 padding.
        assert buffer.shape == (SIZE + PAGE, 1, 16 + 8) and buffer.dtype == torch.bfloat16
    # K is the whole row, V its first kv_lora_rank values.
    assert pool.get_key_buffer(0).data_ptr() == pool.kv_buffer[0].data_ptr()
    assert pool.get_value_buffer(0).shape == (SIZE + PAGE, 1, 16)
    _, _, item_lens = pool.get_contiguous_buf_infos()
    assert item_lens == [PAGE * 24 * 2] * 2


def test_paged_allocator_never_hands_out_page_0():
    pool = MHATokenToKVPool(
        size=SIZE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(
        size=SIZE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=pool,
        need_sort=False,
    )
    assert allocator.get_kvcache() is pool
    assert allocator.available_size() == SIZE
    slots = allocator.alloc(SIZE)
    assert slots is not None
    # Every page but the padding page 0, each whole: slots page_size .. size + page_size - 1.
    assert sorted(slots.tolist()) == list(range(PAGE, SIZE + PAGE))
    assert allocator.alloc(PAGE) is None
    allocator.free(slots)
    again = allocator.alloc(SIZE)
    assert again is not None and int(again.min()) == PAGE
