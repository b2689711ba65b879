"""Preflight: whether a valid config (posttrain.config) can run here, checked before any
compute. Each caller asks for what it needs: `posttrain check` and `posttrain run` for
all of it (`everything`); a stage process for what its own work touches (`for_stage`):
the serving and evaluate stages neither generate the environment's data nor load a
tokenizer. TRL's own validation of the `trl:` blocks is posttrain.training.trl_bridge's, the
memory fit posttrain.capacity.fit's. Every refusal is one `UserError` line naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from posttrain.config import PipelineConfig
from posttrain.errors import OptionError, UserError
from posttrain.plugins import resolve
from posttrain.stageid import StageId
from posttrain.yamlfile import read_text, schema_error, show


def everything(path: str | Path, config: PipelineConfig, *, here: bool) -> tuple[int, Any, dict[str, list[dict]]]:
    """Every check before a run (`posttrain check`, `posttrain run`) but TRL's own of the
    `trl:` and `peft:` blocks (posttrain.training.trl_bridge.check_trl_blocks: it imports TRL):
    the environment and its data, the model against them, the GPU profiles and the
    launchers (`here`: against this machine too). The longest prompt's characters, which
    the memory fit plans with."""
    path = Path(path)
    dvc_params(path, config)
    env, rows = environment(path, config)
    gpu_profiles(path, config)
    longest = model_room(path, config, env, rows)
    launchers(path, config, here=here)
    _check_export(path, config)
    harness_tasks(path, config, env)
    return longest, env, rows


def harness_tasks(path: Path, config: PipelineConfig, env) -> list[str]:
    """`evaluate.harness`: lm-eval installed, a single-turn environment (lm-eval runs no
    tool episodes), and each task folder there with at least one task config; the task
    names the folders define, in order."""
    harness = config.evaluate.harness
    if not harness.lm_eval:
        return []
    import importlib.util

    where = f"{path}: evaluate.harness"
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"{where}.lm_eval", "lm-eval is not installed in this environment",
                        "pip install lm-eval (make install does), or set lm_eval: false")
    if env is not None:
        from posttrain.envs.tools import is_tool_env

        if is_tool_env(env):
            raise UserError(f"{where}.lm_eval", f"{show(config.data.env)} is a tool environment: lm-eval runs "
                            "single replies, not episodes", "set lm_eval: false (episodes are posttrain's alone)")
    names = []
    for i, folder in enumerate(harness.tasks):
        found = task_names(resolve(folder))
        if not found:
            problem = "no such folder" if found is None else "no lm-eval task config (a YAML file with `task:`) in it"
            raise UserError(f"{where}.tasks[{i}]", f"{show(folder)}: {problem}",
                            "give a folder of lm-eval task YAML files (local data), relative to the workspace")
        names += found
    return list(dict.fromkeys(names))


def task_names(folder: Path) -> list[str] | None:
    """The lm-eval task names the YAML files under `folder` define (None: no such folder).
    Read without lm-eval: its `!function` tags and other tags are kept as plain values."""
    import yaml

    if not folder.is_dir():
        return None

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    names = []
    for file in sorted(folder.rglob("*.yaml")):
        try:
            doc = yaml.load(file.read_text(errors="replace"), Loader=Loader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("task"), str):
            names.append(doc["task"])
    return names


def _check_export(path: Path, config: PipelineConfig) -> None:
    """`promotion.export: gguf` needs a model the GGUF export writes (the tiny built-in one is):
    refused here rather than after training, when the champion is exported."""
    if config.promotion.export != "gguf" or config.model.path is None:
        return
    from posttrain.models.export_checks import exportable

    try:
        exportable(resolve(config.model.path))
    except UserError as err:
        raise UserError(f"{path}: promotion.export", f"gguf, but {show(config.model.path)} {err.problem}",
                        f"{err.fix}; or set promotion.export: off") from None


def for_stage(stage: str, path: str | Path, config: PipelineConfig) -> None:
    """What stage `stage`'s own work needs of the config, checked in its process (the
    run checked everything before it; `dvc repro` alone did not): the environment and the
    model for the stages that build them, this machine's launchers for training."""
    path = Path(path)
    if stage == "prepare":  # `dvc repro` alone: refused at its first stage, not at the one that lists the key
        dvc_params(path, config)
    if stage in ("prepare", "sft", "grpo"):
        env, rows = environment(path, config)
        model_room(path, config, env, rows)
    if stage in ("sft", "grpo"):
        launchers(path, config, here=True)
    if stage == "evaluate" and config.evaluate.harness.lm_eval:
        from posttrain.envs import config_env

        harness_tasks(path, config, config_env(config.data))  # the environment's kind: no splits generated
    if stage == "serving":
        gpu_profiles(path, config)
        heads, kv_heads, _ = model_shape(path, config)
        _check_tensor_parallel(path, config.serving.tensor_parallel_size, heads, kv_heads)


def dvc_params(path: Path, config: PipelineConfig) -> None:
    """When `path` is a workspace's params file (configs/pipeline.yaml beside a dvc.yaml, as in
    `make run`): every key its stages list as `params` is written in it. DVC reads params from
    the file, not the schema's defaults, and stops at the first stage that lists a missing one
    (after the stages before it ran); a workspace that `--config` lays out is written whole
    (posttrain.workspace.workspace_params). Read with DVC's own index (foreach stages resolved
    from the file's `grpo`) and its params dependencies."""
    from posttrain.layout import PARAMS_FILE

    given, path = path, path.resolve()
    root = path.parents[1] if len(path.parents) > 1 else path.parent
    if path != (root / PARAMS_FILE).resolve() or not (root / "dvc.yaml").is_file():
        return
    from dvc.dependency.param import ParamsDependency
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    missing: dict[str, str] = {}
    try:
        with Repo(str(root)) as repo:
            for stage in repo.index.stages:
                for dep in stage.deps:
                    if isinstance(dep, ParamsDependency) and Path(dep.fs_path).resolve() == path:
                        found = dep.read_params()
                        missing.update({key: stage.addressing for key in dep.params if key not in found
                                        and key not in missing})
    except DvcException as err:
        raise UserError(str(root / "dvc.yaml"), f"DVC cannot read the pipeline ({err})",
                        f"fix dvc.yaml or {PARAMS_FILE} as DVC says") from None
    if missing:
        key, stage = next(iter(missing.items()))
        value = config.model_dump(mode="json", by_alias=True)
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        more = f" (and {', '.join(list(missing)[1:])})" if len(missing) > 1 else ""
        raise UserError(f"{given}: {key}", f"missing{more}: dvc.yaml's stage {stage} tracks it as a param, and DVC "
                        "reads params from this file, not the schema's defaults",
                        f"write it, e.g. with its default ({key}: {json.dumps(value)}), or run with "
                        "--config FILE (a workspace's params file is written whole)")


def environment(path: Path, config: PipelineConfig) -> tuple[Any, dict[str, list[dict]]]:
    """The environment and its splits, checked: its options, its rows, the SFT stop's
    validation share of them, the reward channels and guardrails the GRPO stages name."""
    env, rows = _built_env(path, config)
    _check_sft_targets(path, config, env)
    _check_stop_when(path, config, len(rows["train"]))
    _check_grpo_names(path, config)
    return env, rows


def model_room(path: Path, config: PipelineConfig, env, rows: dict[str, list[dict]]) -> int:
    """The model against the data: a chat template where `data.chat` asks for one, heads
    that split over the serving GPUs, positions for the longest prompt and what follows
    it. The longest prompt's characters."""
    heads, kv_heads, positions = model_shape(path, config)
    _check_tools(path, config, env, rows)
    longest = prompt_chars(config, env, rows, check_chat=lambda: _check_chat(path, config))
    _check_tensor_parallel(path, config.serving.tensor_parallel_size, heads, kv_heads)
    _check_lengths(path, config, longest, positions)
    return longest


def launchers(path: Path, config: PipelineConfig, *, here: bool) -> None:
    """Every training stage's launcher and vLLM options (posttrain.runtime.host_checks); `here`: also
    against this machine."""
    from posttrain.runtime import host_checks

    host_checks.check(path, config, here=here)


def _built_env(path: Path, config: PipelineConfig) -> tuple[Any, dict[str, list[dict]]]:
    """The environment, its options checked against its own schema, and its splits (the
    data the other checks measure)."""
    from posttrain.envs import config_env, env_factory, options_schema
    from posttrain.plugins import PluginError, check_custom, plugin_failures, workspace_root

    check_custom(workspace_root())  # where import paths find the user's code: before any of it is read
    if config.data.episode is not None:  # a TRL environment class: found before the rows are built
        from posttrain.plugins import lookup

        try:
            with plugin_failures(config.data.episode):
                lookup(config.data.episode, {}, "episode class", "package.module:Class (e.g. custom.mytools:MyEnv)")
        except PluginError as err:
            raise UserError(f"{path}: data.episode", err.problem, err.fix) from None
    try:
        with plugin_failures(config.data.env):  # what the user's environment raises: one line, its own frame
            env = config_env(config.data)
            splits = env.generate(config.seed)  # new data only adds to the training split
    except ValidationError as err:
        schema = options_schema(env_factory(config.data.env))
        raise schema_error(str(path), err, ("data", "options"), sorted(schema.model_fields) if schema else None) from None
    except OptionError as err:
        raise UserError(f"{path}: data.options.{err.option}", err.problem, err.fix) from None
    except PluginError as err:
        raise UserError(f"{path}: data.env", err.problem, err.fix) from None
    problem = splits_problem(splits)
    if problem:
        raise UserError(f"{path}: data.env", f"{show(config.data.env)}'s generate(seed) {problem}",
                        "return {'train': [...], 'heldout': [...]}, rows with string prompt, completion and answer "
                        "(posttrain/envs/base.py)")
    return env, splits


def splits_problem(splits) -> str | None:
    """What is wrong with an environment's splits, or None."""
    if not isinstance(splits, dict) or not {"train", "heldout"} <= splits.keys():
        return f"returned a {type(splits).__name__} without 'train' and 'heldout'"
    for name in ("train", "heldout"):
        rows = splits[name]
        if not isinstance(rows, list) or not rows:
            return f"gave no {name} rows"
        bad = next((r for r in rows if not isinstance(r, dict) or not all(
            isinstance(r.get(k), str) for k in ("prompt", "completion", "answer"))), None)
        if bad is not None:
            return f"gave a {name} row without string prompt, completion and answer: {show(bad)}"
    return None


def _check_sft_targets(path: Path, config: PipelineConfig, env) -> None:
    """An SFT warmup needs targets: a training file without its completion column has none."""
    if config.sft.enabled and getattr(env, "sft_targets", True) is False:
        options = config.data.options or {}
        raise UserError(f"{path}: data.options.completion_field", f"{options.get('train')} has no column "
                        f"{options.get('completion_field', 'completion')!r}: the SFT warmup has no targets",
                        "add the column (or name it in completion_field), or run GRPO from the base model: "
                        "`sft: off` and the first GRPO stage `from: base`")


def _check_stop_when(path: Path, config: PipelineConfig, train_rows: int) -> None:
    stop = config.sft.stop_when if config.sft.enabled else None
    if stop is not None and stop.validation_size > train_rows // 2:
        raise UserError(f"{path}: sft.stop_when.validation_size", f"{stop.validation_size} of the "
                        f"{train_rows} training rows leaves too few to train on", f"use at most {train_rows // 2}")


def _check_grpo_names(path: Path, config: PipelineConfig) -> None:
    """Reward channels and guardrails name entries of their registries."""
    from posttrain.plugins import PluginError
    from posttrain.scoring.rewards import guardrail, reward_channel

    for stage_name, stage in config.grpo.items():
        for kind, names, load in [("rewards", stage.rewards, reward_channel), ("guardrails", stage.guardrails, guardrail)]:
            for name in names:
                try:
                    load(name)
                except PluginError as err:
                    raise UserError(f"{path}: grpo.{stage_name}.{kind}", err.problem, err.fix) from None


def gpu_profiles(path: Path, config: PipelineConfig) -> None:
    """The GPU profiles the config names exist: in gpus.yaml beside the config, else the
    package's, so a profile is never skipped."""
    from posttrain.capacity.profiles import load_profiles, profiles_path

    serving = config.serving
    gpus = profiles_path(path.parent)
    profiles = load_profiles(gpus)
    for field, gpu in [("serving.gpu", serving.gpu), ("serving.slo.gpu", serving.slo.gpu),
                       ("training.gpu", config.training.gpu)]:
        if gpu is not None and gpu not in profiles:
            raise UserError(f"{path}: {field}", f"unknown GPU profile {show(gpu)} in {gpus}", f"use one of {sorted(profiles)}")


def prompt_chars(config: PipelineConfig, env=None, rows: dict[str, list[dict]] | None = None, *,
                 check_chat=None) -> int:
    """Characters of the longest prompt of every split, inside the chat template with
    `data.chat` (an upper bound of its tokens); the environment's splits are generated
    when not given."""
    if env is None:
        from posttrain.envs import config_env
        from posttrain.plugins import plugin_refusal

        with plugin_refusal("data.env", config.data.env):  # the user's environment: one line if it raises
            env = config_env(config.data)
            rows = env.generate(config.seed)
    chat = check_chat() if check_chat else config.data.chat
    if chat:  # the prompt as generation sees it (a tool environment's with its tools' signatures)
        from posttrain.envs.tools import is_tool_env, tool_schemas

        tools = tool_schemas(env.episode) if is_tool_env(env) else None
        return _longest_rendered(config, getattr(env, "system", None), rows, tools)
    return max(len(r["prompt"]) for split in rows.values() for r in split)


def _check_tools(path: Path, config: PipelineConfig, env, rows: dict[str, list[dict]]) -> None:
    """A tool environment before compute: conversational prompts, tools the chat template
    can describe, a template that renders a tool round-trip and whose calls TRL parses
    back (posttrain's own ChatML when the model's cannot), and one dry episode of the first
    training row with a scripted policy (posttrain.scoring.episodes.dry_episode)."""
    from posttrain.envs.tools import is_tool_env, tool_limits, tool_problems

    if not is_tool_env(env):
        return
    where = f"{path}: data.env"
    if not config.data.chat:
        raise UserError(f"{path}: data.chat", f"{show(config.data.env)} is a tool environment: its episodes are "
                        "conversations", "set data.chat: true (and model.path to a chat model)")
    if config.sft.enabled and config.sft.stop_when is not None:
        raise UserError(f"{path}: sft.stop_when", "stop_when measures single replies, not a tool environment's "
                        "episodes", "remove sft.stop_when and set the warmup's length in sft.trl (max_steps)")
    problems = tool_problems(env.episode)
    if problems:
        raise UserError(where, problems[0], "give every tool typed arguments and a docstring with an Args: line "
                        "per argument (TRL's environment_factory shape: posttrain/envs/tools.py)")
    _check_chat(path, config)
    from posttrain.chat import load_tokenizer, tool_ready
    from posttrain.scoring.episodes import dry_episode

    tokenizer = load_tokenizer(str(resolve(config.model.path).resolve()))
    note = tool_ready(tokenizer, where=f"{path}: model.path")
    if note:
        print(note, flush=True)
    try:
        dry_episode(tokenizer, env, rows["train"][0], limits=tool_limits(config))
    except Exception as err:  # the template's, the parser's or the environment's own reason
        raise UserError(where, f"a dry episode of the first training row failed: {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:200]}", "fix the environment's reset/tools or the chat "
                        "template so a scripted episode runs") from None


def _check_chat(path: Path, config: PipelineConfig) -> bool:
    """`data.chat` needs a model whose tokenizer carries a chat template; whether it is on."""
    if not config.data.chat:
        return False
    if config.model.path is None:
        raise UserError(f"{path}: data.chat", "the tiny built-in model has no chat template",
                        "set model.path to a chat model's folder, or data.chat: false")
    from posttrain.chat import chat_template

    if chat_template(str(resolve(config.model.path))) is None:
        raise UserError(f"{path}: data.chat", f"the tokenizer in {show(config.model.path)} has no chat template "
                        "(no chat_template in tokenizer_config.json, no chat_template.jinja)",
                        "use a chat (instruct) model's folder, add its template, or set data.chat: false")
    return True


def _longest_rendered(config: PipelineConfig, system: str | None, rows: dict[str, list[dict]],
                      tools: list | None = None) -> int:
    """Characters of the longest prompt once the chat template wraps it (an upper bound
    of its tokens, as for plain prompts)."""
    from posttrain.chat import conversation, load_tokenizer, render, render_without_transformers

    longest = max((r for split in rows.values() for r in split), key=lambda r: len(r["prompt"]))
    model_dir = str(resolve(config.model.path).resolve())
    text = render_without_transformers(model_dir, conversation(longest["prompt"], system), tools)
    if text is not None:
        return len(text)
    try:
        tokenizer = load_tokenizer(model_dir)
        return len(render([longest], tokenizer, system, tools)[0]["prompt"])
    except Exception as err:  # the tokenizer's or its template's own reason (a system turn it refuses, ...)
        raise UserError(f"{config.model.path}: chat template", f"cannot render a prompt: {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:200]}", "fix the template, drop data.options.system if the "
                        "template refuses a system turn, or set data.chat: false") from None


def model_shape(path: Path, config: PipelineConfig) -> tuple[int, int, int]:
    """(attention heads, KV heads, positions) of the model the pipeline starts from: the
    tiny model's shape, or what `model.path`'s config.json says."""
    tiny = config.model.tiny
    if config.model.path is None:  # its heads divide evenly: posttrain.config checked that
        return tiny.num_heads, tiny.num_kv_heads, tiny.max_positions
    where = f"{path}: model.path"
    config_json = resolve(config.model.path) / "config.json"
    if not config_json.is_file():
        raise UserError(where, f"{show(config.model.path)} is not a local Hugging Face model folder (no config.json)",
                        "point model.path at a folder saved with save_pretrained, or null")
    try:
        model = json.loads(read_text(config_json))
    except json.JSONDecodeError as err:
        raise UserError(where, f"{config_json} is not valid JSON ({err.msg} at line {err.lineno})",
                        "save the model again with save_pretrained") from None
    return _heads_and_positions(where, config_json, model)


def _heads_and_positions(where: str, config_json: Path, model: Any) -> tuple[int, int, int]:
    """(heads, KV heads, positions) from a Hugging Face config (its text part, for a
    multimodal one), under the names decoder configs use."""
    model = (model.get("text_config") or model) if isinstance(model, dict) else {}
    heads = model.get("num_attention_heads") or model.get("n_head")
    kv_heads = model.get("num_key_value_heads") or heads
    positions = model.get("max_position_embeddings") or model.get("n_positions")
    for name, value in [("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("max_position_embeddings", positions)]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(where, f"{config_json} has no positive integer {name}",
                            "point model.path at a decoder model saved with save_pretrained")
    return heads, kv_heads, positions


def _check_tensor_parallel(path: Path, tp: int, heads: int, kv_heads: int) -> None:
    """vLLM's rule: each GPU holds a whole number of attention heads, and KV heads are
    split evenly or replicated evenly (tp a multiple of them)."""
    def fits(t: int) -> bool:
        return heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)

    if not fits(tp):
        valid = [t for t in range(1, heads + 1) if fits(t)]
        raise UserError(f"{path}: serving.tensor_parallel_size", f"{tp} GPUs cannot split the model's {heads} "
                        f"attention heads and {kv_heads} KV heads evenly", f"use one of {valid}")


def _check_lengths(path: Path, config: PipelineConfig, longest_prompt: int, positions: int) -> None:
    """Generated tokens after the longest prompt fit the model's positions (rotary
    positions have no hard end, so past it generation runs on, for hours). A prompt is
    counted in characters: the tiny tokenizer's tokens, at most a real tokenizer's."""
    lengths = [("evaluate.max_new_tokens", config.evaluate.max_new_tokens)]
    lengths += [(f"{StageId.grpo(name).field}.trl.max_completion_length", stage.trl.get("max_completion_length"))
                for name, stage in config.grpo.items()]
    if longest_prompt >= positions:
        raise UserError(f"{path}: data", f"prompts of up to {longest_prompt} characters leave no room in the model's "
                        f"{positions} positions", "shorten the prompts (and the system prompt) or use a model with more "
                        "positions")
    for field, tokens in lengths:
        if isinstance(tokens, int) and longest_prompt + tokens > positions:
            raise UserError(f"{path}: {field}", f"{show(tokens)} tokens after a prompt of up to {longest_prompt} "
                            f"exceed the model's {positions} positions", f"use at most {positions - longest_prompt}")


