"""The local tiny model of the default path: a character tokenizer and a small
Llama-shaped model with random weights, saved as an ordinary Hugging Face folder.

Nothing here touches a model hub. Shapes are chosen so the KV-cache arithmetic is
easy to check: 4 layers x 2 KV heads x head_dim 32 = 1,024 bytes per token in bf16.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Printable ASCII covers arithmetic and SQL prompts alike, one token per character.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_model(tokenizer, *, hidden_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int, intermediate_size: int, max_positions: int, seed: int):
    """A randomly initialised `LlamaForCausalLM` sized for 2 CPU cores."""
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, max_positions=max_positions,
                         tokenizer=tokenizer)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tiny_config(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                max_positions: int, tokenizer=None):
    """The tiny model's `LlamaConfig` (the tokenizer built here when none is given)."""
    from transformers import LlamaConfig

    tokenizer = tokenizer or build_tokenizer()
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )


def save_tiny_model(out_dir: str | Path, **shape) -> int:
    """Build and save tokenizer + model to `out_dir`; returns the parameter count."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, **shape)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())
