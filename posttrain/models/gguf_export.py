"""`posttrain model export MODEL_DIR OUT.gguf [--type f32|f16|bf16|q8_0]`: a posttrain model
folder (any Hugging Face folder of the Llama family: SmolLM2, Llama 3, Qwen2.5 shapes) as a
GGUF file that llama.cpp, Ollama and LM Studio load, with an Ollama `Modelfile` beside it.

Written with the `gguf` package as llama.cpp's own converter (`convert_hf_to_gguf.py`) writes
one: its tensor names (`gguf.get_tensor_name_map`), the query and key rows of a Llama
permuted into llama.cpp's rotary layout (transformers' GGUF reader permutes them back), the
tokenizer as a GPT-2 style BPE vocabulary with its merges, special tokens and chat template
(`gguf.SpecialVocab`), and `tokenizer.ggml.pre` found as llama.cpp finds it: by hashing the
tokenizer's ids for llama.cpp's probe text. Matrices take `--type`; norms and biases stay F32
(as llama.cpp writes them); a matrix whose rows do not split into Q8_0 blocks stays F16.

Everything that can refuse does so before a byte is written: an OUT that exists, a folder
without a model, a LoRA adapter without a merged model, an architecture, rope scaling or
tokenizer it cannot write. The file is written beside OUT under a temporary name and renamed
into place when complete.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from posttrain.models.export_checks import exportable, modelfile_path, refuse

TYPES = ("f32", "f16", "bf16", "q8_0")
# llama.cpp's probe for a BPE pre-tokenizer (convert_hf_to_gguf.py, get_vocab_base_pre): the
# sha256 of str(tokenizer.encode(PROBE)) names the pre-tokenizer llama.cpp implements for it
PROBE = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) '
         '✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
         "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
         "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",   # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",       # Qwen1.5 / 2 / 2.5
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",      # SmolLM, SmolLM2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}

# Ollama's own templates for the two chat formats the family uses; another format: Ollama
# reads the file's Jinja template itself (the Modelfile then names none)
OLLAMA_TEMPLATES = {
    "<|im_start|>": ("<|im_end|>", '{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
                     '{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}'
                     '<|im_start|>assistant\n{{ .Response }}<|im_end|>\n'),
    "<|start_header_id|>": ("<|eot_id|>", '{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n'
                            '{{ .System }}<|eot_id|>{{ end }}{{ if .Prompt }}<|start_header_id|>user'
                            '<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}<|start_header_id|>assistant'
                            '<|end_header_id|>\n\n{{ .Response }}<|eot_id|>'),
}


def export_gguf(model_dir: str | Path, out: str | Path, *, kind: str = "f16", system: str | None = None) -> dict:
    """Write `out` (GGUF) and its Modelfile from `model_dir`; returns what was written."""
    model_dir, out = Path(model_dir), Path(out)
    if kind not in TYPES:
        raise refuse("--type", f"{kind!r} is not a type it writes", f"use one of {', '.join(TYPES)}")
    modelfile = modelfile_path(out)
    for path in (out, modelfile):
        if path.exists() or path.is_symlink():
            raise refuse(path, "already exists", "pass a new file name, or remove this one first")
    if not out.parent.is_dir():
        raise refuse(out, f"its folder {out.parent} does not exist", "create it first")
    config, arch, permute, weights, word_level = exportable(model_dir)
    tokenizer = tokenizer_of(model_dir)
    partial = Path(tempfile.mkstemp(prefix=f".{out.name}.partial-", dir=out.parent)[1])
    try:
        written = _write(partial, model_dir, config, arch, permute, tokenizer, weights, kind, word_level)
        partial.chmod(0o644)  # mkstemp's 0600 would stay on the finished file
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    end = OLLAMA_TEMPLATES.get(next((m for m in OLLAMA_TEMPLATES if m in (tokenizer.chat_template or "")), ""))
    modelfile.write_text(ollama_modelfile(out.name, end, system))
    return {**written, "gguf": str(out), "modelfile": str(modelfile), "architecture": arch, "type": kind}


def tokenizer_of(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, or "default" for one it does not know."""
    digest = hashlib.sha256(str(tokenizer.encode(PROBE)).encode()).hexdigest()
    return PRE_TOKENIZERS.get(digest, "default")


def _permute(weights, heads: int):
    """llama.cpp's rotary layout of a query or key matrix (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def _write(path: Path, model_dir: Path, config: dict, arch: str, permute: bool, tokenizer, weights: list[Path],
           kind: str, word_level: bool) -> dict:
    import gguf
    import numpy as np
    from safetensors import safe_open

    heads, layers, hidden = config["num_attention_heads"], config["num_hidden_layers"], config["hidden_size"]
    kv_heads = config.get("num_key_value_heads") or heads
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(model_dir.resolve().name)
    writer.add_block_count(layers)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    head_dim = config.get("head_dim") or hidden // heads
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind])

    vocab_size = max(config.get("vocab_size", 0), len(tokenizer))
    tokens, types = _vocabulary(tokenizer, vocab_size, word_level)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    pre = pre_tokenizer(tokenizer)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=not word_level, n_vocab=vocab_size)
    if tokenizer.chat_template:
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(writer, quiet=True)
    if word_level:  # a BPE without merges (GGUF has no empty array): scores, from which
        writer.add_token_scores([0.0] * len(tokens))  # a reader derives none; llama.cpp wants merges

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2, layers)
    counts: dict[str, int] = {}
    tied = config.get("tie_word_embeddings", False)
    for file in weights:
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                if name == "lm_head.weight" and tied:
                    continue
                target = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if target is None:
                    raise refuse(model_dir, f"holds a tensor {name!r} it cannot place in a GGUF {arch} file",
                                 "export a plain causal LM of the Llama family")
                data = tensors.get_tensor(name).float().numpy()
                if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
                    data = _permute(data, heads if "q_proj" in name else kv_heads)
                qtype = _tensor_type(data, kind)
                stored = data.astype(np.float32) if qtype == gguf.GGMLQuantizationType.F32 else (
                    data.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else gguf.quants.quantize(data, qtype))
                writer.add_tensor(target, stored, raw_dtype=qtype)
                counts[qtype.name] = counts.get(qtype.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"tensors": counts, "pre_tokenizer": pre, "bytes": path.stat().st_size}


def _tensor_type(data, kind: str):
    """The type a tensor is stored in: norms and biases F32, matrices `kind` (Q8_0 needs rows in
    blocks of 32, else F16), as llama.cpp's converter chooses."""
    from gguf import GGMLQuantizationType as T

    if data.ndim < 2 or kind == "f32":
        return T.F32
    if kind == "q8_0":
        return T.Q8_0 if data.shape[-1] % 32 == 0 else T.F16
    return {"f16": T.F16, "bf16": T.BF16}[kind]


def _vocabulary(tokenizer, size: int, word_level: bool) -> tuple[list[str], list[int]]:
    """Every id's token and type as llama.cpp lists them (convert_hf_to_gguf.py, get_vocab_base);
    a character-level vocabulary's characters in GPT-2's byte-level alphabet (a space is `Ġ`)."""
    from gguf import TokenType
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    if word_level:  # every other token is one ASCII character (export_checks.tokenizer_kind checked)
        alphabet = bytes_to_unicode()
        reverse.update({i: alphabet[ord(t)] for i, t in reverse.items() if t not in added})
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        token = reverse[i]
        tokens.append(token)
        types.append(TokenType.CONTROL if i in special else TokenType.USER_DEFINED if token in added
                     else TokenType.NORMAL)
    return tokens, types



def ollama_modelfile(gguf_name: str, template: tuple[str, str] | None, system: str | None) -> str:
    """An Ollama Modelfile for the exported file beside it: `ollama create NAME -f THIS`."""
    lines = [f"# ollama create <name> -f {modelfile_path(Path(gguf_name)).name}", f"FROM ./{gguf_name}"]
    if template:
        stop, text = template
        lines += [f'TEMPLATE """{text}"""', f'PARAMETER stop "{stop}"']
    else:
        lines.append("# no TEMPLATE: Ollama reads the chat template the GGUF file holds")
    if system:
        lines.append('SYSTEM """' + system.replace('"""', '\\"\\"\\"') + '"""')
    return "\n".join(lines) + "\n"
