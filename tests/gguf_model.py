"""A small GGUF file written here with the `gguf` package, as llama.cpp writes one: a Llama
of a few layers (random weights, the matrices quantized), a byte-level BPE tokenizer trained
with `tokenizers` on a few sentences, ChatML special tokens and template. Its end-of-turn
token (`<|im_end|>`) is deliberately not its EOS (`<|endoftext|>`), as in many base models'
files, so an import must find it in the template."""

from __future__ import annotations

import json
from pathlib import Path

from chat_model import CHATML, SPECIAL

TEXTS = ["12 + 30 = 42", "What is the capital of France? Paris.", "count the rows where age > 40"] * 20


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    spec = json.loads(core.to_str())["model"]
    tokens = [token for token, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    return tokens, merges


def write_tiny_gguf(path: Path, *, architecture: str = "llama", matrix_type: str = "Q8_0", hidden: int = 64,
                    layers: int = 2, heads: int = 2, kv_heads: int = 1, seed: int = 0,
                    chat_template: str = CHATML, tokenizer_model: str = "gpt2") -> Path:
    """Write the file; matrices in `matrix_type` (a GGMLQuantizationType name), norms in F32."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    tokens, merges = _tokenizer()
    ids = {token: tokens.index(token) for token in SPECIAL}
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny-test-model")
    writer.add_license("apache-2.0")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in SPECIAL else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ids["<|endoftext|>"])
    writer.add_eos_token_id(ids["<|endoftext|>"])
    writer.add_pad_token_id(ids["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[matrix_type]

    def matrix(name, rows, cols):
        data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype) if qtype.name not in ("F32", "Q8_1") \
            else writer.add_tensor(name, data if qtype.name == "F32" else _raw(data, qtype), raw_dtype=qtype)

    head_dim = hidden // heads
    matrix("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        matrix(f"blk.{i}.ffn_gate.weight", 2 * hidden, hidden)
        matrix(f"blk.{i}.ffn_up.weight", 2 * hidden, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, 2 * hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _raw(data, qtype):
    """Bytes of the right size for a type the gguf package cannot quantize (their values do not
    matter: an import must refuse the type before reading them)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = data.shape
    return np.zeros((rows, cols // block * size), np.uint8)
