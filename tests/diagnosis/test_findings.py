"""The diagnosis's rules on located entries built by hand: each kind named from the
evidence that defines it, each entry explained once, the most specific finding first.
The same rules over real faults (injected as they happen, then diffed) are checked in
``tests/compare/test_fault_corpus.py`` and ``tests/cli/test_diff_cli.py``."""

from __future__ import annotations

import dataclasses

import pytest

from kvaudit.compare import GroupComparison, StaleSource, TokenRun, TokenShift
from kvaudit.diagnosis import diagnose_group, layer_text
from kvaudit.locate import ElementChange, LocatedDifference

L = "model.layers.{}.self_attn.attn"


def entry(position: int, layer: int, head: int, tokens: list[int], **fields) -> LocatedDifference:
    values = {"max_abs_error": 1.0, "max_rel_error": 1.0, "scaled_error": 0.5}
    values |= fields
    return LocatedDifference(
        position=position,
        layer=L.format(layer),
        head=head,
        tokens=tokens,
        first_byte=0,
        differing_bytes=fields.pop("differing_bytes", 40),
        differing_bits=fields.pop("differing_bits", 90),
        **{k: v for k, v in values.items() if k not in ("differing_bytes", "differing_bits")},
    )


def group(located: list[LocatedDifference], compared: int = 8, **fields) -> GroupComparison:
    positions = sorted({item.position for item in located if not item.replica})
    return GroupComparison(
        compared=compared,
        mismatched_positions=fields.pop("mismatched", positions),
        located=located,
        block_size=16,
        **fields,
    )


def kinds(found) -> list[str]:
    return [finding.kind for finding in found]


def test_a_head_swap_reads_as_one_line() -> None:
    located = [
        entry(p, layer, head, list(range(16 * p, 16 * p + 16)), holds=(L.format(layer), other))
        for p in range(3)
        for layer in range(4)
        for head, other in ((1, 5), (5, 1))
    ]
    found = diagnose_group(group(located), 48)
    assert kinds(found) == ["heads_exchanged"]
    assert found[0].located == len(located) == 24
    assert found[0].text == (
        "consumer head 1 holds producer head 5, head 5 holds head 1, in "
        "model.layers.{0-3}.self_attn.attn at positions 0-2"
    )


def test_layers_and_slices_exchanged_apart_from_heads() -> None:
    located = [
        entry(0, 1, 2, list(range(16)), holds=(L.format(2), 2)),
        entry(0, 2, 2, list(range(16)), holds=(L.format(1), 2)),
        entry(1, 3, 0, list(range(16, 32)), holds=(L.format(0), 7)),
    ]
    found = diagnose_group(group(located), 40)
    assert kinds(found) == ["layers_exchanged", "slices_exchanged"]
    assert "consumer model.layers.1.self_attn.attn holds producer model.layers.2" in found[0].text
    assert f"consumer {L.format(3)} head 0 holds producer {L.format(0)} head 7" in found[1].text


def test_a_stale_block_names_its_source_and_worker() -> None:
    located = [
        entry(4, layer, head, list(range(64, 80)), consumer_worker=(1, 0))
        for layer in range(4)
        for head in (2, 3)
    ]
    stale = {4: [StaleSource("req-short", 0, 0)]}
    found = diagnose_group(group(located, stale_sources=stale), 100)
    assert kinds(found) == ["stale_block"]
    assert found[0].text.startswith("position 4 (tokens 64-79) holds req-short position 0 (")
    assert "heads 2-3 of model.layers.{0-3}.self_attn.attn, consumer worker tp 1 pp 0" in (
        found[0].text
    )


def test_tokens_of_another_request_and_untraced_tokens() -> None:
    foreign = [entry(1, layer, 0, list(range(16, 22))) for layer in range(2)]
    untraced = [entry(3, layer, 0, list(range(50, 53))) for layer in range(2)]
    runs = [
        TokenRun(1, 16, 6, (("req-b", 16),)),
        TokenRun(3, 50, 3, ()),
    ]
    stale = {1: [], 3: []}
    found = diagnose_group(group(foreign + untraced, stale_sources=stale, token_runs=runs), 100)
    assert kinds(found) == ["foreign_tokens", "untraced"]
    assert found[0].text.startswith("tokens 16-21 (position 1) hold req-b tokens 16-21")
    assert found[1].text.startswith("tokens 50-52 (position 3) differ in head 0")
    assert found[1].text.endswith("no producer slice holds these bytes")
    assert [f.located for f in found] == [2, 2]


@pytest.mark.parametrize("looked_for", [True, False])
def test_untraced_names_only_the_tokens_of_the_entries_it_explains(looked_for: bool) -> None:
    """Head 0's tokens 33-34 are found nowhere; head 1's token 40 holds a NaN (its own
    finding), its run traced or not: neither is head 0's."""
    located = [entry(2, 0, 0, [33, 34]), entry(2, 0, 1, [40], nonfinite=1)]
    runs = [TokenRun(2, 33, 2, ()), TokenRun(2, 40, 1, (), traced=looked_for)]
    found = diagnose_group(group(located, stale_sources={2: []}, token_runs=runs), 64)
    assert kinds(found) == ["nonfinite", "untraced"]
    assert "token 40 (position 2) in head 1 of " in found[0].text
    assert found[1].text == (
        f"tokens 33-34 (position 2) differ in head 0 of {L.format(0)}; "
        "no producer slice holds these bytes"
    )
    assert found[1].tokens == (33, 34)


def test_untraced_counts_the_runs_of_its_tokens_not_looked_for() -> None:
    located = [entry(2, 0, 0, [33, 34]), entry(3, 0, 0, [50])]
    runs = [TokenRun(2, 33, 2, (), traced=False), TokenRun(3, 50, 1, ())]
    found = diagnose_group(group(located, stale_sources={2: [], 3: []}, token_runs=runs), 64)
    assert kinds(found) == ["untraced"]
    assert found[0].text == (
        f"tokens 33-34 (position 2), token 50 (position 3) differ in head 0 of {L.format(0)}; "
        "no producer slice holds these bytes (1 more runs of tokens were not looked for)"
    )


def test_zeros_are_never_a_stale_source() -> None:
    """A tail never written holds zeros, which a padding request's block holds too: the
    trace's match says nothing of a reused slot; the tail is what the entries show."""
    located = [entry(3, layer, 0, list(range(48, 64)), consumer_zeros=True) for layer in (0, 1)]
    stale = {3: [StaleSource("pad", 0, 0)]}
    found = diagnose_group(group(located, compared=4, stale_sources=stale), 64)
    assert kinds(found) == ["tail_not_written"]
    assert found[0].text.startswith("tokens 48-63 of 64 differ in head 0 of ")
    assert "and hold zeros" in found[0].text and "pad" not in found[0].text
    # Zeros in one slice, other bytes in another: the match is evidence.
    located[1] = entry(3, 1, 0, list(range(48, 64)))
    found = diagnose_group(group(located, compared=4, stale_sources=stale), 64)
    assert kinds(found) == ["stale_block"]
    assert found[0].text.startswith("position 3 (tokens 48-63) holds pad position 0 (")


def test_a_tail_is_the_request_end_in_every_slice() -> None:
    # Tokens 85-99 of 100 differ in each of 3 slices: positions 5 and 6.
    located = [
        entry(p, layer, 0, [t for t in range(85, 100) if t // 16 == p], consumer_zeros=True)
        for p in (5, 6)
        for layer in range(3)
    ]
    found = diagnose_group(group(located, compared=7), 100)
    assert kinds(found) == ["tail_not_written"]
    assert found[0].text.startswith("tokens 85-99 of 100 differ in head 0 of ")
    assert "and hold zeros" in found[0].text and "past token 84" in found[0].text


def test_not_a_tail_when_a_slice_stops_short_or_every_block_differs() -> None:
    short = [entry(5, 0, 0, list(range(85, 96))), entry(6, 0, 0, list(range(96, 99)))]
    short += [entry(5, 1, 0, list(range(85, 96))), entry(6, 1, 0, list(range(96, 100)))]
    assert "tail_not_written" not in kinds(diagnose_group(group(short, compared=7), 100))
    # Both compared blocks differ from token 8 on: nothing was right before a tail.
    late = [
        entry(p, layer, 0, list(range(max(8, 16 * p), 16 * p + 16)))
        for p in (0, 1)
        for layer in (0, 1)
    ]
    assert "tail_not_written" not in kinds(diagnose_group(group(late, compared=2), 32))
    assert "tail_not_written" in kinds(diagnose_group(group(late, compared=3), 32))


def test_single_bit_and_byte_zeros_and_nan() -> None:
    located = [
        entry(0, 0, 1, [3], differing_bytes=1, differing_bits=1),
        entry(0, 1, 1, [5], differing_bytes=1, differing_bits=3),
        entry(1, 2, 0, list(range(16, 32)), consumer_zeros=True),
        entry(2, 3, 0, [40, 41], nonfinite=2),
    ]
    found = diagnose_group(group(located, compared=8), 128)
    assert kinds(found) == ["nonfinite", "zeros", "bit_flip", "byte_changed"]
    assert found[0].text.startswith("2 consumer elements are NaN or infinite")
    assert found[1].text.startswith("the consumer holds zeros at tokens 16-31 (position 1)")
    assert (
        found[2].text == f"{L.format(0)} head 1 token 3 (position 0), one bit of byte 0 of its cell"
    )
    assert found[3].text.startswith(f"{L.format(1)} head 1 token 5 (position 0), byte 0")


def test_small_differences_everywhere_read_as_another_dtype() -> None:
    located = [
        entry(p, layer, head, list(range(16 * p, 16 * p + 16)), scaled_error=0.004)
        for p in range(4)
        for layer in range(2)
        for head in range(2)
    ]
    found = diagnose_group(group(located, stale_sources={p: [] for p in range(4)}), 64)
    assert kinds(found) == ["drift"]
    assert "differ by at most 0.004 of their largest value" in found[0].text
    assert "--numeric" in found[0].text
    # One large error among them: not drift.
    located[5] = entry(1, 0, 1, list(range(16, 32)), scaled_error=0.9)
    assert "drift" not in kinds(diagnose_group(group(located), 64))


def test_replicas_and_unlocated_blocks() -> None:
    located = [entry(2, 0, 0, [33], replica=3, differing_bytes=1, differing_bits=1)]
    g = group(located, mismatched=[2, 5], replica_mismatches=[(2, 4, 3)])
    found = diagnose_group(g, 100)
    assert kinds(found) == ["replica_differs", "differs"]
    assert found[0].text.startswith(
        "consumer replicas 4:3 differ from their replica 0 at position 2"
    )
    assert found[0].text.endswith("one bit of byte 0 of token 33's cell")
    assert found[1].text == "blocks at positions 2, 5 differ (not located)"
    assert sum(f.located for f in found) == 1


def test_each_entry_is_explained_once() -> None:
    located = [
        entry(0, 0, 0, list(range(16)), holds=(L.format(0), 1)),
        entry(1, 0, 0, list(range(16, 32)), consumer_zeros=True),
        entry(2, 0, 0, [40], differing_bytes=1, differing_bits=1),
        entry(3, 0, 0, [50, 51]),
    ]
    found = diagnose_group(group(located), 64)
    assert kinds(found) == ["heads_duplicated", "zeros", "bit_flip", "differs"]
    assert [f.positions for f in found] == [(0,), (1,), (2,), (3,)]
    assert sum(f.located for f in found) == len(located)


def test_layer_text() -> None:
    assert layer_text([L.format(i) for i in (0, 1, 2, 3)]) == "model.layers.{0-3}.self_attn.attn"
    assert layer_text([L.format(i) for i in (0, 2)]) == "model.layers.{0, 2}.self_attn.attn"
    assert layer_text([L.format(1)]) == L.format(1)
    every = [L.format(i) for i in range(4)]
    assert layer_text(every, every) == "every layer"
    assert layer_text(["a", "b", "c"]) == "a, b and 1 more layers"


def test_a_sequence_diverges_only_where_every_slice_differs_at_its_first_token() -> None:
    # Tokens 20-39 of 40 differ in both heads of both layers, values of KV's scale.
    every = [entry(p, layer, head, [t for t in range(20, 40) if t // 16 == p])
             for p in (1, 2) for layer in (0, 1) for head in (0, 1)]  # fmt: skip
    layers = [L.format(0), L.format(1)]
    found = diagnose_group(group(every, compared=3, layers=layers, heads=2), 40)
    assert kinds(found) == ["diverges"]
    assert found[0].text.startswith("the consumer's KV diverges from token 20: tokens 20-39 of 40")
    assert found[0].located == len(every)
    # One head short at token 20: not a divergence (a sender of one rank: the tail).
    assert "diverges" not in kinds(diagnose_group(group(every[1:], 3, layers=layers, heads=2), 40))
    # Zeros: never written, the tail; junk far beyond the values around it: not KV.
    zeros = [dataclasses.replace(item, consumer_zeros=True) for item in every]
    assert kinds(diagnose_group(group(zeros, 3, layers=layers, heads=2), 40)) == [
        "tail_not_written"
    ]
    junk = [dataclasses.replace(item, scaled_error=1e30) for item in every]
    assert "diverges" not in kinds(diagnose_group(group(junk, 3, layers=layers, heads=2), 40))


def test_a_copied_head_is_duplicated_and_a_swapped_pair_exchanged() -> None:
    copied = [entry(p, 0, 2, list(range(16 * p, 16 * p + 16)), holds=(L.format(0), 1))
              for p in range(2)]  # fmt: skip
    found = diagnose_group(group(copied), 32)
    assert kinds(found) == ["heads_duplicated"]
    assert (
        found[0].text
        == f"head 1 duplicated over head 2 (head 1 intact), in {L.format(0)} at positions 0-1"
    )
    copied_layer = [entry(0, 3, h, list(range(16)), holds=(L.format(0), h)) for h in (0, 1)]
    found = diagnose_group(group(copied_layer), 16)
    assert kinds(found) == ["layers_duplicated"]
    assert found[0].text.startswith(f"{L.format(0)} duplicated over {L.format(3)} (")


def test_shifted_tokens_and_kv_exchanged_are_named_before_the_trace() -> None:
    moved = [entry(2, layer, 0, list(range(32, 48))) for layer in (0, 1)]
    shifts = [TokenShift(33, 47, 1, ((L.format(0), 0), (L.format(1), 0)), (32,))]
    found = diagnose_group(group(moved, stale_sources={2: []}, token_shifts=shifts), 64)
    assert kinds(found) == ["tokens_shifted"]
    assert found[0].text == (
        "by +1 slot from token 33: tokens 33-47 hold the producer's tokens 32-46 (token 32 "
        f"of the same blocks holds other bytes), in head 0 of {L.format('{0-1}')} at position 2"
    )
    swapped = [entry(p, 1, h, list(range(16 * p, 16 * p + 16)), kv_exchanged=True)
               for p in range(2) for h in range(4)]  # fmt: skip
    found = diagnose_group(group(swapped, stale_sources={0: [], 1: []}), 32)
    assert kinds(found) == ["kv_exchanged"]
    assert found[0].text.startswith(f"{L.format(1)} heads 0-3, tokens 0-31 (positions 0-1): ")


def test_one_element_named_with_its_values() -> None:
    change = ElementChange("V", 5, "bfloat16", 0.125, -0.125)
    located = [
        entry(0, 0, 1, [3], differing_bytes=1, differing_bits=1, element=change),
        entry(0, 1, 1, [5], differing_bytes=2, differing_bits=5, element=change),
    ]
    found = diagnose_group(group(located, stale_sources={0: []}), 16)
    assert kinds(found) == ["bit_flip", "element_changed"]
    assert found[0].text.endswith(
        "one bit of byte 0 of its cell: V element 5 (bfloat16): 0.125 -> -0.125"
    )
    assert (
        found[1].text
        == f"{L.format(1)} head 1 token 5 (position 0), V element 5 (bfloat16): 0.125 -> -0.125"
    )


def test_untraced_tokens_across_blocks_are_one_place() -> None:
    located = [entry(p, 0, 0, list(range(16 * p, 16 * p + 16))) for p in range(6)]
    found = diagnose_group(group(located, stale_sources={p: [] for p in range(6)}), 96)
    assert found[0].text.startswith("tokens 0-95 (positions 0-5) differ in head 0 of ")
