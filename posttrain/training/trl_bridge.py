"""The bridge to TRL and peft: a stage's `trl:` / `peft:` block becomes TRL's `SFTConfig` /
`GRPOConfig` or peft's `LoraConfig`. Blocks pass unchanged; their types are checked
against the libraries' own annotations (plus the bounds in `TRL_BOUNDS`), and building
the objects checks TRL's own invariants (e.g. whole groups of `num_generations` per
batch) before training starts. Every refusal is one `UserError` line.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from posttrain.config import SEED_MAX, GRPOStage, PipelineConfig
from posttrain.errors import UserError
from posttrain.stageid import StageId, training_stages
from posttrain.training import trl_fields
from posttrain.yamlfile import SHOWN_CHARS, schema_error

# TRL options posttrain sets itself from dvc.yaml paths and tracking; users set them elsewhere.
OWNED_TRL_KEYS = {"output_dir": "set by dvc.yaml", "report_to": "posttrain always logs to MLflow",
                  "run_name": "set by the pipeline", "logging_dir": "set by dvc.yaml"}


def check_trl_blocks(path: Path, config: PipelineConfig) -> None:
    """Check the `trl:` blocks as building SFTConfig / GRPOConfig would (`check_trl_config`),
    and build the LoRA configs from the `peft:` blocks."""
    check_optimizers(path, config)
    for stage in training_stages(config):
        launcher = config.stage_launcher(stage)
        check_trl_config(f"{path}: {stage.field}.trl", trl_class(stage), stage_options(config, stage),
                         launcher.processes * launcher.nodes if stage.kind == "grpo" else 1)
    for stage in training_stages(config):
        options = config.stage_section(stage).peft
        if options is not None:
            build_lora_config(f"{path}: {stage.field}.peft", options)
    check_trainable(path, config)


def check_optimizers(path: Path, config: PipelineConfig) -> None:
    """Each training stage's `optim` and its options (posttrain.training.optimizer_options)."""
    from posttrain.runtime.host_checks import cuda_devices, sharding
    from posttrain.training import optimizer_options, trainable

    for stage in training_stages(config):
        section, launcher = config.stage_section(stage), config.stage_launcher(stage)
        if section.trl.get("optim") is None:
            continue
        where = f"{path}: {config.launcher_field(stage)}"
        optimizer_options.check(f"{path}: {stage.field}.trl", section.trl, peft=section.peft is not None,
                                sharded=sharding(launcher, where)["zero"] > 0, processes=launcher.processes,
                                linear_modules=lambda: trainable.linear_modules(config), cuda=cuda_devices() > 0)


def check_trainable(path: Path, config: PipelineConfig) -> None:
    """Each stage's `trainable:` against the base model's parameters (posttrain.training.trainable)."""
    from posttrain.training import trainable

    stages = [(stage, config.stage_section(stage).trainable) for stage in training_stages(config)]
    stages = [(stage, spec) for stage, spec in stages if spec is not None]
    if stages:
        names, layers = [], trainable.decoder_layers(config)  # top_layers alone need no model built
        if layers is None or any(spec.patterns for _, spec in stages):
            names, layers = trainable.parameter_names(config)
        for stage, spec in stages:
            trainable.check(f"{path}: {stage.field}.trainable", spec, names, layers)


@functools.cache
def _with_world_size(cls, world: int):
    """`cls` as it validates on `world` ranks: TRL checks GRPO's batches against the world size
    (whole groups of `num_generations` per global batch), which is 1 in the process that checks."""
    return type(cls.__name__, (cls,), {"world_size": property(lambda self: world), "__module__": cls.__module__})


def build_lora_config(where: str, options: dict):
    """`peft.LoraConfig(**options)`; an option LoRA does not know names the nearest valid
    one, an invalid value is one line (`UserError`)."""
    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    for key in options:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=3, cutoff=0.4)
            fix = f"did you mean {' or '.join(map(repr, hint))}?" if hint else \
                f"use LoraConfig's options, e.g. {['r', 'lora_alpha', 'lora_dropout', 'target_modules']}"
            raise UserError(f"{where}.{str(key)[:SHOWN_CHARS]}", "unknown LoraConfig option", fix)
    try:
        trl_schema(LoraConfig).model_validate(options)
    except ValidationError as err:
        file, _, block = where.rpartition(": ")
        raise schema_error(file, err, tuple(block.split("."))) from None
    try:
        return LoraConfig(**options)
    except (ValueError, TypeError) as err:
        raise UserError(where, " ".join(str(err).split())[:300], "adjust the LoRA options as the message says") from None


def stage_options(config: PipelineConfig, stage: StageId, env=None) -> dict:
    """The options training stage `stage` builds its TRL config (SFTConfig / GRPOConfig) from,
    made in this one place: its `trl:` block, the run's seed, what a GRPO stage's reward
    channels imply (`grpo_trl_options`) and, given the built environment `env`, what a tool
    environment needs. The trainer builds TRL's object from them (`build_trl_config`); the
    config check, the memory fit and the pass-rate filter read them, with TRL's own default
    where they are silent (`option`)."""
    from posttrain.envs.tools import is_tool_env

    tools = env is not None and is_tool_env(env)
    if stage.kind == "sft":  # a tool episode's results are masked out of the loss
        return {"seed": config.seed, **({"assistant_only_loss": True} if tools else {}), **config.sft.trl}
    options = {"seed": config.seed, **grpo_trl_options(config.grpo[stage.name])}
    return {"max_tool_calling_iterations": getattr(env, "max_turns", None), **options} if tools else options


def trl_class(stage: StageId) -> str:
    return "SFTConfig" if stage.kind == "sft" else "GRPOConfig"


def option(stage: StageId, options: dict, key: str):
    """Option `key` of the stage's TRL options (`stage_options`), TRL's default where they are silent."""
    return options[key] if key in options else trl_fields.default(trl_class(stage), key)


def grpo_trl_options(stage: GRPOStage) -> dict:
    """The stage's `trl:` block plus what its reward channels imply: channel weights, and
    per-channel normalisation (GDPO) when there are several, unless the block says otherwise."""
    options = {"reward_weights": list(stage.rewards.values())}
    if len(stage.rewards) > 1:
        options["multi_objective_aggregation"] = "normalize_then_sum"
    return {**options, **stage.trl}


def device_defaults() -> dict:
    """TRL defaults to bf16, which a machine without CUDA rejects: there, train in fp32
    on the CPU unless the config says otherwise."""
    import torch

    return {} if torch.cuda.is_available() else {"use_cpu": True, "bf16": False}


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not there)."""
    try:
        return set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()[2:])
    except OSError:
        return set()


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without them bf16
    autocast is emulated: on a 2-core Xeon without either it tripled SmolLM2-135M's backward
    pass; with AMX it cut a step by 16-40% (docs/measured.md)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def resolve_auto(options: dict) -> dict:
    """`bf16: auto` (posttrain's one addition to TRL's options): bf16 mixed precision on a CUDA
    GPU or a CPU with bf16 instructions, fp32 elsewhere."""
    if options.get("bf16") != "auto":
        return options
    from posttrain.runtime.host_checks import cuda_devices  # no GPU driver: no torch import

    return {**options, "bf16": cuda_devices() > 0 or cpu_has_bf16()}


def check_trl_config(where: str, cls_name: str, options: dict, world: int) -> None:
    """What `build_trl_config` refuses, one `UserError` line, without importing TRL where the
    snapshot of its fields can judge the block (posttrain.training.trl_fields); TRL's own
    object is built otherwise (options whose invariants are not replicated, a GPU here)."""
    from posttrain.runtime.host_checks import gpu_driver_here

    if trl_fields.snapshot() is not None and not gpu_driver_here():  # no CUDA: TRL's configs take use_cpu
        options = resolve_auto(options)
        validate_options(where, cls_name, trl_fields.option_names(cls_name), options_schema(cls_name), options)
        refused = trl_fields.fast_verdict(cls_name, options, world)
        if refused is not None:
            if refused:
                raise UserError(where, refused, f"adjust the {cls_name} options as the message says")
            return
    import trl

    cls = getattr(trl, cls_name)
    build_trl_config(where, cls if world == 1 else _with_world_size(cls, world), options,
                     output_dir="/nonexistent/posttrain-check")


def options_schema(cls_name: str) -> type[BaseModel]:
    """`trl_schema` of TRL's class `cls_name`, from the snapshot of its fields where it holds."""
    if trl_fields.snapshot() is None:
        import trl

        return trl_schema(getattr(trl, cls_name))
    return _snapshot_schema(cls_name)


@functools.cache
def _snapshot_schema(cls_name: str) -> type[BaseModel]:
    fields = {key: (trl_fields.annotation(cls_name, key), None) for key in trl_fields.option_names(cls_name)}
    return bounded_model(f"{cls_name}Options", fields)


def validate_options(where: str, cls_name: str, known: set[str], schema: type[BaseModel], options: dict) -> None:
    """Unknown, owned or ill-typed options of a `cls_name` block as one `UserError` line."""
    for key in options:
        if key in OWNED_TRL_KEYS:
            raise UserError(f"{where}.{key}", f"posttrain sets this option ({OWNED_TRL_KEYS[key]})", "remove it")
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"see the {cls_name} documentation"
            raise UserError(f"{where}.{str(key)[:SHOWN_CHARS]}", f"unknown {cls_name} option", fix)
    try:
        schema.model_validate(options)
    except ValidationError as err:
        file, _, block = where.rpartition(": ")  # `file: sft.trl` -> the option at `file: sft.trl.<key>`
        raise schema_error(file, err, tuple(block.split("."))) from None


def build_trl_config(where: str, cls, options: dict, **owned):
    """`cls(**defaults, **options, **owned)`; unknown or invalid options become `UserError`."""
    options = resolve_auto(options)
    validate_options(where, cls.__name__, {f.name for f in dataclasses.fields(cls)}, trl_schema(cls), options)
    try:
        return cls(**{**device_defaults(), **options}, **owned)
    except (ValueError, TypeError) as err:
        message = " ".join(str(err).split())
        raise UserError(where, message[:300], f"adjust the {cls.__name__} options as the message says") from None


# Bounds TRL's dataclasses do not check (a batch of 0 or a negative learning rate fail
# only mid-training); applied to whichever of SFTConfig / GRPOConfig has the option.
TRL_BOUNDS = {
    "learning_rate": {"gt": 0}, "num_train_epochs": {"gt": 0}, "max_steps": {"ge": -1},
    "per_device_train_batch_size": {"ge": 1}, "per_device_eval_batch_size": {"ge": 1},
    "gradient_accumulation_steps": {"ge": 1}, "warmup_steps": {"ge": 0}, "warmup_ratio": {"ge": 0, "le": 1},
    "weight_decay": {"ge": 0}, "max_grad_norm": {"ge": 0}, "logging_steps": {"gt": 0}, "save_steps": {"gt": 0},
    "eval_steps": {"gt": 0}, "max_length": {"ge": 1},
    "max_completion_length": {"ge": 1}, "num_generations": {"ge": 2}, "num_iterations": {"ge": 1},
    "temperature": {"gt": 0}, "top_p": {"gt": 0, "le": 1}, "top_k": {"ge": 0}, "beta": {"ge": 0},
    "seed": {"ge": 0, "le": SEED_MAX}, "data_seed": {"ge": 0, "le": SEED_MAX},
    # peft.LoraConfig (schema built the same way)
    "r": {"ge": 1}, "lora_alpha": {"gt": 0}, "lora_dropout": {"ge": 0, "lt": 1},
}


def _plain(hint):
    """`hint`, or Any where it names a nested config dataclass (peft's ArrowConfig, ...):
    the library checks those itself."""
    def nested(t) -> bool:
        return (isinstance(t, type) and dataclasses.is_dataclass(t)) or any(nested(a) for a in typing.get_args(t))
    return Any if nested(hint) else hint


@functools.cache
def trl_schema(cls) -> type[BaseModel]:
    """A pydantic model of `cls`'s options from TRL's (or peft's) own annotations, strict (YAML reads
    `1e-3` as a string: it must not reach the optimizer) and bounded by TRL_BOUNDS."""
    hints = typing.get_type_hints(cls)
    return bounded_model(f"{cls.__name__}Options", {f.name: (_plain(hints[f.name]), None)
                                                     for f in dataclasses.fields(cls) if f.init})


def bounded_model(name: str, fields: dict) -> type[BaseModel]:
    """A strict pydantic model of `fields` (name: (type, default)), each optional and bounded by TRL_BOUNDS."""
    fields = {key: (Annotated[hint, Field(**TRL_BOUNDS.get(key, {}))] | None, None) for key, (hint, _) in fields.items()}
    # no inf or nan: `beta: .inf` is valid YAML and a valid float, and no TRL option means it
    return create_model(name, __config__=ConfigDict(strict=True, extra="allow", allow_inf_nan=False), **fields)
