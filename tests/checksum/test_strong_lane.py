"""The strong lane's detection guarantee (docs/checksum.md, "The strong lane").

Every fault of one or two changed bits in a block changes the strong lane: planted here in
the top 8 bits of every piece of one block, and as every pair of sign flips of its bf16
elements, on the real C loop and numpy path. The lane is linear in the pieces' integer
values, so a two-bit fault changes it by the sum of its two one-bit changes: the tests
measure each one-bit change with the real code, check that sum rule on real two-bit
faults, then check every pair. The seed lane misses two sign flips of bit 63 (why the
strong lane exists), and independent block ids, layouts and TP widths give equal lanes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvaudit import Checksummer
from kvaudit.core import native
from kvaudit.description import parse_description
from kvaudit.views.inputs import RequestBlocks

PRIME = 2**64 - 59
LAYERS, HEADS, TOKENS, HEAD_SIZE = 2, 2, 2, 8  # bf16: a K row and a V row of 2 pieces each
BLOCKS = 4


def description(layout: str = "NHTC", heads: int = HEADS) -> dict:
    return {
        "kvaudit": 1,
        "num_blocks": BLOCKS,
        "model_kv_heads": HEADS,
        "groups": [
            {
                "spec": {
                    "type": "full_attention",
                    "block_size": TOKENS,
                    "num_kv_heads": heads,
                    "head_size": HEAD_SIZE,
                    "dtype": "bfloat16",
                    "layout": layout,
                },
                "layers": [f"model.layers.{n}.self_attn.attn" for n in range(LAYERS)],
            }
        ],
    }


@pytest.fixture(params=["C", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both CPU paths of the lane: the C loop, and numpy without it."""
    if request.param == "C" and native.extension("kvaudit._native._strong_sums") is None:
        pytest.skip("the C extension did not build")
    if request.param == "numpy":
        monkeypatch.setenv(native.ENVIRONMENT, "0")
        monkeypatch.setattr(native, "_LOADED", {})
    return request.param


def caches(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 bits, NHTC: [blocks, heads, tokens, K and V elements]."""
    generator = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, HEADS, TOKENS, 2 * HEAD_SIZE)
    return {
        f"model.layers.{n}.self_attn.attn": torch.randint(
            -(2**15), 2**15, shape, dtype=torch.int16, generator=generator
        ).view(torch.bfloat16)
        for n in range(LAYERS)
    }


def lanes(tensors: dict[str, torch.Tensor], block: int = 1) -> tuple[int, int]:
    """(seed lane, strong lane) of request position 0 held in ``block``."""
    summer = Checksummer(parse_description(description(), "test"), tensors, backend="numpy")
    record = summer.checksum({"r": RequestBlocks(TOKENS, {0: (0, [block])})})
    group = record.requests["r"].groups[0]
    assert group.strong is not None
    return int(group.values[0, 0]), int(group.strong[0, 0])


def flip(tensors: dict[str, torch.Tensor], layer: int, index: int, bit: int) -> None:
    """Flip ``bit`` of piece ``index`` (in memory order) of block 1 of ``layer``."""
    pieces = tensors[f"model.layers.{layer}.self_attn.attn"][1].view(torch.int64).view(-1)
    pieces[index] ^= torch.tensor(1, dtype=torch.int64) << bit


PIECES_PER_LAYER = HEADS * TOKENS * 2 * HEAD_SIZE * 2 // 8
SLOTS = [(layer, index) for layer in range(LAYERS) for index in range(PIECES_PER_LAYER)]


def one_bit_changes(bits: list[int]) -> dict[tuple[int, int, int], int]:
    """Each one-bit fault's change of the strong lane, measured with the real code."""
    base = caches()
    _, strong = lanes(base)
    changes = {}
    for layer, index in SLOTS:
        for bit in bits:
            faulty = {name: tensor.clone() for name, tensor in base.items()}
            flip(faulty, layer, index, bit)
            changes[layer, index, bit] = (lanes(faulty)[1] - strong) % PRIME
    return changes


def check_pair_rule(changes: dict[tuple[int, int, int], int], pairs: list[tuple]) -> None:
    """Real two-bit faults change the lane by the sum of their one-bit changes."""
    base = caches()
    _, strong = lanes(base)
    for first, second in pairs:
        faulty = {name: tensor.clone() for name, tensor in base.items()}
        flip(faulty, *first)
        flip(faulty, *second)
        assert (lanes(faulty)[1] - strong) % PRIME == (changes[first] + changes[second]) % PRIME


def test_every_one_and_two_bit_fault_in_the_top_bits_changes_the_strong_lane(path: str) -> None:
    changes = one_bit_changes(list(range(56, 64)))
    assert len(changes) == len(SLOTS) * 8
    assert all(change != 0 for change in changes.values())
    faults = sorted(changes)
    rng = np.random.default_rng(7)
    sample = [
        tuple(faults[i] for i in rng.choice(len(faults), 2, replace=False)) for _ in range(25)
    ]
    check_pair_rule(changes, sample)
    for first, second in itertools.combinations(faults, 2):
        assert (changes[first] + changes[second]) % PRIME != 0, (first, second)


def test_every_pair_of_sign_flips_changes_the_strong_lane(path: str) -> None:
    # The sign bit of every bf16 element: bits 15, 31, 47 and 63 of each piece.
    changes = one_bit_changes([15, 31, 47, 63])
    faults = sorted(changes)
    check_pair_rule(changes, [(faults[0], faults[-1]), (faults[3], faults[7])])
    for first, second in itertools.combinations(faults, 2):
        assert (changes[first] + changes[second]) % PRIME != 0, (first, second)


def test_two_sign_flips_of_bit_63_escape_the_seed_lane_not_the_strong_one() -> None:
    base = caches()
    seed, strong = lanes(base)
    faulty = {name: tensor.clone() for name, tensor in base.items()}
    flip(faulty, 0, 3, 63)
    flip(faulty, 1, 5, 63)
    faulty_seed, faulty_strong = lanes(faulty)
    assert faulty_seed == seed  # 2**63 + 2**63 = 0 modulo 2**64, whatever the weights
    assert faulty_strong != strong


def test_the_strong_lane_ignores_block_ids_layout_and_tp_width(path: str) -> None:
    tensors = caches(3)
    _, in_block_1 = lanes(tensors, block=1)
    moved = {name: tensor[[0, 3, 2, 1]].contiguous() for name, tensor in tensors.items()}
    assert lanes(moved, block=3)[1] == in_block_1
    # KNTHD: K and V planes apart, tokens before heads.
    split = {
        name: tensor.view(BLOCKS, HEADS, TOKENS, 2, HEAD_SIZE).permute(3, 0, 2, 1, 4).contiguous()
        for name, tensor in tensors.items()
    }
    summer = Checksummer(parse_description(description("KNTHD"), "test"), split, backend="numpy")
    group = summer.checksum({"r": RequestBlocks(TOKENS, {0: (0, [1])})}).requests["r"].groups[0]
    assert group.strong is not None and int(group.strong[0, 0]) == in_block_1
    # Two TP ranks, one head each: their strong lanes add up modulo P to the whole's.
    total = 0
    for rank in range(2):
        shard = {name: tensor[:, rank : rank + 1].contiguous() for name, tensor in tensors.items()}
        summer = Checksummer(
            parse_description(description(heads=1), "test"),
            shard,
            tp_rank=rank,
            tp_size=2,
            backend="numpy",
        )
        group = summer.checksum({"r": RequestBlocks(TOKENS, {0: (0, [1])})}).requests["r"].groups[0]
        assert group.strong is not None
        total = (total + int(group.strong[0, 0])) % PRIME
    assert total == in_block_1


def test_the_seed_lane_alone_is_available() -> None:
    summer = Checksummer(
        parse_description(description(), "test"), caches(), backend="numpy", strong_lane=False
    )
    group = summer.checksum({"r": RequestBlocks(TOKENS, {0: (0, [1])})}).requests["r"].groups[0]
    assert group.strong is None
    assert int(group.values[0, 0]) == lanes(caches())[0]


def is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 primes as bases: exact below 3.3 * 10**24."""
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n < 2:
        return False
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def test_the_modulus_is_prime_and_2_is_a_primitive_root_of_it() -> None:
    # docs/checksum.md rests the two-bit guarantee on both facts.
    factors = {2: 2, 11: 1, 137: 1, 547: 1, 5594472617641: 1}
    product = 1
    for q, e in factors.items():
        assert is_prime(q)
        product *= q**e
    assert is_prime(PRIME) and product == PRIME - 1
    assert all(pow(2, (PRIME - 1) // q, PRIME) != 1 for q in factors)
    assert pow(2, (PRIME - 1) // 2, PRIME) == PRIME - 1  # so -1 = 2**((P-1)/2)
