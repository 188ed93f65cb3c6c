"""Each fault kind of P/D transfers named, with its place, in the first line of every report
form, on model-like KV with the fault planted by hand.

The KV comes from a tiny Llama-like stack written here (random weights, bf16): token
embeddings, per layer RMS norm, K with rotary position embedding and V projections, and
a residual update from a causal mean, so a layer's KV depends on the whole prefix and two
prompts sharing a prefix share its KV exactly. A TP=2 producer (NHTC, blocks of 16) and
a TP=4 consumer (KNTHD, blocks of 4) dump it (``helpers.valued_sets``); the consumer's
values are changed by hand before the dump (K and V rows exchanged, tokens moved, a head
or layer copied, one element changed). What each line must say is written from what was
planted, not from kvaudit's output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.report_forms import reports
from helpers.valued_sets import ATTN, CONSUMER, HEAD_SIZE, HEADS, PRODUCER, dump, model

LAYERS = 4
TOKENS = 77
WIDTH = 32  # the hidden size
VOCAB = 500
BF16 = model("bfloat16", layers=LAYERS)
L = [ATTN.format(i) for i in range(LAYERS)]


def rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + 1e-6)


def rotary(x: np.ndarray) -> np.ndarray:
    """Rotary position embedding of ``[tokens, heads, HEAD_SIZE]``, half-split pairs."""
    half = HEAD_SIZE // 2
    angles = np.arange(len(x))[:, None] / 10000 ** (np.arange(half) / half)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def llama_kv(tokens: list[int]) -> dict[str, np.ndarray]:
    """Each layer's KV ``[tokens, heads, K then V]`` (float32) of a prompt; the weights
    are fixed, so one prompt always gives the same KV."""
    rng = np.random.default_rng(1234)
    embed = rng.normal(0, 1, (VOCAB, WIDTH))
    hidden = embed[tokens]
    out = {}
    for name in L:
        wk, wv, wo = (rng.normal(0, WIDTH**-0.5, (WIDTH, n)) for n in (32, 32, WIDTH))
        x = rms(hidden)
        k = rotary((x @ wk).reshape(len(tokens), HEADS, HEAD_SIZE))
        v = (x @ wv).reshape(len(tokens), HEADS, HEAD_SIZE)
        out[name] = np.concatenate([k, v], axis=-1).astype(np.float32)
        context = np.cumsum(x, axis=0) / np.arange(1, len(tokens) + 1)[:, None]
        hidden = hidden + np.tanh(context @ wo)
    return out


PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, TOKENS)]
OTHER = [int(t) for t in np.random.default_rng(8).integers(0, VOCAB, 40)]


def run(tmp_path: Path, consumer: dict[str, np.ndarray], *extra: str) -> dict:
    """Every report form of the producer's clean KV against ``consumer`` for req-a."""
    values = {"req-a": llama_kv(PROMPT), "req-b": llama_kv(OTHER)}
    left = dump(tmp_path / "p", BF16, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", BF16, {**values, "req-a": consumer}, CONSUMER, "consumer")
    return reports(left, right, tmp_path / "r", *extra)


def first_line(found: dict, kind: str, title: str, text: str) -> None:
    """The fault leads every form, whole: the table's second line, the JSON's first
    finding, the page's first item, the JUnit message's first line."""
    assert found["status"] == 1
    line = f"req-a group 0: {title}: {text}"
    assert found["table"][1].startswith(line), (found["table"][1], line)
    first = found["json"]["diagnosis"][0]
    assert (first["request"], first["group"], first["kind"]) == ("req-a", 0, kind)
    assert first["text"].startswith(f"{title}: {text}")
    assert found["table"][1] == f"req-a group 0: {first['text']}"
    assert found["html"][0] == (kind, f"req-a group 0: {first['text']}")
    if "junit" in found:
        assert found["junit"][0].startswith(first["text"])
    for form in (found["table"][1], first["text"], found["html"][0][1]):
        assert " more" not in form.split(text)[0] + text


def positions(first: int, last: int) -> str:
    a, b = first // 16, last // 16
    return f"position {a}" if a == b else f"positions {a}-{b}"


def test_k_and_v_exchanged(tmp_path: Path) -> None:
    kv = llama_kv(PROMPT)
    kv[L[2]] = np.concatenate([kv[L[2]][..., HEAD_SIZE:], kv[L[2]][..., :HEAD_SIZE]], axis=-1)
    found = run(tmp_path, kv)
    text = f"{L[2]} heads 0-{HEADS - 1}, tokens 0-{TOKENS - 1} ({positions(0, TOKENS - 1)})"
    first_line(found, "kv_exchanged", "K and V exchanged", text)


@pytest.mark.parametrize(("first", "last", "shift"), [(33, 47, 1), (40, 60, 2), (20, 30, -3)])
def test_tokens_shifted(tmp_path: Path, first: int, last: int, shift: int) -> None:
    """Tokens ``first..last`` hold the producer's ``shift`` slots earlier (later where
    negative), in every layer: inside one block, across blocks, and backwards."""
    kv = llama_kv(PROMPT)
    for name in L:
        kv[name][first : last + 1] = llama_kv(PROMPT)[name][first - shift : last - shift + 1]
    found = run(tmp_path, kv)
    slots = "slot" if abs(shift) == 1 else "slots"
    text = (
        f"by {shift:+d} {slots} from token {first}: tokens {first}-{last} hold the "
        f"producer's tokens {first - shift}-{last - shift}"
    )
    first_line(found, "tokens_shifted", "tokens shifted", text)
    assert (
        f"heads 0-{HEADS - 1} of every layer at {positions(first, last)}"
        in (found["json"]["diagnosis"][0]["text"])
    )
    assert len(found["json"]["diagnosis"]) == 1


def test_a_sequence_diverging_from_a_token(tmp_path: Path) -> None:
    """Another prompt sharing the first 32 tokens: its KV equals the producer's before."""
    other = PROMPT[:32] + [(t + 1) % VOCAB for t in PROMPT[32:]]
    found = run(tmp_path, llama_kv(other))
    text = (
        f"the consumer's KV diverges from token 32: tokens 32-{TOKENS - 1} of {TOKENS} "
        "differ (every layer and head at token 32), tokens 0-31 match"
    )
    first_line(found, "diverges", "sequence diverges", text)


def test_a_head_copied_over_its_neighbour(tmp_path: Path) -> None:
    kv = llama_kv(PROMPT)
    kv[L[1]][:, 2] = kv[L[1]][:, 1]
    found = run(tmp_path, kv)
    text = f"head 1 duplicated over head 2 (head 1 intact), in {L[1]} at positions 0-4"
    first_line(found, "heads_duplicated", "head duplicated", text)


def test_two_heads_exchanged_stay_exchanged(tmp_path: Path) -> None:
    kv = llama_kv(PROMPT)
    kv[L[1]][:, [1, 2]] = kv[L[1]][:, [2, 1]]
    found = run(tmp_path, kv)
    text = f"consumer head 1 holds producer head 2, head 2 holds head 1, in {L[1]}"
    first_line(found, "heads_exchanged", "heads exchanged", text)


def test_a_layer_copied_over_another(tmp_path: Path) -> None:
    kv = llama_kv(PROMPT)
    kv[L[3]] = kv[L[0]].copy()
    found = run(tmp_path, kv)
    text = f"{L[0]} duplicated over {L[3]} ({L[0]} intact), heads 0-{HEADS - 1} at positions 0-4"
    first_line(found, "layers_duplicated", "layer duplicated", text)


def bf16(value: float) -> tuple[float, bytes]:
    """A value rounded to bf16 and its two bytes, by torch."""
    tensor = torch.tensor([value], dtype=torch.float32).to(torch.bfloat16)
    return float(tensor.to(torch.float64).item()), tensor.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("change", ["sign", "scale"])
def test_one_element_changed(tmp_path: Path, change: str) -> None:
    """V element 5 of layer 1 head 3 token 50: its sign flipped (one bit) or scaled by
    3.7 (bytes and bits as the values say); the line gives both values, exactly."""
    kv = llama_kv(PROMPT)
    before, raw_before = bf16(kv[L[1]][50, 3, HEAD_SIZE + 5])
    after, raw_after = bf16(-before if change == "sign" else before * 3.7)
    kv[L[1]][50, 3, HEAD_SIZE + 5] = after
    bits = sum(bin(x ^ y).count("1") for x, y in zip(raw_before, raw_after))
    nbytes = sum(x != y for x, y in zip(raw_before, raw_after))
    kind, title = (
        ("bit_flip", "single bit")
        if bits == 1
        else ("byte_changed", "single byte")
        if nbytes == 1
        else ("element_changed", "single element")
    )
    assert (kind == "bit_flip") == (change == "sign")
    found = run(tmp_path, kv)
    place = f"{L[1]} head 3 token 50 (position 3), "
    element = f"V element 5 (bfloat16): {before!r} -> {after!r}"
    if kind == "element_changed":
        first_line(found, kind, title, place + element)
    else:
        first_line(found, kind, title, place)
        assert found["json"]["diagnosis"][0]["text"].endswith(f": {element}")


def test_a_gap_of_three_tokens_is_no_gap_everywhere(tmp_path: Path) -> None:
    """By value, 3 tokens of 77 off in every slice: over the tolerance, no hint of
    another dtype or kernel; every token off: the hint."""
    kv = llama_kv(PROMPT)
    for name in L:
        kv[name][10:13] *= 1.5
    found = run(tmp_path, kv, "--numeric")
    first = found["json"]["diagnosis"][0]
    assert first["kind"] == "over_tolerance" and "gap everywhere" not in first["text"]
    kv = {name: values * 1.5 for name, values in llama_kv(PROMPT).items()}
    found = run(tmp_path / "all", kv, "--numeric")
    assert "a gap everywhere" in found["json"]["diagnosis"][0]["text"]
