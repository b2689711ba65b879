"""The config schema: every shipped YAML loads; bad input is one clear line.

The hostile inputs of issue 12 (through `check` and `run`) are in test_hardening_config.py.
"""

import functools
from pathlib import Path

import pytest
import yaml

from posttrain import preflight
from posttrain.config import load_config, read_config_dict
from posttrain.errors import UserError
from posttrain.training.trl_bridge import check_trl_blocks

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PIPELINES = [p for p in sorted(CONFIGS.glob("*.yaml")) if p.name != "gpus.yaml"]


def load_checked(path):
    """The config as `posttrain check` takes it: loaded (posttrain.config), then every
    preflight check against this machine."""
    config = load_config(path)
    preflight.everything(path, config, here=True)
    check_trl_blocks(path, config)
    return config


def leaves(tree: dict, keys: tuple = ()):
    """(key path, value) of every leaf of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, (*keys, key))
        else:
            yield (*keys, key), value


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    """Every value the file sets (after `extends`) is the loaded config's value, and the
    GRPO stages keep the file's order."""
    raw = read_config_dict(path)
    config = load_checked(path)
    loaded = config.model_dump(by_alias=True)
    for keys, value in leaves(raw):
        assert functools.reduce(lambda tree, key: tree[key], keys, loaded) == value, ".".join(keys)
    assert list(config.grpo) == list(raw["grpo"]) and config.data.env == raw["data"]["env"]


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
        load_checked(write(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message and "variant.yaml" in message and field in message and fix in message


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("seed: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(path)


def test_extends_merges_mappings_and_replaces_lists(tmp_path):
    config = load_checked(write(tmp_path, "evaluate: {k: [1, 2]}\n"))
    base = yaml.safe_load((CONFIGS / "pipeline.yaml").read_text())
    assert config.evaluate.k == [1, 2] and config.evaluate.n_samples == base["evaluate"]["n_samples"]


@pytest.mark.parametrize("text", [
    "promotion: {metric: evaluate.grpo.pass_at_k.8}\n",                      # the final model's pass@8
    "promotion: {metric: evaluate.grpo.dense.greedy_accuracy_ci95.low}\n",   # one stage's interval
    "promotion: {metric: evaluate.base.n_prompts}\n",                        # the base model's figure
    "promotion: {metric: grpo.dense.train_seconds}\n",                       # a stage's own metric
    "promotion: {metric: serving.max_concurrency, model_name: my-model.v2}\n",  # a serving figure; a dotted name
    "tracking: {uri: 'sqlite:///elsewhere.db'}\n",                           # another SQLite store
    "tracking: {uri: 'postgresql+psycopg2://db.example/mlflow'}\n",          # SQLAlchemy dialect+driver
    "tracking: {uri: 'https://mlflow.example:5000'}\n",                      # a server, credentials in env
    "tracking: {uri: ./mlruns}\n",                                           # a plain folder
    "serving: {tensor_parallel_size: 4}\n",                                  # 4 heads; 2 KV heads replicated
    "serving: {vllm_check: {dtype: bfloat16}}\n",                            # a vLLM dtype
    "data: {options: {ops: ['+', '*'], completion_format: ' {answer}'}}\n",  # two ops; a formatted target
    "sft: {trl: {lr_scheduler_type: cosine, num_train_epochs: 2, learning_rate: 3}}\n",  # ints where TRL has floats
])
def test_accepted_variants(tmp_path, text):
    """Accepted, and every value the variant sets is the loaded config's (ints where TRL has floats equal)."""
    loaded = load_checked(write(tmp_path, text)).model_dump()

    def leaves(tree: dict, prefix=()):
        for key, value in tree.items():
            yield from leaves(value, (*prefix, key)) if isinstance(value, dict) else [((*prefix, key), value)]

    for path, value in leaves(yaml.safe_load(text)):
        found = loaded
        for key in path:
            found = found[key]
        assert found == value, (path, found, value)


def test_gpu_profiles_beside_the_config_come_first(tmp_path):
    path = write(tmp_path, "serving: {gpu: MyGPU}\n")
    (tmp_path / "gpus.yaml").write_text("MyGPU: {memory_gib: 10, reserve_gib: 1}\n")
    assert load_checked(path).serving.gpu == "MyGPU"
    (tmp_path / "gpus.yaml").unlink()  # the package's profiles know no MyGPU
    with pytest.raises(UserError, match="serving.gpu: unknown GPU profile 'MyGPU'"):
        load_checked(path)


COUNTING_ENV = '''
from posttrain.envs.arithmetic import ArithmeticEnv

BUILT = []


def make_env(**options):
    BUILT.append(options)
    return ArithmeticEnv(**options)
'''


@pytest.mark.parametrize("stage,builds", [("prepare", True), ("sft", True), ("grpo", True),
                                          ("serving", False), ("evaluate", False)])
def test_a_stage_process_checks_what_its_own_work_touches(tmp_path, stage, builds):
    """Preflight per stage (posttrain.preflight.for_stage): the stages that build the
    environment check it; serving and evaluate neither build it nor generate its data.
    The environment is named by import path from the workspace named explicitly (the
    loader does not look in the current folder)."""
    import importlib
    import sys

    from posttrain.plugins import workspace

    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "counting.py").write_text(COUNTING_ENV)
    path = write(tmp_path, "data: {env: 'custom.counting:make_env', options: {}}\n")
    config = load_config(path)
    sys.modules.pop("custom.counting", None), sys.modules.pop("custom", None)
    with workspace(tmp_path):
        preflight.for_stage(stage, path, config)
    module = sys.modules.get("custom.counting")
    assert bool(module and module.BUILT) == builds
    if module:
        sys.modules.pop("custom.counting"), sys.modules.pop("custom", None)
        importlib.invalidate_caches()


def test_a_bare_off_reads_as_off(tmp_path):
    """YAML 1.1 reads a bare `off` as false, and `dvc exp run -S` writes the params file back
    unquoted: `promotion.export` and a stage's `audit` shorthand take false as `off`."""
    config = load_config(write(tmp_path, "promotion: {export: off}\ngrpo: {dense: {audit: off}}\n"))
    assert config.promotion.export == "off" and config.grpo["dense"].audit.action == "off"
