"""`posttrain model import`: a GGUF file written here by the `gguf` package becomes a Hugging
Face folder that generates exactly what transformers' direct GGUF load generates; bad files
and folders are refused in one line with nothing left behind (issue 27)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gguf_model import write_tiny_gguf
from hardening import assert_interrupt_leaves_nothing, assert_refused, cli, state

PROMPTS = ["12 + 30 =", "What is the capital", "count the rows", "Paris", "42"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def greedy(model, tokenizer, prompts: list[str]) -> list[list[int]]:
    import torch

    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out.append(model.generate(**ids, max_new_tokens=8, do_sample=False)[0].tolist())
    return out


def test_an_imported_folder_generates_what_the_gguf_load_does(tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    done = cli("model", "import", tiny_gguf, tmp_path / "model")
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md",
            "posttrain_import.json"} <= {p.name for p in folder.iterdir()}
    direct_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    imported = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert tokenizer.chat_template == direct_tok.chat_template
    assert greedy(imported, tokenizer, PROMPTS) == greedy(direct, direct_tok, PROMPTS)
    card = json.loads((folder / "posttrain_import.json").read_text())
    import hashlib

    assert card["source_sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert card["dequantized"] is True and card["source_tensor_types"]["Q8_0"] > 0
    assert "dequantized from a quantized file" in (folder / "README.md").read_text()
    # the file's EOS is <|endoftext|>; the template ends a turn with <|im_end|>: both stop a reply
    eos = GenerationConfig.from_pretrained(folder).eos_token_id
    assert set(tokenizer.convert_ids_to_tokens(eos)) == {"<|endoftext|>", "<|im_end|>"}


def test_bf16_halves_the_weights(tiny_gguf, tmp_path):
    from safetensors import safe_open

    assert cli("model", "import", tiny_gguf, tmp_path / "bf16", "--dtype", "bf16").returncode == 0
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as fh:
        assert {str(fh.get_tensor(k).dtype) for k in fh.keys()} == {"torch.bfloat16"}


def _bad(tmp: Path, tiny: Path, case: str) -> Path:
    """The source file of one refused case."""
    if case == "not_gguf":
        (tmp / "weights.gguf").write_text("{\"not\": \"a gguf file\"}")
    elif case == "truncated":
        data = tiny.read_bytes()
        (tmp / "weights.gguf").write_bytes(data[: len(data) * 2 // 3])
    elif case == "header_cut":
        (tmp / "weights.gguf").write_bytes(tiny.read_bytes()[:200])
    elif case == "architecture":
        write_tiny_gguf(tmp / "weights.gguf", architecture="rwkv7")
    elif case == "quant_type":
        write_tiny_gguf(tmp / "weights.gguf", matrix_type="Q8_1")
    elif case == "missing":
        return tmp / "weights.gguf"
    return tmp / "weights.gguf"


@pytest.mark.parametrize("case, needles", [
    ("not_gguf", ["weights.gguf", "not a GGUF file"]),             # a JSON file named .gguf
    ("truncated", ["weights.gguf", "truncated"]),                  # a download cut at two thirds
    ("header_cut", ["weights.gguf", "a reader can trust"]),        # cut inside the metadata
    ("architecture", ["weights.gguf", "rwkv7"]),                   # an architecture transformers cannot convert
    ("quant_type", ["weights.gguf", "Q8_1"]),                      # a tensor type gguf cannot dequantize
    ("missing", ["weights.gguf", "no such file"]),                 # a path to nothing
])
def test_a_bad_source_is_refused_with_nothing_left(tiny_gguf, tmp_path, case, needles):
    src = _bad(tmp_path, tiny_gguf, case)
    before = state(tmp_path)
    done = cli("model", "import", src, tmp_path / "out")
    assert_refused(done, *needles)
    assert state(tmp_path) == before


def test_an_existing_out_dir_is_refused_untouched(tiny_gguf, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    before = state(tmp_path)
    assert_refused(cli("model", "import", tiny_gguf, tmp_path / "out"), "out", "already exists")
    assert state(tmp_path) == before


def test_an_interrupted_import_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    from posttrain.models import gguf_import

    # Ctrl-C while the weights are written
    assert_interrupt_leaves_nothing(monkeypatch, gguf_import, "model_card",
                                    lambda: gguf_import.import_gguf(tiny_gguf, tmp_path / "out"), tmp_path)


def test_fetch_of_an_unknown_model_names_the_known_ones(tmp_path):
    assert_refused(cli("model", "fetch", "gpt-5", cwd=tmp_path), "smollm2-135m-instruct")
    shutil.rmtree(tmp_path / "models", ignore_errors=True)
