"""dvc.yaml's `params` name every config field a stage reads (issue 26, stale results).

DVC reruns a stage when a params entry it lists changes; a field the stage reads and does
not list is a stale result (`data.options.verifier` reran only prepare, which writes the
same rows, and the stages that score kept their old figures), a field it lists and does
not read retrains for nothing (SFT for the GRPO gate's tolerance).

In a real DVC repository (placeholder outputs, a lock recorded by `dvc commit --force`,
nothing run) each field of `posttrain.config.PipelineConfig` is changed alone to another
valid value and DVC is asked which stages changed: every stage READS names for it (the
table of who reads what, taken from posttrain/stages/*.py and what they call), and no
other but those OVERREACH allows (the few reruns dvc.yaml's params cannot avoid). The
fields are walked from the pydantic models, so a new field fails here until it has a
row. Valid: the config schema and the environment's options schema (the loader's
file-reading checks have no bearing on what DVC compares).

The loader's checks run in every stage process and read nearly every field, but they only
accept or refuse, and write nothing a stage outputs: a field read only there is read by no
stage (a value they refuse fails whichever stage runs next, and `posttrain check` / `run`
refuse it first).

By hand, on another dvc.yaml: `python tests/test_stage_params.py OTHER_DVC_YAML` prints
the rows it fails (e.g. `git show fe75072~1:dvc.yaml`, before `data` was listed).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile
import types
import typing
from pathlib import Path

import pytest
import yaml

from conftest import copy_workspace, make_workspace, sh
from posttrain.config import GRPOStage, PipelineConfig, Section, read_config_dict
from posttrain.layout import PARAMS_FILE

REPO = Path(__file__).resolve().parents[1]
GRPO = ("grpo@dense", "grpo@second")          # the test config's GRPO stages (base_config)
SCORERS = {"sft", *GRPO, "evaluate"}          # build the environment: its verifier scores them
EVERY_GATE = {"sft", *GRPO}                   # training.gate_evaluation: the sft card's, each grpo gate's

# Field (dotted; `<g>` a GRPO stage's name) -> the stages whose outputs it can change, and
# why. The longest matching prefix decides; `grpo@<g>` is the stage of the row's `<g>`.
READS = {
    "seed": ({"prepare", *SCORERS}, "env.generate(seed), the tiny model's init, sft's validation carve, TRL's "
                                    "seed, every sampler and bootstrap"),
    "model": ({"prepare"}, "prepare builds the tiny model or points at model.path; the others load what it wrote "
                           "(fit reads it only for a memory plan it logs or refuses)"),
    "data.env": ({"prepare", *SCORERS, "serving"}, "get_env(data.env, **data.options): prepare's rows, the gates' "
                                                   "verifier, grpo's rewards and filter, evaluate's scores, serving's "
                                                   "replayed tool sessions"),
    "data.options": ({"prepare", *SCORERS, "serving"}, "the same get_env call: generate, verify, the answer patterns"),
    "data.chat": ({"prepare"}, "prepare wraps the rows in the chat template; the others read those rows (a dep)"),
    "data.episode": ({"prepare", *SCORERS, "serving"}, "config_env attaches it: prepare's prompts (the tools' schemas), "
                                           "sft's traces, grpo's environment_factory, the gates' and evaluate's "
                                           "episodes, serving's replayed sessions"),
    "data.tool_limits": ({"sft", *GRPO, "evaluate", "serving"}, "a tool environment's limits on each tool call: the "
                                                               "gates' and evaluate's episodes, grpo's filter and "
                                                               "training, serving's replayed sessions"),
    "launcher": ({"grpo@dense"}, "config.stage_launcher(): only a training stage without its own `launcher:` "
                                 "launches with it (sft and second have their own here)"),
    "training": (set(), "fit.checked_plan only refuses a stage that does not fit or logs the plan to MLflow"),
    "sft": ({"sft"}, "config.sft: trl, peft, stop_when, launcher, and its checkpoint folder's hash of all of it"),
    "grpo.<g>": ({"grpo@<g>"}, "config.grpo[name] alone: trl, rewards, guardrails, filter, peft, launcher"),
    "grpo.<g>.rewards.parseable": ({"grpo@<g>", "evaluate"}, "a new channel: evaluate scores every stage's "
                                                            "channels into its samples tables (reward_channels)"),
    "gate": (EVERY_GATE, "gate_evaluation: k, n_samples, temperature, max_prompts of every held-out gate run"),
    "gate.tolerance": (set(GRPO), "gate.decide, in grpo only"),
    "gate.on_reject": (set(GRPO), "grpo: a rejected stage stops the later ones or not"),
    "serving": ({"serving"}, "config.serving: the KV prediction, the vLLM check, the load test, the SLO"),
    "evaluate": ({"evaluate"}, "config.evaluate: the held-out sampling and its report"),
    "evaluate.max_new_tokens": ({*EVERY_GATE, "evaluate", "serving"}, "also the gates' generation length, sft's "
                                                                      "stop_when measure, grpo's filter default and "
                                                                      "a tool environment's served episode cap"),
    "promotion": (set(), "the flow reads it after the stages (posttrain/tracking/promotion.py); the check only refuses"),
    "stats.alpha": (set(GRPO), "gate.decide's paired test; every interval is 95% whatever alpha (stats.intervals)"),
    "stats.bootstrap_resamples": (SCORERS, "the intervals of every gate evaluation and of evaluate's report"),
    "tracking": (set(), "where the records go: no one retrains because the tracking server moved"),
    "orchestration": (set(), "Prefect's retries of a stage task: how the flow schedules, not what a stage computes"),
}
# Reruns the table above does not call for, which dvc.yaml's params cannot avoid.
OVERREACH = {
    "data.chat": ({"sft", *GRPO, "evaluate"}, "they list `data` whole: data.env + data.options alone would be a "
                                              "missing params key for an environment without options; prepare's "
                                              "rows change with it anyway"),
    "data.tool_limits": ({"prepare"}, "prepare lists `data` whole too (data.options may be absent); it writes the "
                                      "same rows, so nothing after it reruns for that"),
    "launcher": ({"sft", "grpo@second"}, "DVC cannot list `launcher` only where a stage has no launcher of its own"),
    "grpo.<g>": ({"evaluate"}, "evaluate reads each stage's name and channels; no params key says grpo.*.rewards, "
                               "so it lists `grpo`; the change reruns grpo@<g>, whose model it reads"),
}
# Fields no other valid value exists for (each alone).
UNCHANGEABLE = {"grpo.<g>.from": "stages form a chain: each starts from the one before",
                "sft.enabled": "off only together with the first stage's `from: base` (tests/test_no_sft.py runs it)"}

TORCHRUN = {"type": "torchrun", "processes": 1, "nodes": 1}
LAUNCHER = {"type": "in_process", "processes": 2, "nodes": 2, "accelerate_config": "infra/accelerate/ddp.yaml",
            "rdzv_endpoint": "node0.cluster:29500", "rdzv_timeout_s": 600}
# Field -> the value a row writes. Free-form mappings (data.options, trl, peft, rewards)
# get representative keys; the dataset environment's verifier is one of them.
CHANGES = {
    "seed": 1, "model.path": "/models/llama", "model.tiny.hidden_size": 256, "model.tiny.num_layers": 2,
    "model.tiny.num_heads": 8, "model.tiny.num_kv_heads": 1, "model.tiny.intermediate_size": 256,
    "model.tiny.max_positions": 128,
    "data.env": "arithmetic", "data.options.verifier": "exact", "data.options.tolerance": 0.01,
    "data.options.answer_pattern": "<answer>(.*?)</answer>", "data.options.train": "custom/more.jsonl",
    "data.chat": True, "data.episode": "custom.tools:Episode", "data.tool_limits.seconds": 2.0, "data.tool_limits.max_chars": 500,
    **{f"{section}.{key}": value for section in ("launcher", "sft.launcher", "grpo.second.launcher")
       for key, value in LAUNCHER.items()},
    "training.gpu": "A100-80GB", "training.num_gpus": 2,
    "sft.trl.learning_rate": 5.0e-4, "sft.trl.max_length": 48, "sft.peft.r": 8,
    "sft.trainable": {"top_layers": 1},
    "sft.stop_when.greedy_accuracy": 0.5, "sft.stop_when.every_steps": 5, "sft.stop_when.validation_size": 100,
    "grpo.<g>.rewards.correctness": 0.5, "grpo.<g>.rewards.parseable": 0.25, "grpo.<g>.guardrails": [],
    "grpo.<g>.pass_rate_filter.enabled": False, "grpo.<g>.pass_rate_filter.samples": 4,
    "grpo.<g>.pass_rate_filter.min_pass_rate": 0.1, "grpo.<g>.pass_rate_filter.max_pass_rate": 0.9,
    "grpo.<g>.pass_rate_filter.temperature": 0.7, "grpo.<g>.pass_rate_filter.max_prompts": 50,
    "grpo.<g>.trainable": {"top_layers": 1}, "grpo.<g>.trl.learning_rate": 1.0e-4, "grpo.<g>.trl.beta": 0.05,
    "grpo.<g>.peft.r": 8, "grpo.dense.launcher": {"type": "in_process"},
    "grpo.<g>.audit.action": "warn", "grpo.<g>.audit.rows": 16, "grpo.<g>.audit.exploits": ["custom.audit:mine"],
    "grpo.<g>.audit.max_false_reward": 0.2,
    "gate.tolerance": 0.05, "gate.k": 4, "gate.n_samples": 8, "gate.temperature": 0.7, "gate.max_prompts": 100,
    "gate.on_reject": "stop", "gate.episodes_backend": "vllm",
    "serving.gpu": "A100-80GB", "serving.context_length": 16384, "serving.gpu_memory_utilization": 0.9,
    "serving.tensor_parallel_size": 2, "serving.kv_dtype": "fp8", "serving.block_size": 32,
    "serving.session_lengths": [256, 1024], "serving.slo.gpu": "A100-80GB", "serving.slo.context_length": 4096,
    "serving.slo.min_sessions": 1, "serving.vllm_check.enabled": False, "serving.vllm_check.kv_memory_mib": 128,
    "serving.vllm_check.dtype": "float16", "serving.load_test.enabled": False, "serving.load_test.requests": 64,
    "serving.load_test.concurrency": 8, "serving.load_test.max_num_seqs": 4, "serving.load_test.max_tokens": 4,
    "evaluate.max_new_tokens": 4, "evaluate.n_samples": 128, "evaluate.temperature": 0.7, "evaluate.k": [1, 8],
    "evaluate.max_prompts": 100, "evaluate.backend": "transformers",
    "evaluate.harness.lm_eval": True, "evaluate.harness.tasks": ["lm_tasks"], "evaluate.harness.batch_size": 8,
    "promotion.enabled": False, "promotion.model_name": "other", "promotion.metric": "evaluate.sft.greedy_accuracy",
    "promotion.higher_is_better": False, "promotion.require_significance": False,
    "promotion.export": "gguf", "promotion.export_type": "q8_0",
    "stats.alpha": 0.01, "stats.bootstrap_resamples": 1000,
    "tracking.uri": "sqlite:///elsewhere.db", "tracking.experiment": "other",
    "orchestration.retries": 3, "orchestration.retry_delay_seconds": 10,
}
# What a row must change beside its field to stay valid (fields with the same readers).
ALONG = {"data.env": {"data.options": {}},  # another environment's options are another schema's
         "evaluate.harness.tasks": {"evaluate.harness.lm_eval": True},  # task folders run only with the harness on
         **{f"{s}.accelerate_config": {f"{s}.type": "accelerate"} for s in ("launcher", "sft.launcher",
                                                                           "grpo.second.launcher")}}


def base_config() -> dict:
    """The default config, complete (every field written, so every params key exists), on
    the dataset environment, with a second GRPO stage; sft and second launch their own way."""
    raw = read_config_dict(REPO / "configs" / "pipeline.yaml")
    raw["data"] = {"env": "dataset", "options": {"train": "custom/train.jsonl", "heldout": "custom/heldout.jsonl",
                                                 "verifier": "numeric"}}
    raw["launcher"], raw["training"] = TORCHRUN, {"gpu": "H100-80GB", "num_gpus": 1}
    raw["sft"]["launcher"] = TORCHRUN
    raw["grpo"]["second"] = {**raw["grpo"]["dense"], "from": "dense", "launcher": TORCHRUN}
    return PipelineConfig.model_validate(raw).model_dump(mode="json", by_alias=True)


def each_stage(path: str, base: dict) -> list[str]:
    """`path` with `<g>` made each GRPO stage's name."""
    return [path.replace("<g>", name) for name in base["grpo"]] if "<g>" in path else [path]


def rows(base: dict) -> dict[str, object]:
    return {field: value for path, value in CHANGES.items() for field in each_stage(path, base)}


def lookup(table: dict, path: str) -> tuple[set[str], str]:
    """The stages and reason of `path`'s longest matching entry in `table` (nothing: none)."""
    parts, found = path.split("."), (0, set(), "")
    for pattern, (stages, reason) in table.items():
        wanted = pattern.split(".")
        if found[0] < len(wanted) <= len(parts) and all(w in (p, "<g>") for w, p in zip(wanted, parts)):
            name = next((p for w, p in zip(wanted, parts) if w == "<g>"), "")
            found = (len(wanted), {s.replace("<g>", name) for s in stages}, reason)
    return found[1], found[2]


# --- the schema's fields ---------------------------------------------------------------
def section_of(annotation) -> type | None:
    """The Section class a field holds (also when optional), or None."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return next((a for a in options if isinstance(a, type) and issubclass(a, Section)), None)


def is_mapping(annotation) -> bool:
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return any(typing.get_origin(a) is dict for a in options)


def schema_fields(model: type[Section], value: dict, prefix: str = "") -> tuple[set[str], set[str]]:
    """(leaf fields, free-form mappings) of `value` as `model` declares them: a section set
    in the config is walked, one that is null is a field of its own."""
    leaves, mappings = set(), set()
    for name, field in model.model_fields.items():
        key = field.alias or name
        path, inner = f"{prefix}{key}", value.get(key)
        nested = section_of(field.annotation)
        stages = typing.get_args(field.annotation)[1:] == (GRPOStage,)
        if nested is not None and inner is not None:
            found = schema_fields(nested, inner, f"{path}.")
        elif stages:
            found = [set().union(*s) for s in zip(*(schema_fields(GRPOStage, v, f"{path}.{n}.")
                                                    for n, v in inner.items()))]
        else:
            found = (set(), {path}) if is_mapping(field.annotation) else ({path}, set())
        leaves |= found[0]
        mappings |= found[1]
    return leaves, mappings


# --- a changed config --------------------------------------------------------------------
def changed_config(base: dict, path: str, value) -> dict:
    config = copy.deepcopy(base)
    for field, new in {path: value, **ALONG.get(path, {})}.items():
        *parents, last = field.split(".")
        node = config
        for part in parents:
            node[part] = node.get(part) or {}  # a null section or mapping: this row sets it
            node = node[part]
        node[last] = new
    return config


def validate(config: dict) -> None:
    from posttrain.envs import env_factory, options_schema

    PipelineConfig.model_validate(config)
    schema = options_schema(env_factory(config["data"]["env"]))
    if schema is not None:
        schema.model_validate(config["data"]["options"])


# --- DVC ---------------------------------------------------------------------------------
def stale_workspace(root: Path, config: dict, dvc_yaml: str | None = None) -> Path:
    """`root` running `config` (and `dvc_yaml`), every output a placeholder, the lock
    recorded as it stands: `dvc status` is clean until a param changes."""
    if dvc_yaml is not None:
        (root / "dvc.yaml").write_text(dvc_yaml)
    (root / PARAMS_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    with dvc_repo(root) as repo:
        outs = [Path(out.fs_path) for stage in repo.index.stages for out in stage.outs]
    for out in outs:
        folder = out.parent if out.suffix else out
        folder.mkdir(parents=True, exist_ok=True)
        (out if out.suffix else out / "placeholder").write_text("{}")
    sh("dvc", "commit", "--force", "--quiet", cwd=root)
    with dvc_repo(root) as repo:
        assert stages_changed(repo) == {}, "a clean lock reports changes"
    return root


@contextlib.contextmanager
def dvc_repo(root: Path):
    """The DVC repository at `root`, in-process (its stage cache wants the folder current)."""
    from dvc.repo import Repo

    with contextlib.chdir(root), Repo(str(root)) as repo:
        yield repo


def stages_changed(repo) -> dict[str, set[str]]:
    """Stage -> what `dvc status` says changed: the params keys of the params file, else
    the status entry itself. (Each status reads dvc.yaml, its vars and the lock afresh.)"""
    found = {}
    for stage, entries in repo.status().items():
        for entry in entries:
            deps = entry.get("changed deps", {}) if isinstance(entry, dict) else {}
            keys = set(deps.get(PARAMS_FILE, {})) if set(deps) == {PARAMS_FILE} else {str(entry)}
            found.setdefault(stage, set()).update(keys)
    return found


def row_failures(repo, base: dict, path: str, value) -> list[str]:
    """One line per stage `dvc status` gets wrong for `path` changed to `value` alone."""
    config = changed_config(base, path, value)
    validate(config)
    params = Path(repo.root_dir) / PARAMS_FILE
    before = params.read_text()
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        got = stages_changed(repo)
    finally:
        params.write_text(before)
    reads, reason = lookup(READS, path)
    allowed = reads | lookup(OVERREACH, path)[0]  # allowed, not required: a dvc.yaml that avoids them is better
    lines = [f"{path}: stage {stage} does not rerun: add configs/pipeline.yaml:{path} (or a section above it) to "
             f"its params ({reason})" for stage in sorted(reads - got.keys())]
    return lines + [f"{path}: stage {stage} reruns for configs/pipeline.yaml:{key}, but does not read {path}"
                    for stage in sorted(got.keys() - allowed) for key in sorted(got[stage])]


def failures(root: Path, base: dict) -> list[str]:
    with dvc_repo(root) as repo:
        return [line for path, value in rows(base).items() for line in row_failures(repo, base, path, value)]


# --- tests -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base() -> dict:
    return base_config()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, base) -> Path:
    return stale_workspace(make_workspace(tmp_path_factory.mktemp("params") / "ws", {}), base)


def test_every_config_field_has_a_row(base):
    leaves, mappings = schema_fields(PipelineConfig, base)
    unchangeable = {field for path in UNCHANGEABLE for field in each_stage(path, base)}
    changed = set(rows(base))
    assert sorted(leaves - changed - unchangeable) == [], "fields without a row in CHANGES"
    assert sorted(m for m in mappings if not any(p.startswith(f"{m}.") for p in changed)) == [], \
        "free-form mappings without a representative key in CHANGES"
    assert sorted(p for p in changed if p not in leaves and not any(p.startswith(f"{m}.") for m in mappings)) == [], \
        "rows for fields the schema does not have"
    assert [p for p in changed if not lookup(READS, p)[1]] == [], "rows READS says nothing of"
    assert [p for p, also in ALONG.items() for a in also if lookup(READS, a)[0] != lookup(READS, p)[0]] == [], \
        "a row changes a field along whose readers differ"


def test_a_changed_field_reruns_the_stages_that_read_it_and_no_others(workspace, base):
    lines = failures(workspace, base)
    assert not lines, "\n".join(lines)


def test_the_verifier_row_fails_without_data_params(workspace, base, tmp_path):
    """dvc.yaml before fe75072: sft, grpo and evaluate listed no `data`; the stages that
    score kept their results after the verifier changed."""
    old = yaml.safe_load((workspace / "dvc.yaml").read_text())
    for stage in (old["stages"]["sft"], old["stages"]["grpo"]["do"], old["stages"]["evaluate"]):
        keys = stage["params"][0]
        keys[PARAMS_FILE] = [k for k in keys[PARAMS_FILE] if k.split(".")[0] != "data"]
    root = stale_workspace(copy_workspace(workspace, tmp_path / "old"), base, yaml.safe_dump(old, sort_keys=False))
    with dvc_repo(root) as repo:
        lines = row_failures(repo, base, "data.options.verifier", "exact")
    assert [line.split(": add")[0] for line in lines] == [
        f"data.options.verifier: stage {s} does not rerun" for s in ("evaluate", "grpo@dense", "grpo@second", "sft")]


def test_the_shipped_params_file_has_every_key_dvc_yaml_lists():
    """`make run` runs this repository's dvc.yaml on configs/pipeline.yaml itself, where a key
    left to the schema's default is missing for DVC: `gate.episodes_backend` and then
    `data.episode` / `data.tool_limits` stopped a fresh clone's run at sft and at serving,
    after the stages before them ran (workspaces write their params whole: no test saw it)."""
    from posttrain import preflight

    path = REPO / PARAMS_FILE
    preflight.dvc_params(path, PipelineConfig.model_validate(read_config_dict(path)))  # raises on a missing key
    listed = {key for stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].values()
              for entry in stage.get("do", stage).get("params") or [] if isinstance(entry, dict)
              for key in entry.get(PARAMS_FILE) or []}
    assert len(listed) > 10  # dvc.yaml lists the params of every stage under the params file
    shipped = read_config_dict(path)
    stages = list(shipped["grpo"])  # the grpo stage's foreach: `grpo.${key}` is each GRPO stage
    for key in {k.replace("${key}", name) for k in listed for name in stages}:  # each listed key is there
        found = shipped
        for part in key.split("."):
            assert isinstance(found, dict) and part in found, key
            found = found[part]


def test_a_params_file_missing_a_key_is_refused_before_any_stage(tmp_path):
    """The same file with keys taken out: `check` and `run` in the workspace refuse it in one
    line naming the first key, its stage and its default, and nothing runs or is written."""
    from hardening import assert_nothing_left, assert_refused, cli, state

    ws = make_workspace(tmp_path / "ws", {})
    params = ws / PARAMS_FILE
    config = yaml.safe_load(params.read_text())
    del config["gate"]["episodes_backend"], config["data"]["tool_limits"]
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    before = state(tmp_path)
    for args in (("check", "--config", PARAMS_FILE), ("run",)):
        assert_refused(cli(*args, cwd=ws), "gate.episodes_backend", "stage sft", "data.tool_limits",
                       'gate.episodes_backend: "transformers"')
    (ws / ".dvc" / "tmp" / "posttrain-retrain.lock").unlink()  # the run's lock file (flows.lock) stays by design
    assert_nothing_left(tmp_path, before)


if __name__ == "__main__":  # python tests/test_stage_params.py OTHER_DVC_YAML
    with tempfile.TemporaryDirectory() as folder:
        config = base_config()
        ws = stale_workspace(make_workspace(Path(folder) / "ws", {}), config, Path(sys.argv[1]).read_text())
        print("\n".join(failures(ws, config)) or "no failures")
