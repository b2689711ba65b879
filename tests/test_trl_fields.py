"""`posttrain check` without TRL, transformers or torch (issue 45, goal 1): the snapshot of
TRL's option fields is TRL's own, the verdicts judged from it are the ones building TRL's
config gives, the prompt rendered without transformers is the one its chat template
renders, and checking a config imports none of the three."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.errors import UserError
from posttrain.training import trl_fields
from posttrain.training.trl_bridge import build_trl_config, check_trl_config, _with_world_size

REPO = Path(__file__).resolve().parents[1]


def test_the_snapshot_is_the_installed_trls(tmp_path):
    """Regenerate it from TRL itself: the shipped file must equal it (else `make docs` rewrites it)."""
    shipped = json.loads(trl_fields.SNAPSHOT.read_text())
    assert shipped["trl"] == trl_fields.installed_trl(), "TRL changed: python -m posttrain.training.trl_fields"
    assert trl_fields.write_snapshot(tmp_path / "now.json") == shipped
    assert trl_fields.snapshot() is not None


def trl_verdict(cls_name: str, options: dict, world: int) -> str | None:
    import trl

    cls = getattr(trl, cls_name)
    try:
        build_trl_config(f"c.yaml: x.trl", cls if world == 1 else _with_world_size(cls, world), options,
                         output_dir="/nonexistent/posttrain-test")
    except UserError as err:
        return err.where
    return None


def fast_verdict(cls_name: str, options: dict, world: int) -> str | None:
    try:
        check_trl_config("c.yaml: x.trl", cls_name, options, world)
    except UserError as err:
        return err.where
    return None


SFT_CASES = [
    {}, {"learning_rate": 1e-4, "max_steps": 10, "lr_scheduler_type": "constant", "max_length": 64},
    {"lr_scheduler_type": "cosin"}, {"lr_scheduler_type": "cosine", "warmup_ratio": 0.1},
    {"save_strategy": "steps", "save_steps": 5, "save_total_limit": 1}, {"save_strategy": "sometimes"},
    {"save_strategy": "epoch"}, {"save_steps": 0.5}, {"learning_rate": "1e-3"}, {"learning_rate": -1.0},
    {"max_steps": 0}, {"per_device_train_batch_size": 0}, {"logging_steps": 0}, {"warmup_ratio": 1.5},
    {"bf16": True}, {"bf16": False}, {"bf16": "auto"}, {"gradient_checkpointing": "no"}, {"seed": -1},
    {"packing": True, "max_length": 128}, {"num_train_epochs": 2}, {"weight_decay": 0.01, "max_grad_norm": 0.0},
    {"learnin_rate": 0.1}, {"output_dir": "x"}, {"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6},
]
GRPO_CASES = [dict(per_device_train_batch_size=b, num_generations=g, gradient_accumulation_steps=a)
              for b, g, a in itertools.product([1, 2, 6, 8], [1, 2, 3, 4, 8], [1, 2])] + [
    {"temperature": 0.7, "max_completion_length": 16, "beta": 0.0, "learning_rate": 5e-5, "max_steps": 100},
    {"temperature": 0}, {"top_p": 1.5}, {"top_k": 0}, {"loss_type": "dapo"}, {"loss_type": "nonsense"},
    {"scale_rewards": "group"}, {"scale_rewards": False}, {"reward_weights": [1.0, 0.5]},
    {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": [1.0, 1.0]}, {"epsilon": 0.2},
    {"num_iterations": 2}, {"mask_truncated_completions": True}, {"max_completion_length": 0},
]


@pytest.mark.parametrize("cls_name,options", [("SFTConfig", o) for o in SFT_CASES] +
                         [("GRPOConfig", o) for o in GRPO_CASES])
def test_the_fast_verdict_is_trls(cls_name, options):
    """The same refusal, at the same field, or none, as building TRL's config; at 1, 2 and 3 ranks."""
    for world in (1, 2, 3) if cls_name == "GRPOConfig" else (1,):
        assert fast_verdict(cls_name, options, world) == trl_verdict(cls_name, options, world), (options, world)


def test_blocks_the_snapshot_cannot_judge_are_built_with_trl():
    """An option whose invariants are not replicated here is left to TRL: still refused."""
    assert trl_fields.fast_verdict("GRPOConfig", {"generation_batch_size": 12, "num_generations": 8}, 1) is None
    assert fast_verdict("GRPOConfig", {"generation_batch_size": 12, "num_generations": 8}, 1) == \
        trl_verdict("GRPOConfig", {"generation_batch_size": 12, "num_generations": 8}, 1) == "c.yaml: x.trl"
    assert trl_fields.fast_verdict("SFTConfig", {"save_strategy": "best"}, 1) is None


def test_a_prompt_renders_as_transformers_renders_it(tmp_path):
    """SmolLM2's shape and template kind (a system turn, special tokens in the template) and
    ChatML: the text equals apply_chat_template's; a template that refuses is left to transformers."""
    from transformers import AutoTokenizer

    from chat_model import build_chat_model
    from posttrain.chat import conversation, render_without_transformers

    folder = build_chat_model(tmp_path / "m", ["12 + 30 = 42", "You are a calculator."] * 8)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    templates = {"chatml": tokenizer.chat_template,
                 "bos": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n"
                        "{% endfor %}{% if add_generation_prompt %}{{ eos_token }}assistant:{% endif %}",
                 "tools": "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{% for m in messages %}"
                          "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"}
    tools = [{"type": "function", "function": {"name": "add", "description": "é sum", "parameters": {}}}]
    for name, template in templates.items():
        (folder / "chat_template.jinja").write_text(template)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        for system in (None, "You are a calculator. Reply with the result only."):
            messages = conversation("12 + 30", system)
            expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert render_without_transformers(folder, messages, tools) == expected, name
    (folder / "chat_template.jinja").write_text("{{ raise_exception('System role not supported') }}")
    assert render_without_transformers(folder, conversation("1 + 1", "sys"), None) is None


@pytest.mark.parametrize("config", ["configs/pipeline.yaml", "configs/sql.yaml", "chat"])
def test_check_imports_neither_trl_nor_transformers_nor_torch(tmp_path, config):
    """The work bound: `posttrain check` of the default config, the SQL config and a chat model's
    (trainable top layers, bf16: auto) loads none of the three (two seconds of CPU without them)."""
    if config == "chat":
        from chat_model import build_chat_model

        model = build_chat_model(tmp_path / "m", ["12 + 30 = 42"] * 8, layers=8)
        path = tmp_path / "c.yaml"
        path.write_text(f"extends: {REPO / 'configs/recipes/smollm2-arithmetic-headroom.yaml'}\n"
                        f"model: {{path: {model}}}\n")
        config = str(path)
    code = ("import sys; from posttrain.cli import full_check; full_check(sys.argv[1], here=True); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'trl'}))")
    done = subprocess.run([sys.executable, "-c", code, config], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
