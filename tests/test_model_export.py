"""`posttrain model export`: a model folder (the Llama family: Llama and Qwen2 shapes built
here, random weights, a BPE tokenizer trained offline) as a GGUF file and an Ollama Modelfile.
Round trip: `model import` of the export generates what the original does, token for token, at
f32; at f16 every weight is the original's rounded to f16; q8_0 imports and generates. Bad
inputs end in one line, exit 2, nothing written (issue 46)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from chat_model import build_chat_model
from hardening import assert_interrupt_leaves_nothing, assert_refused, cli, state

TEXTS = ["12 + 30 = 42", "What is the capital of France? Paris.", "count the rows where age > 40"] * 20
PROMPTS = [f"{a} + {b}" for a, b in zip(range(10), range(30, 50, 2))] + ["What is the capital", "count the rows",
                                                                        "Paris", "42", "age > 40", "rows where",
                                                                        "France?", "12", "capital of", "the"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp(request.param) / "model", TEXTS, vocab_size=320,
                            architecture=request.param, heads=2, kv_heads=1, seed=3)


def greedy(folder: Path) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    out = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out.append(model.generate(**ids, max_new_tokens=8, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id)[0].tolist())
    return out


def weights(folder: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def round_trip(tiny: Path, tmp_path: Path, kind: str) -> Path:
    done = cli("model", "export", tiny, tmp_path / f"m-{kind}.gguf", "--type", kind, "--system", "Be brief.")
    assert done.returncode == 0, done.stderr
    assert cli("model", "import", tmp_path / f"m-{kind}.gguf", tmp_path / f"back-{kind}").returncode == 0
    return tmp_path / f"back-{kind}"


def test_f32_gives_back_the_same_model_and_replies(tiny, tmp_path):
    back = round_trip(tiny, tmp_path, "f32")
    before, after = weights(tiny), weights(back)
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)
    assert greedy(back) == greedy(tiny)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(back).chat_template == AutoTokenizer.from_pretrained(tiny).chat_template
    modelfile = (tmp_path / "m-f32.Modelfile").read_text()
    assert "FROM ./m-f32.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert '<|im_start|>user\n{{ .Prompt }}<|im_end|>' in modelfile and 'SYSTEM """Be brief."""' in modelfile


def test_f16_holds_every_matrix_rounded_to_f16_and_q8_0_loads(tiny, tmp_path):
    import torch

    before, after = weights(tiny), weights(round_trip(tiny, tmp_path, "f16"))
    for name, value in before.items():
        expected = value if value.dim() < 2 else value.to(torch.float16).float()  # norms stay f32
        assert torch.equal(after[name], expected), name
    q8 = weights(round_trip(tiny, tmp_path, "q8_0"))
    assert all((q8[k] - before[k]).abs().max() <= before[k].abs().max() / 100 for k in before)  # 8-bit blocks


def test_the_written_file_names_its_tokenizer_as_llama_cpp_reads_it(tiny, tmp_path):
    from gguf import GGUFReader

    assert cli("model", "export", tiny, tmp_path / "m.gguf").returncode == 0
    reader = GGUFReader(tmp_path / "m.gguf")
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.t")}
    assert fields["general.architecture"] in ("llama", "qwen2") and fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "default"  # a tokenizer llama.cpp does not know by its probe
    assert "<|im_start|>" in fields["tokenizer.chat_template"] and fields["general.file_type"] == 1  # MOSTLY_F16
    assert len(fields["tokenizer.ggml.merges"]) > 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial file left


def _bad(tmp: Path, tiny: Path, case: str) -> Path:
    folder = tmp / "model"
    if case != "missing":
        shutil.copytree(tiny, folder)
    config = json.loads((tiny / "config.json").read_text())
    if case == "gpt2":
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    elif case == "adapter":
        for p in folder.iterdir():
            p.unlink()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        (folder / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    elif case == "rope":
        (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8}}))
    elif case == "sentencepiece":
        (folder / "tokenizer.json").unlink()
    elif case == "not_json":
        (folder / "config.json").write_text("{not json")
    return folder


@pytest.mark.parametrize("case, needles", [
    ("gpt2", ["model", "GPT2LMHeadModel", "LlamaForCausalLM"]),   # an architecture it does not write
    ("adapter", ["model", "LoRA adapter", "merge"]),              # an adapter without a merged model
    ("rope", ["model", "llama3", "rope scaling"]),                # rope scaling it does not write yet
    ("sentencepiece", ["model", "BPE tokenizer"]),                # no tokenizer.json
    ("not_json", ["config.json", "not JSON"]),
    ("missing", ["model", "is not a folder"]),
])
def test_a_bad_model_folder_is_refused_with_nothing_written(tiny, tmp_path, case, needles):
    folder = _bad(tmp_path, tiny, case)
    before = state(tmp_path)
    assert_refused(cli("model", "export", folder, tmp_path / "m.gguf"), *needles)
    assert state(tmp_path) == before


@pytest.mark.parametrize("existing", ["m.gguf", "m.Modelfile"])
def test_an_existing_out_or_modelfile_is_refused_untouched(tiny, tmp_path, existing):
    (tmp_path / existing).write_text("mine")
    before = state(tmp_path)
    assert_refused(cli("model", "export", tiny, tmp_path / "m.gguf"), existing, "already exists")
    assert_refused(cli("model", "export", tiny, tmp_path / "no" / "m.gguf"), "does not exist")
    assert state(tmp_path) == before


def test_an_interrupted_export_leaves_nothing(tiny, tmp_path, monkeypatch):
    from posttrain.models import gguf_export

    # Ctrl-C while the tensors are written
    assert_interrupt_leaves_nothing(monkeypatch, gguf_export, "_tensor_type",
                                    lambda: gguf_export.export_gguf(tiny, tmp_path / "m.gguf"), tmp_path)


@pytest.fixture(scope="module")
def tiny_default(tmp_path_factory) -> Path:
    """The default pipeline's tiny model: a Llama with a character-level tokenizer, no chat template."""
    from posttrain.training.tiny_model import build_model, build_tokenizer

    folder = tmp_path_factory.mktemp("default") / "model"
    tokenizer = build_tokenizer()
    build_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                max_positions=64, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_default_tiny_model_round_trips(tiny_default, tmp_path):
    """Its characters as a BPE without merges: the same ids for every prompt, the same replies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    back = round_trip(tiny_default, tmp_path, "f32")
    before, after = weights(tiny_default), weights(back)
    assert all(torch.equal(before[k], after[k]) for k in before)
    tokenizers = [AutoTokenizer.from_pretrained(f) for f in (tiny_default, back)]
    models = [AutoModelForCausalLM.from_pretrained(f) for f in (tiny_default, back)]
    for prompt in PROMPTS + ["SELECT name FROM emp WHERE age > 40;\n", "  two  spaces ~"]:
        ids = [t(prompt, return_tensors="pt")["input_ids"] for t in tokenizers]
        assert torch.equal(ids[0], ids[1]), prompt
        replies = [m.generate(ids[0], max_new_tokens=8, do_sample=False) for m in models]
        assert torch.equal(replies[0], replies[1]), prompt
    assert "no TEMPLATE" in (tmp_path / "m-f32.Modelfile").read_text()  # no chat template to translate


def test_a_new_champion_is_logged_as_gguf_with_its_version(tiny_default, tmp_path, monkeypatch):
    """`promotion.export: gguf`: the champion's registered version holds gguf/NAME-vN.gguf and its
    Modelfile (with the config's system prompt); a challenger is not exported."""
    from mlflow import MlflowClient

    from conftest import REPO
    from posttrain.config import PipelineConfig, read_config_dict
    from posttrain.tracking.promotion import promote

    raw = read_config_dict(REPO / "configs" / "pipeline.yaml")
    raw["promotion"] = {**raw.get("promotion", {}), "export": "gguf", "export_type": "q8_0",
                        "require_significance": False}
    raw["data"]["options"] = {**raw["data"].get("options", {}), "system": "Add."}
    config = PipelineConfig.model_validate(raw)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    import mlflow

    # another store set globally (an earlier test's, a user's session): promote writes to `uri` alone
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", f"sqlite:///{tmp_path / 'other.db'}")
    client = MlflowClient(uri)
    experiment = client.create_experiment("export", artifact_location=(tmp_path / "artifacts").as_uri())
    other = mlflow.get_tracking_uri()
    found = []
    for value in (0.5, 0.4):
        run = client.create_run(experiment)
        found.append(promote(config, run.info.run_id, str(tiny_default), {config.promotion.metric: value}, {},
                             tracking_uri=uri))
        client.set_terminated(run.info.run_id)
    assert [p.alias for p in found] == ["champion", "challenger"]
    assert mlflow.get_tracking_uri() == other and not (tmp_path / "other.db").exists()  # left as it was, unused
    champion, challenger = (client.get_model_version(config.promotion.model_name, p.version) for p in found)
    assert champion.tags["posttrain.gguf"] == "gguf/posttrain-v1.gguf" and "posttrain.gguf" not in challenger.tags
    model_id, = [m.model_id for m in client.search_logged_models([experiment])
                 if m.source_run_id == champion.run_id]
    names = {Path(f.path).name for f in client.list_logged_model_artifacts(model_id, "gguf")}
    assert names == {"posttrain-v1.gguf", "posttrain-v1.Modelfile"}
    from urllib.parse import urlparse

    folder = Path(urlparse(client.get_logged_model(model_id).artifact_location).path) / "gguf"
    assert 'SYSTEM """Add."""' in (folder / "posttrain-v1.Modelfile").read_text()
    assert (folder / "posttrain-v1.gguf").read_bytes()[:4] == b"GGUF"


def test_check_refuses_an_export_the_model_cannot_take(tiny, tmp_path):
    """`promotion.export: gguf` with a model the export cannot write: refused by check, before training."""
    import yaml

    from conftest import REPO

    folder = _bad(tmp_path, tiny, "gpt2")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "model": {"path": str(folder)},
                                      "promotion": {"export": "gguf"}}))
    assert_refused(cli("check", "--config", config), "promotion.export", "GPT2LMHeadModel", "promotion.export: off")
