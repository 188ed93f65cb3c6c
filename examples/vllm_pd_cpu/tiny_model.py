"""A tiny random-weight Llama saved as a Hugging Face folder, for whole vLLM engines on a
CPU: ``python tiny_model.py FOLDER`` (nothing comes from a hub).

Two layers, 4 query heads and 2 KV heads of 64, a word-level tokenizer of 1,000 words
(``w0`` .. ``w999``, one token each, split on spaces), so that a prompt's token count is
its word count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WORDS = 1000


def make_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Write the model and its tokenizer to ``folder``.

    Args:
        folder: Where the model goes (created).
        seed: The weights' seed: the same seed writes the same model.

    Returns:
        ``folder``.

    Example:
        >>> make_tiny_llama(Path("out/tiny-llama"))  # doctest: +SKIP
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {word: i for i, word in enumerate(specials + [f"w{i}" for i in range(WORDS)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    # Prompts are plain words: no chat template, and no BOS added by the server.
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["add_bos_token"] = False
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_tiny_llama(args.folder, args.seed)


if __name__ == "__main__":
    main()
