"""Will it fit: every training stage's memory per GPU, from a pipeline config, against
the GPUs it declares (`training.gpu`, `training.num_gpus`), and the cheapest change that
makes a stage fit.

A stage's plan is `posttrain.capacity.memory.plan` of the setup the stage will run:
- the model: `model.path`'s config.json, or the tiny model's shape;
- the launcher (`launcher:` / the stage's own): processes x nodes GPUs, one per process;
  its accelerate config's DeepSpeed `zero_stage` and CPU offload, FSDP as ZeRO-3;
  in_process and torchrun replicate everything (DDP, ZeRO-0);
- the `trl:` block, with TRL's own defaults where it is silent: the micro-batch
  (`per_device_train_batch_size`), `gradient_checkpointing` (on in TRL 1.x), bf16 on a GPU
  (fp32 on this machine's CPU when no GPU is declared), 8-bit optimizers (`optim`), SFT's
  `max_length`; GRPO's `max_completion_length`, `beta` (a reference model when > 0),
  colocated vLLM (`vllm_gpu_memory_utilization` of the GPU) and the generation batch;
  a GRPO sequence is the longest prompt (characters: an upper bound of its tokens) plus
  the completion;
- `peft:`: the adapter's rank and modules (peft's own defaults per model type).

Units: bytes per GPU. The budget is the GPU profile's memory less its reserve (CUDA
context, allocator fragmentation), from gpus.yaml beside the config or the package's.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from posttrain.errors import UserError
from posttrain.runtime.host_checks import cuda_devices, sharding
from posttrain.capacity import optimizers
from posttrain.capacity.memory import GIB, LINEAR_NAMES, LINEARS, Setup, plan
from posttrain.stageid import StageId, training_stages
from posttrain.capacity.modelconfig import FIELD_FIX, LARGEST_DIMENSION, BadField
from posttrain.yamlfile import show

FIX_LORA_RANK = 16  # the adapter a fix proposes: rank 16 on every linear
FIX_8BIT = "adamw_bnb_8bit"  # the 8-bit optimizer a fix proposes (bitsandbytes)
FIX_GALORE_RANK = 128  # GaLore's rank a fix proposes (transformers' default)


def model_config(config) -> dict:
    """The config.json of the model the pipeline trains: `model.path`'s, or the tiny
    model's (a Llama with tied embeddings and one token per character)."""
    if config.model.path is not None:
        from posttrain.capacity.modelconfig import load_config_json

        return load_config_json(config.model.path)
    from posttrain.training.tiny_model import CHARACTERS, SPECIAL_TOKENS

    tiny = config.model.tiny
    return {"model_type": "llama", "vocab_size": len(SPECIAL_TOKENS) + len(CHARACTERS),
            "hidden_size": tiny.hidden_size, "num_hidden_layers": tiny.num_layers,
            "num_attention_heads": tiny.num_heads, "num_key_value_heads": tiny.num_kv_heads,
            "intermediate_size": tiny.intermediate_size, "max_position_embeddings": tiny.max_positions,
            "tie_word_embeddings": True}


def lora_modules(model: dict, peft: dict, where: str) -> frozenset[str]:
    """The decoder linears a LoRA config adapts: `target_modules` as peft matches it (a
    name matches a module whose name is it or ends with `.name`; a string is a regex that
    must match the module's whole name; `all-linear`), else peft's default for the model
    type. None of them: a `UserError`, as peft would fail at training."""
    targets = peft.get("target_modules")
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        targets = DEFAULTS.get(model.get("model_type"), list(LINEAR_NAMES))
    if targets == "all-linear":
        return LINEARS
    full = {name: f"model.layers.0.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}" for name in LINEAR_NAMES}
    if isinstance(targets, str):
        try:
            found = frozenset(name for name, path in full.items() if re.fullmatch(targets, path))
        except re.error as err:
            raise UserError(f"{where}.target_modules", f"{targets[:60]!r} is not a regular expression ({err})",
                            "give module names as a list, e.g. [q_proj, v_proj], or all-linear") from None
    else:
        found = frozenset(name for name, path in full.items()
                          if any(path == str(t) or path.endswith(f".{t}") for t in targets))
    if not found:
        raise UserError(f"{where}.target_modules", f"{str(targets)[:80]} matches none of the model's linear layers "
                        "(a string is a regular expression on the whole module name)",
                        f"name them in a list, e.g. [q_proj, v_proj], or use all-linear ({', '.join(LINEAR_NAMES)})")
    return found


def saved_modules(model: dict, peft: dict) -> int:
    """Parameters of peft's `modules_to_save` that the plan knows (the embedding, the output
    head): trained whole, as copies beside the frozen originals."""
    vocab, hidden = int(model.get("vocab_size", 0)), int(model.get("hidden_size", 0))
    named = {str(m).rsplit(".", 1)[-1] for m in peft.get("modules_to_save") or []}
    return vocab * hidden * len(named & {"embed_tokens", "lm_head"})


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": None}
# The trl: counts the plan multiplies: TRL takes any integer, and 10^400 would overflow the plan's floats.
PLANNED_COUNTS = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "max_completion_length",
                  "generation_batch_size", "steps_per_generation")


def trl_option(trl: dict, cls_name: str, key: str, *, where: str):
    """Option `key` of a stage's `trl:` block, TRL's default where it is silent; a count the
    plan multiplies beyond LARGEST_DIMENSION is a `UserError` at `where.key`."""
    from posttrain.training import trl_fields

    value = trl[key] if key in trl else trl_fields.default(cls_name, key)
    if key in PLANNED_COUNTS and isinstance(value, int) and value > LARGEST_DIMENSION:
        raise UserError(f"{where}.{key}", f"{show(value)} is more than any training step holds (at most "
                        f"{LARGEST_DIMENSION:,})", "give the count the stage needs")
    return value


def stage_setup(config, stage: str, *, prompt_chars: int, gpu: bool, where: str) -> Setup:
    """The `Setup` training stage `stage` runs (module docstring); `gpu`: on a GPU (bf16 by
    TRL's default) rather than this machine's CPU (fp32)."""
    from posttrain.training.trl_bridge import cpu_has_bf16, options_schema, stage_options, trl_class
    from posttrain.yamlfile import schema_error
    from pydantic import ValidationError

    section, stage_id = config.stage_section(stage), StageId.parse(stage)
    field = stage_id.field
    file = where.split(": ")[0]
    trl, cls = stage_options(config, stage_id), trl_class(stage_id)  # as the stage builds its TRL config
    if trl.get("bf16") == "auto":  # as the stage resolves it where it will run (trl_bridge.resolve_auto)
        trl["bf16"] = gpu or cpu_has_bf16()
    try:  # the options' types, as the stage will build them (a bad value is one line here too)
        options_schema(cls).model_validate(trl)
    except ValidationError as err:
        raise schema_error(file, err, (*field.split("."), "trl")) from None
    option = functools.partial(trl_option, trl, cls, where=f"{file}: {field}.trl")
    launcher = config.stage_launcher(stage)
    model = model_config(config)
    mixed = bool(option("fp16")) or (trl.get("bf16", True) is not False if gpu else bool(trl.get("bf16")))
    dtype = str((option("model_init_kwargs") or {}).get("dtype", "float32")).removeprefix("torch.")
    load = DTYPE_BYTES.get(dtype) or (2 if str(model.get("torch_dtype", model.get("dtype"))) in ("bfloat16", "float16")
                                      else 4)
    batch = int(option("per_device_train_batch_size"))
    common = dict(gpus=launcher.processes, nodes=launcher.nodes, batch=batch, mixed_precision=mixed, cpu=not gpu,
                  accumulation=int(option("gradient_accumulation_steps")), load_bytes=load,
                  gradient_checkpointing=bool(option("gradient_checkpointing")),
                  **optimizer_setup(trl, option, f"{file}: {field}.trl"), **sharding(launcher, where))
    if section.peft is not None:
        rank = section.peft.get("r", 8)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise UserError(f"{file}: {field}.peft.r", f"{str(rank)[:40]} is not a LoRA rank", "give a whole number >= 1")
        common.update(lora_rank=rank, lora_modules=lora_modules(model, section.peft, f"{file}: {field}.peft"),
                      extra_trainable=saved_modules(model, section.peft))
    if section.trainable is not None:
        common.update(trainable_layers=section.trainable.top_layers or 0,
                      trainable_patterns=tuple(section.trainable.patterns))
    if stage == "sft":
        return Setup(method="sft", seq=int(option("max_length") or 1024), **common)
    completion = int(option("max_completion_length"))
    vllm, mode = bool(option("use_vllm")), option("vllm_mode")
    world = launcher.processes * launcher.nodes
    per_step = option("steps_per_generation") or common["accumulation"]
    generated = option("generation_batch_size") // world if option("generation_batch_size") else batch * per_step
    return Setup(method="grpo", seq=prompt_chars + completion, completion=completion, beta=float(option("beta")),
                 vllm_share=float(option("vllm_gpu_memory_utilization")) if vllm and mode == "colocate" else 0.0,
                 vllm_server=vllm and mode == "server", generation_batch=generated,
                 gather_for_generation=bool(option("ds3_gather_for_generation")), **common)


def optimizer_setup(trl: dict, option, where: str) -> dict:
    """The plan's optimizer fields from a `trl:` block: `optim` (TRL's default where silent),
    and GaLore's rank and target modules (`optim_args`, `optim_target_modules`)."""
    optim = str(option("optim"))
    found = {"optim": optim}
    if optim.startswith("galore_"):
        from posttrain.training.optimizer_options import galore_args

        targets = trl.get("optim_target_modules")
        found.update(galore_rank=galore_args(where, trl.get("optim_args")).get("rank", 128),
                     galore_targets=tuple(targets) if isinstance(targets, list) else targets or LINEAR_NAMES)
    return found


def budget(config, config_dir: Path) -> tuple[int, int, str] | None:
    """(bytes per GPU training may use, the GPU's bytes, how it was reached), or None
    without `training.gpu`."""
    if config.training.gpu is None:
        return None
    from posttrain.capacity.profiles import load_gpu_profile, profiles_path

    profile = load_gpu_profile(profiles_path(config_dir), config.training.gpu)
    usable = int((profile["memory_gib"] - profile["reserve_gib"]) * GIB)
    how = f"{config.training.gpu}: {profile['memory_gib']:g} GiB less a {profile['reserve_gib']:g} GiB reserve"
    return usable, int(profile["memory_gib"] * GIB), how


def stage_plan(config, stage: str, *, config_path: str | Path, prompt_chars: int) -> dict:
    """One stage's plan: its setup, the parts in bytes, the budget, whether it fits and,
    when it does not, the cheapest fix (`fix`, `fix_total_bytes`). A model the plan does not
    know (not a dense Llama-like decoder) gets `planned: false` and its reason; with a GPU
    declared that is a `UserError` (nothing would be checked)."""
    path = Path(config_path)
    field = StageId.parse(stage).field
    where = f"{path}: {config.launcher_field(stage)}"
    limit = budget(config, path.parent)
    gpu = limit is not None or cuda_devices() > 0
    setup = stage_setup(config, stage, prompt_chars=prompt_chars, gpu=gpu, where=where)
    model = model_config(config)
    gpu_bytes = limit[1] if limit else 0  # a colocated vLLM takes its share of the whole GPU
    result = {"stage": stage, "planned": True, "gpu": config.training.gpu, "budget_bytes": limit[0] if limit else None,
              "fits": None, "fix": None, "fix_total_bytes": None}
    try:
        figures = plan(model, dataclasses.replace(setup, gpu_bytes=gpu_bytes)).as_dict()
    except BadField as err:  # a decoder that could not load either (10^30 layers): refused, GPU or not
        if config.model.path is None:
            raise UserError(f"{path}: model.tiny", str(err), "give the tiny model a smaller shape") from None
        raise UserError(f"{path}: model.path", f"{Path(config.model.path) / 'config.json'}: {err}", FIELD_FIX) from None
    except (KeyError, ValueError, TypeError) as err:
        reason = f"no {err}" if isinstance(err, KeyError) else str(err)[:200]
        if limit:
            raise UserError(f"{path}: training.gpu", f"the memory plan cannot read the model ({reason})",
                            "set training.gpu: null to train without the memory check") from None
        return {**result, "planned": False, "reason": reason}
    shown = {k: sorted(v) if isinstance(v, frozenset) else v for k, v in dataclasses.asdict(setup).items()
             if k != "gpu_bytes"}
    result.update(setup=shown, **figures)
    if limit:
        result["fits"] = figures["total_bytes"] <= limit[0]
        result["budget"] = limit[2]
        if not result["fits"]:
            result["fix"], result["fix_total_bytes"] = cheapest_fix(config, stage, field, model,
                                                                    dataclasses.replace(setup, gpu_bytes=gpu_bytes),
                                                                    limit[0], path)
    return result


def cheapest_fix(config, stage: str, field: str, model: dict, setup: Setup, limit: int,
                 path: Path) -> tuple[str, int | None]:
    """The first change, in order of cost, whose plan fits `limit` bytes: gradient
    checkpointing (recomputes activations: slower steps, same result); a smaller micro-batch
    with more accumulation (same global batch; TRL must accept it); not gathering the
    ZeRO-3 model to generate; ZeRO-3 over the GPUs declared, then with the optimizer in CPU
    memory (same result, more communication); then the levers that change the result, least
    first: 8-bit AdamW states (bitsandbytes: quantised moments, all weights train), GaLore
    (low-rank projected moments, all weights train, an SVD every few hundred steps), a LoRA
    adapter, then with the base loaded in bf16 (trains a low-rank update only), and last only
    the top half of the layers (the rest frozen); then their combinations. (text, its total
    bytes), or what does not suffice and (text, None)."""
    total = lambda s: plan(model, s).total_bytes  # noqa: E731
    levers = fix_levers(config, stage, field, setup)
    for base, changes in levers:
        for candidate, made in with_cheap_savings(config, stage, f"{field}.trl", base, changes, path):
            if total(candidate) <= limit:
                return "set " + " and ".join(made), total(candidate)
    floor = dataclasses.replace(levers[-1][0], gradient_checkpointing=True, batch=1)
    more = "more of them (training.num_gpus, ZeRO-3)" if not setup.lora_rank else "more of them without LoRA (ZeRO-3)"
    return (f"nothing posttrain can change fits it (with every saving above and a micro-batch of 1 it is still "
            f"{total(floor) / GIB:,.1f} GiB): use GPUs with more memory, or {more}"), None


def fix_levers(config, stage: str, field: str, setup: Setup) -> list[tuple[Setup, list[str]]]:
    """The stage's setup with each lever pulled on top of the cheaper ones before it (and
    the config changes that pull them): no gathering for generation, ZeRO-3 over the GPUs,
    the optimizer in CPU memory, LoRA, the frozen base in bf16."""
    trl = f"{field}.trl"
    levers = [(setup, [])]
    if setup.zero == 3 and setup.engine == "deepspeed" and setup.gather_for_generation and setup.method != "sft" \
            and not setup.vllm_share and not setup.vllm_server:
        levers.append((dataclasses.replace(setup, gather_for_generation=False),
                      [f"{trl}.ds3_gather_for_generation: false (generation gathers one layer at a time: slower)"]))
    unsharded = levers[-1]
    gpus = max(config.training.num_gpus or setup.gpus, setup.gpus)
    if setup.lora_rank == 0 and gpus * setup.nodes > 1 and (setup.zero < 3 or gpus > setup.gpus):
        levers.append(zero3_lever(levers[-1], field, config.stage_launcher(stage), gpus, setup))
    if levers[-1][0].zero == 3 and levers[-1][0].engine == "deepspeed" and not levers[-1][0].offload_optimizer:
        base, changes = levers[-1]
        levers.append((dataclasses.replace(base, offload_optimizer=True),
                       changes + [f"offload_optimizer_device: cpu in {field}'s DeepSpeed config"]))
    full = levers[-1]  # every weight still trains: the optimizer's states next
    if optimizers.kind(setup.optim) == "adamw" and not setup.lora_rank:
        base, changes = full
        full = (dataclasses.replace(base, optim=FIX_8BIT), changes + [f"{trl}.optim: {FIX_8BIT} (8-bit AdamW states)"])
        levers.append(full)
        if base.zero == 0 and not base.trainable_layers and not base.trainable_patterns:
            base, changes = unsharded
            levers.append((dataclasses.replace(base, optim="galore_adamw", galore_rank=FIX_GALORE_RANK,
                                               galore_targets=LINEAR_NAMES),
                           changes + [f"{trl}.optim: galore_adamw with optim_args: rank={FIX_GALORE_RANK} and "
                                      f"optim_target_modules: [{', '.join(LINEAR_NAMES)}] (GaLore: projected "
                                      "gradients, an SVD every update_proj_gap steps)"]))
    if setup.zero < 3:  # LoRA is refused with sharded weights
        base, changes = unsharded
        lora = base if base.lora_rank else dataclasses.replace(base, lora_rank=FIX_LORA_RANK, lora_modules=LINEARS)
        if not base.lora_rank:
            changes = changes + [f"{field}.peft: {{r: {FIX_LORA_RANK}, target_modules: all-linear}}"]
            levers.append((lora, changes))
        if lora.load_bytes == 4 and lora.engine != "deepspeed":
            levers.append((dataclasses.replace(lora, load_bytes=2),
                           changes + [f"{trl}.model_init_kwargs: {{dtype: bfloat16}} (the frozen base in bf16)"]))
    if not setup.lora_rank and not setup.trainable_layers and not setup.trainable_patterns:
        base, changes = full
        layers = int(model_config(config)["num_hidden_layers"])
        levers.append((dataclasses.replace(base, trainable_layers=max(1, layers // 2)),
                       changes + [f"{field}.trainable: {{top_layers: {max(1, layers // 2)}}} (the top half of the "
                                  "layers train, the rest frozen)"]))
    return levers


def zero3_lever(lever: tuple[Setup, list[str]], field: str, launcher, gpus: int,
                setup: Setup) -> tuple[Setup, list[str]]:
    """`lever` sharded with ZeRO-3 over `gpus` GPUs per node, the global batch kept where
    the micro-batch and accumulation steps allow it."""
    trl = f"{field}.trl"
    nodes = f", nodes: {launcher.nodes}" if launcher.nodes > 1 else ""
    zero3 = f"{field}.launcher: {{type: accelerate, processes: {gpus}{nodes}, accelerate_config: " \
            "infra/accelerate/zero3.yaml}"
    world, was = gpus * setup.nodes, setup.gpus * setup.nodes
    batch, steps = setup.batch, setup.accumulation
    if (steps * was) % world == 0:  # the same global batch: fewer accumulation steps, or a smaller micro-batch
        steps = steps * was // world
    elif (batch * steps * was) % world == 0:
        batch, steps = batch * steps * was // world, 1
    if batch * steps * world != setup.batch * setup.accumulation * was:
        zero3 += f" (a global batch {world / was:g}x larger: lower gradient_accumulation_steps to keep it)"
    elif (batch, steps) != (setup.batch, setup.accumulation):
        zero3 += f" with {trl}.per_device_train_batch_size: {batch} and gradient_accumulation_steps: {steps}"
    base, changes = lever
    return dataclasses.replace(base, zero=3, gpus=gpus, engine="deepspeed", batch=batch,
                               accumulation=steps), changes + [zero3]


def with_cheap_savings(config, stage: str, trl: str, base: Setup, changes: list[str],
                       path: Path) -> list[tuple[Setup, list[str]]]:
    """`base` (when it changes anything), then with gradient checkpointing, then with each
    smaller micro-batch TRL accepts (more accumulation: the same global batch)."""
    candidates = [(base, changes)] if changes else []
    if not base.gradient_checkpointing:
        base, changes = dataclasses.replace(base, gradient_checkpointing=True), \
            changes + [f"{trl}.gradient_checkpointing: true"]
        candidates.append((base, changes))
    for b in sorted((d for d in range(1, base.batch) if base.batch % d == 0), reverse=True):
        steps = base.accumulation * base.batch // b  # the same global batch
        smaller = f"{trl}.per_device_train_batch_size: {b} with gradient_accumulation_steps: {steps}"
        if accepted(config, stage, b, steps, path):
            candidates.append((dataclasses.replace(base, batch=b, accumulation=steps),
                               changes + [f"{smaller} (the same global batch)"]))
    return candidates


def accepted(config, stage: str, batch: int, steps: int, path: Path) -> bool:
    """Whether TRL accepts the stage's `trl:` block with this micro-batch and accumulation
    (GRPO: whole groups of `num_generations` per generation batch, at the launcher's world size)."""
    from posttrain.training.trl_bridge import check_trl_config, stage_options

    if stage == "sft":
        return True
    launcher = config.stage_launcher(stage)
    options = {**stage_options(config, StageId.parse(stage)), "per_device_train_batch_size": batch,
               "gradient_accumulation_steps": steps}
    try:
        check_trl_config(f"{path}: {stage}", "GRPOConfig", options, launcher.processes * launcher.nodes)
    except UserError:
        return False
    return True


def pipeline_plan(config, *, config_path: str | Path, prompt_chars: int) -> dict:
    """Every training stage's plan (reports/memory.json, `posttrain memory --config`)."""
    stages = {stage: stage_plan(config, stage, config_path=config_path, prompt_chars=prompt_chars)
              for stage in map(str, training_stages(config))}
    return {"gpu": config.training.gpu, "num_gpus": config.training.num_gpus, "stages": stages}


def check(path: str | Path, config, *, prompt_chars: int | None = None) -> str:
    """Plan every training stage (what the plan reads of `trl:` and `peft:` is checked
    here), refuse the first whose plan exceeds the GPU `training.gpu` declares
    (`checked_plan`), and say what each needs. `posttrain check` and `posttrain run` call it."""
    chars = longest_prompt(config) if prompt_chars is None else prompt_chars
    plans = {stage: checked_plan(config, stage, config_path=path, prompt_chars=chars)  # peft: and trl: read here
             for stage in map(str, training_stages(config))}
    if config.training.gpu is None:
        return ""
    budget_gib = next(iter(plans.values()))["budget_bytes"] / GIB
    return (f"every training stage fits {config.training.gpu} (" + ", ".join(
        f"{stage} {plan['total_bytes'] / GIB:,.1f}" for stage, plan in plans.items()) +
        f" of {budget_gib:,.1f} GiB per GPU)")


def longest_prompt(config) -> int:
    from posttrain.preflight import prompt_chars

    return prompt_chars(config)


def checked_plan(config, stage: str, *, config_path: str | Path, prompt_chars: int | None = None) -> dict:
    """`stage_plan`, or a `UserError` naming the stage, the predicted peak, the budget and
    the cheapest fix when it does not fit (or the launcher wants more GPUs than declared)."""
    chars = longest_prompt(config) if prompt_chars is None else prompt_chars
    field = StageId.parse(stage).field
    launcher = config.stage_launcher(stage)
    if config.training.num_gpus is not None and launcher.processes > config.training.num_gpus:
        raise UserError(f"{config_path}: {config.launcher_field(stage)}.processes", f"{launcher.processes} processes per node, but "
                        f"training.num_gpus declares {config.training.num_gpus} GPUs per node",
                        f"set processes to at most {config.training.num_gpus}, or raise training.num_gpus")
    result = stage_plan(config, stage, config_path=config_path, prompt_chars=chars)
    if result["fits"] is False:
        after = f" (the cheapest change that fits: {result['fix_total_bytes'] / GIB:,.1f} GiB per GPU then)" \
            if result["fix_total_bytes"] else ""
        raise UserError(f"{config_path}: {field}", f"training stage {stage} needs {result['total_bytes'] / GIB:,.1f} "
                        f"GiB per GPU, over the budget of {result['budget_bytes'] / GIB:,.1f} GiB ({result['budget']})",
                        f"{result['fix']}{after}")
    return result


def log_plan(result: dict, recorder) -> None:
    """A stage's plan in its run (`recorder`): `memory.json` and `memory.*_bytes` metrics."""
    recorder.dict(result, "memory.json")
    recorder.metrics({k: v for k, v in result.items() if k.endswith("_bytes") and isinstance(v, int)
                      and not isinstance(v, bool)}, prefix="memory.")
