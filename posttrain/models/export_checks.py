"""What `posttrain model export` reads of a model folder, checked without transformers or
torch: its config, an architecture the GGUF export writes, safetensors weights (not a LoRA
adapter alone), a tokenizer GGUF's GPT-2 vocabulary holds. `posttrain check` runs the same
checks for `promotion.export: gguf` (posttrain.preflight), before any training; the writer
(posttrain.models.gguf_export) stays out of the stages' imports."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.errors import UserError

WHERE = "posttrain model export"
# transformers' class -> GGUF architecture, and whether llama.cpp permutes its q/k rows
ARCHITECTURES = {"LlamaForCausalLM": ("llama", True), "Qwen2ForCausalLM": ("qwen2", False)}


def refuse(what, problem: str, fix: str):
    return UserError(f"{WHERE} {what}", problem, fix)


def exportable(model_dir: Path) -> tuple[dict, str, bool, list[Path], bool]:
    """What the export reads of the folder, checked without transformers (its config, the
    architecture, the weights, the tokenizer's kind): UserError naming what it cannot write.
    The last value: whether the vocabulary is character-level (`tokenizer_kind`)."""
    config = model_config(model_dir)
    arch, permute = architecture(model_dir, config)
    weights = weight_files(model_dir)
    return config, arch, permute, weights, tokenizer_kind(model_dir) == "WordLevel"


def modelfile_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}.Modelfile")


def model_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise refuse(model_dir, "is not a folder", "pass a model folder (e.g. artifacts/models/grpo in a workspace)")
    path = model_dir / "config.json"
    if not path.is_file():
        if (model_dir / "adapter_config.json").is_file():
            raise refuse(model_dir, "holds a LoRA adapter without a merged model",
                         "merge it first (peft's merge_and_unload, then save_pretrained) and export that folder")
        raise refuse(model_dir, "has no config.json", "pass a Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise refuse(path, f"is not JSON ({err})", "pass a Hugging Face model folder") from None
    if not isinstance(config, dict):
        raise refuse(path, "is not a JSON object", "pass a Hugging Face model folder")
    return config


def architecture(model_dir: Path, config: dict) -> tuple[str, bool]:
    names = config.get("architectures") or []
    name = next((n for n in names if n in ARCHITECTURES), None)
    if name is None:
        raise refuse(model_dir, f"is a {', '.join(map(str, names)) or 'model of no named architecture'}, "
                     "which it does not write", f"export a model of {', '.join(sorted(ARCHITECTURES))}")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise refuse(model_dir, f"uses {rope.get('rope_type', rope.get('type'))!r} rope scaling, which it does not "
                     "write yet", "export a model without rope scaling, or use llama.cpp's convert_hf_to_gguf.py")
    return ARCHITECTURES[name]


def tokenizer_kind(model_dir: Path) -> str:
    """`BPE`, or `WordLevel` for a character-level ASCII vocabulary (posttrain's tiny model:
    written as a BPE without merges, which splits text into the same characters); UserError
    for a tokenizer GGUF's GPT-2 vocabulary cannot hold."""
    spec = model_dir / "tokenizer.json"
    try:
        found = json.loads(spec.read_text()) if spec.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        found = {}
    model = found.get("model") if isinstance(found, dict) else None
    kind = model.get("type") if isinstance(model, dict) else None
    if kind not in ("BPE", "WordLevel"):
        raise refuse(model_dir, "has no byte-level BPE tokenizer.json (GPT-2 style)",
                     "export a model with a BPE tokenizer (SmolLM2, Llama 3, Qwen2.5); SentencePiece is not written")
    added = {t.get("content") for t in found.get("added_tokens") or [] if isinstance(t, dict)}
    if kind == "WordLevel" and not all(isinstance(t, str) and (t in added or (len(t) == 1 and ord(t) < 128))
                                       for t in model.get("vocab") or {}):
        raise refuse(model_dir, "has a word-level tokenizer.json, which GGUF's vocabularies do not hold",
                     "export a model with a byte-level BPE tokenizer or a character-level ASCII one")
    return kind


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files or all(f.name.startswith("adapter_model") for f in files):
        what = "holds a LoRA adapter without a merged model" if (model_dir / "adapter_config.json").is_file() \
            else "has no safetensors weights"
        raise refuse(model_dir, what, "merge and save the model (save_pretrained, safetensors) and export that folder")
    return [f for f in files if not f.name.startswith("adapter_model")]
