"""`posttrain model import SRC.gguf OUT_DIR`: a GGUF file (Ollama's, LM Studio's, llama.cpp's)
becomes a Hugging Face model folder that transformers, TRL and vLLM load as any other.

transformers reads GGUF itself (`from_pretrained(folder, gguf_file=NAME)`, with the `gguf`
package), dequantizing every tensor; what it does not do is write the result out: a model
loaded that way is marked GGUF-quantized and `save_pretrained` refuses it. This module
checks the file before any compute (magic, a header that reads to the end, an architecture
and tensor types transformers can convert, a free OUT_DIR), loads it once, drops the marker,
and writes config, safetensors, tokenizer, chat template and a generation config whose
`eos_token_id` holds the template's end-of-turn token (so sampling stops at the end of the
assistant's turn), plus a model card naming the source file by its sha256.

The folder is written beside OUT_DIR under a temporary name and renamed into place when
complete: a failure or an interrupt leaves nothing at OUT_DIR.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from posttrain.errors import UserError

MAGIC = b"GGUF"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
CARD_FILE = "posttrain_import.json"   # the machine-readable card; README.md is the human one
UNQUANTIZED = {"F32", "F16", "BF16", "F64"}  # tensor types that hold plain floats
WHERE = "posttrain model import"


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_header(src: Path) -> dict:
    """What the GGUF file says of itself, checked: {architecture, name, license, tensor_types
    (type -> count)}. `UserError` when it is not a GGUF file, is cut short, or holds an
    architecture or a tensor type that transformers cannot convert."""
    if not src.is_file():
        raise UserError(f"{WHERE} {src}", "no such file", "pass the path of a .gguf file")
    with open(src, "rb") as fh:
        if fh.read(4) != MAGIC:
            raise UserError(f"{WHERE} {src}", "is not a GGUF file (it does not begin with the bytes GGUF)",
                            "pass a .gguf model file (llama.cpp, Ollama and LM Studio store models so)")
    from gguf import GGUFReader

    bounded(src)  # every count and offset checked before the gguf package trusts them
    try:
        reader = GGUFReader(str(src))
    except Exception as err:  # the reader's own reason: a header or tensor table cut short, a bad field
        raise UserError(f"{WHERE} {src}", f"cannot be read as GGUF ({' '.join(str(err).split())[:160]}); "
                        "the file is truncated or damaged", "download it again (compare its sha256)") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > src.stat().st_size:
        raise UserError(f"{WHERE} {src}", f"is truncated: its tensors end at byte {end:,}, the file has "
                        f"{src.stat().st_size:,}", "download it again (compare its sha256)")
    header = {"architecture": _field(reader, "general.architecture"), "name": _field(reader, "general.name"),
              "license": _field(reader, "general.license"),
              "tensor_types": dict(collections.Counter(t.tensor_type.name for t in reader.tensors))}
    _check_convertible(src, header)
    return header


def bounded(src: Path) -> None:
    """The header walked with its counts checked (posttrain.models.gguf_header): a file that
    claims more than it holds is refused before any reader sizes anything by it."""
    import math

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from posttrain.models.gguf_header import HeaderError, check_spans, read_header as walk

    def nbytes(kind: int, shape: list[int]) -> int | None:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            return None
        return math.prod(shape) // block * size

    try:
        check_spans(walk(src), nbytes)
    except HeaderError as err:
        raise UserError(f"{WHERE} {src}", f"is not a GGUF file a reader can trust: {err}",
                        "download it again (compare its sha256), or convert it again with llama.cpp") from None


def _field(reader, key: str):
    """One metadata value of the file, or None (transformers' own parser of GGUF fields)."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    values = read_field(reader, key) if key in reader.fields else []
    return values[0] if values else None


def _check_convertible(src: Path, header: dict) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the dequantizers gguf implements (transformers calls them)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = header["architecture"] or "(none)"
    plain = architecture.replace("-", "").replace("_", "")
    if not any(known.replace("_", "") == plain for known in GGUF_SUPPORTED_ARCHITECTURES):
        raise UserError(f"{WHERE} {src}", f"architecture {architecture!r} is not one transformers converts from GGUF",
                        f"use a model of a supported architecture ({', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES)[:12])}, ...)")
    readable = UNQUANTIZED | {GGMLQuantizationType(t).name for t in _type_traits}
    unreadable = sorted(set(header["tensor_types"]) - readable)
    if unreadable:
        raise UserError(f"{WHERE} {src}", f"tensor type {unreadable[0]} cannot be dequantized by the gguf package",
                        f"use a file quantized with one of {', '.join(sorted(readable - UNQUANTIZED)[:10])}, ...")


def _loaded(what: str, src: Path, load):
    """`load()`, transformers' reading of the file's tokenizer or weights: what it refuses (a
    tokenizer model it cannot build, a tensor it lacks) is one line, not its traceback."""
    try:
        return load()
    except (ValueError, KeyError, TypeError, OSError, RuntimeError, IndexError) as err:
        raise UserError(f"{WHERE} {src}", f"transformers cannot build its {what} ({type(err).__name__}: "
                        f"{' '.join(str(err).split())[:160]})",
                        "use a GGUF file of a tokenizer and architecture transformers converts") from None


def check_template(src: Path, tokenizer) -> None:
    """The file's chat template renders a conversation in transformers' sandboxed Jinja:
    UserError when it is not valid Jinja or reaches for what the sandbox forbids (Python
    objects' attributes), before anything is written."""
    if not getattr(tokenizer, "chat_template", None):
        return
    from jinja2 import TemplateError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                                      tokenize=False)
    except TemplateError as err:
        raise UserError(f"{WHERE} {src}", f"its chat template does not render ({type(err).__name__}: "
                        f"{' '.join(str(err).split())[:120]})",
                        "fix tokenizer.chat_template in the file, or import one without a template") from None


def end_of_turn_token(tokenizer) -> str | None:
    """The special token the chat template closes an assistant turn with (`<|im_end|>` for
    ChatML, `<|eot_id|>` for Llama 3), read by rendering one: None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "posttrain-end-of-turn-probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                             tokenize=False)
    except Exception:  # a template that refuses this conversation: no end-of-turn token to add
        return None
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    specials = sorted(tokenizer.all_special_tokens + [t.content for t in tokenizer.added_tokens_decoder.values()
                                                      if t.special], key=len, reverse=True)
    return next((token for token in specials if after.lstrip(" ").startswith(token)), None)


def import_gguf(src: str | Path, out_dir: str | Path, *, dtype: str = "fp32") -> dict:
    """Convert `src` into the Hugging Face folder `out_dir`; returns the card written there."""
    src, out_dir = Path(src), Path(out_dir)
    if dtype not in DTYPES:
        raise UserError(f"{WHERE} --dtype", f"{dtype!r} is not a dtype it writes", f"use one of {sorted(DTYPES)}")
    if out_dir.exists() or out_dir.is_symlink():  # a dangling link too: the rename would replace it
        raise UserError(f"{WHERE} {out_dir}", "already exists", "pass a new folder, or remove this one first")
    if not out_dir.parent.is_dir():
        raise UserError(f"{WHERE} {out_dir}", f"its parent folder {out_dir.parent} does not exist", "create it first")
    header = read_header(src)
    digest = sha256(src)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    partial.chmod(0o755)  # mkdtemp's 0700 would stay on the finished folder
    try:
        card = _convert(src, partial, dtype=dtype, header=header, digest=digest)
        os.replace(partial, out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return card


def _convert(src: Path, out: Path, *, dtype: str, header: dict, digest: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = _loaded("tokenizer", src, lambda: AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name))
    check_template(src, tokenizer)  # before the weights: a template every later stage renders
    model = _loaded("weights", src, lambda: AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=getattr(torch, DTYPES[dtype])))
    # transformers keeps the GGUF marker and refuses to save; the weights are plain tensors by now
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer, model.is_quantized = None, False
    model.config.name_or_path = model.config._name_or_path = out.name  # not the source's folder
    eot = end_of_turn_token(tokenizer)
    _stop_at(model.generation_config, [model.config.eos_token_id, tokenizer.eos_token_id,
                                       tokenizer.convert_tokens_to_ids(eot) if eot else None])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    quantized = sorted(set(header["tensor_types"]) - UNQUANTIZED)
    card = {"source_file": src.name, "source_sha256": digest, "source_bytes": src.stat().st_size,
            "dequantized": bool(quantized), "source_tensor_types": header["tensor_types"],
            "architecture": header["architecture"], "name": header["name"], "license": header["license"],
            "dtype": dtype, "parameters": sum(p.numel() for p in model.parameters()), "end_of_turn_token": eot,
            "eos_token_id": model.generation_config.eos_token_id, **_versions()}
    (out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    (out / "README.md").write_text(model_card(card))
    return card


def _stop_at(generation_config, ids: list) -> None:
    """`eos_token_id` as every distinct id that ends a reply (an int when there is one)."""
    found = []
    for value in ids + [generation_config.eos_token_id]:
        for token in (value if isinstance(value, list) else [value]):
            if isinstance(token, int) and token >= 0 and token not in found:
                found.append(token)
    generation_config.eos_token_id = found[0] if len(found) == 1 else found


def _versions() -> dict:
    from importlib.metadata import version

    return {"converted_with": {name: version(name) for name in ("transformers", "gguf", "torch")}}


def model_card(card: dict) -> str:
    """The folder's README.md: what it is, where it came from, how it was made."""
    quant = ", ".join(f"{n} {t}" for t, n in sorted(card["source_tensor_types"].items()))
    how = ("dequantized from a quantized file: its weights are the quantized values, not the original "
           "full-precision ones" if card["dequantized"] else "converted from unquantized tensors")
    tools = ", ".join(f"{k} {v}" for k, v in card["converted_with"].items())
    return (f"---\nlicense: {(card['license'] or 'unknown').lower()}\nlibrary_name: transformers\n"
            f"tags: [gguf-import, posttrain]\n---\n\n# {card['name'] or card['source_file']}\n\n"
            f"Imported with `posttrain model import` from `{card['source_file']}` "
            f"(sha256 `{card['source_sha256']}`, {card['source_bytes']:,} bytes; tensors: {quant}).\n\n"
            f"- {how}.\n- Architecture `{card['architecture']}`, {card['parameters']:,} parameters, saved in "
            f"{card['dtype']}.\n- Replies end at token id(s) {card['eos_token_id']} "
            f"(end of turn: `{card['end_of_turn_token']}`).\n- Converted with {tools}.\n")
