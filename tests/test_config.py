"""The config schema: every shipped YAML loads; bad input is one clear line."""

from pathlib import Path

import pytest
import yaml

from posttrain.config import load_config
from posttrain.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PIPELINES = [p for p in sorted(CONFIGS.glob("*.yaml")) if p.name != "gpus.yaml"]


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)


def write(tmp_path, text: str) -> Path:
    (tmp_path / "pipeline.yaml").write_text((CONFIGS / "pipeline.yaml").read_text())
    (tmp_path / "gpus.yaml").write_text((CONFIGS / "gpus.yaml").read_text())
    path = tmp_path / "variant.yaml"
    path.write_text("extends: pipeline.yaml\n" + text)
    return path


@pytest.mark.parametrize("text,field,fix", [
    ("bogus: 1\n", "bogus", "remove it"),                                              # unknown top-level key
    ("sft: {trl: {learnin_rate: 0.1}}\n", "sft.trl.learnin_rate", "learning_rate"),   # TRL typo, with a hint
    ("sft: {trl: {output_dir: x}}\n", "sft.trl.output_dir", "remove it"),             # path owned by dvc.yaml
    ("grpo: {dense: {trl: {per_device_train_batch_size: 6, num_generations: 4}}}\n",
     "grpo.dense.trl", "GRPOConfig"),                                                  # TRL's own invariant
    ("grpo: {dense: {rewards: {vibes: 1}}}\n", "grpo.dense.rewards", "correctness"),  # unknown reward channel
    ("grpo: {dense: {guardrails: [nice]}}\n", "grpo.dense.guardrails", "unparseable"),  # unknown guardrail
    ("grpo: {more: {from: sft}}\n", "grpo", "from: dense"),                          # stages must chain
    ("grpo: {dense: null, sft2: {trl: {}}}\n", "grpo.sft2.from", "required"),         # every stage says `from`
    ("grpo: {dense: null, sft: {from: sft}}\n", "grpo", "must match"),               # reserved stage name
    ("gate: {k: 32}\n", "gate.k", "n_samples"),                                      # gate k beyond its samples
    ("serving: {gpu: Z80}\n", "serving.gpu", "H100-80GB"),                           # unknown GPU profile
    ("serving: {slo: {gpu: Z80, min_sessions: 1}}\n", "serving.slo.gpu", "H100-80GB"),  # unknown SLO GPU
    ("serving: {session_lengths: [99999]}\n", "serving.session_lengths", "context"),  # longer than the context
    ("evaluate: {k: [1, 99]}\n", "evaluate.k", "n_samples"),                           # k beyond the samples
    ("model: {path: /does/not/exist}\n", "model.path", "save_pretrained"),             # bad model path
    ("serving: {gpu_memory_utilization: 1.5}\n", "serving.gpu_memory_utilization", "valid value"),
    ("data: {options: {operand_maximum: 3}}\n", "data.options", "options"),            # env option typo
])
def test_errors_name_file_field_and_fix(tmp_path, text, field, fix):
    with pytest.raises(UserError) as err:
        load_config(write(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message and "variant.yaml" in message and field in message and fix in message


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("seed: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(path)


def test_extends_merges_mappings_and_replaces_lists(tmp_path):
    config = load_config(write(tmp_path, "evaluate: {k: [1, 2]}\n"))
    base = yaml.safe_load((CONFIGS / "pipeline.yaml").read_text())
    assert config.evaluate.k == [1, 2] and config.evaluate.n_samples == base["evaluate"]["n_samples"]
