"""The capacity of any model on a GPU, from its config alone (no weights): what
`posttrain kv` prints. The arithmetic is posttrain.capacity.kv's, the same the serving stage uses;
this module checks the inputs a user gives it and names the flag at fault."""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import UserError
from posttrain.capacity.kv import GIB, capacity, kv_memory_for, kv_spec, load_config_json, tp_fits, tp_sizes
from posttrain.capacity.modelconfig import BadField, field_refused
from posttrain.capacity.profiles import load_gpu_profile

LARGEST = 2**40  # bound on every count and size: no model or GPU comes near, and the arithmetic stays exact


def _check_numbers(*, context: int, tp: int, block_size: int, kv_memory_gib: float | None,
                   gpu_memory_utilization: float) -> None:
    """Whole numbers >= 1, KV memory a finite size >= 0 GiB, utilisation in (0, 1]; NaN fails every test."""
    for flag, value in [("--context", context), ("--tp", tp), ("--block-size", block_size)]:
        if not 1 <= value <= LARGEST:
            raise UserError(f"posttrain kv {flag}", f"must be between 1 and {LARGEST:,}, got {value}",
                            "pass a positive whole number")
    gib = kv_memory_gib
    if gib is not None and not 0 <= gib <= 2**20:
        raise UserError("posttrain kv --kv-memory-gib", f"must be a size between 0 and {2**20:,} GiB, got {gib}",
                        "pass the KV memory per GPU in GiB, e.g. 40")
    if not 0 < gpu_memory_utilization <= 1:
        raise UserError("posttrain kv --gpu-memory-utilization",
                        f"must be a fraction above 0 and at most 1, got {gpu_memory_utilization}",
                        "pass a fraction such as 0.92")


def _read_model_config(model: str, tp: int) -> dict:
    """The model's config.json, checked: its layout is computable and `tp` splits its heads."""
    path = Path(model)
    if not (path / "config.json" if path.is_dir() else path).is_file():
        raise UserError(model, "no config.json found", "pass a model folder or a config.json path")
    try:
        config = load_config_json(model)
        kv_spec(config)
    except BadField as err:
        raise field_refused(model, err) from None
    except (KeyError, ValueError, TypeError, ArithmeticError, OSError) as err:
        detail = f"no {err}" if isinstance(err, KeyError) else str(err)[:200]
        raise UserError(model, f"config lacks a usable value the estimate needs ({detail})",
                        "pass a decoder model's config.json") from None
    if not tp_fits(config, tp):
        raise UserError(f"posttrain kv --tp {tp}", f"{tp} GPUs cannot split the model's attention heads evenly "
                        "(vLLM needs TP to divide the query heads, and divide or be a multiple of the KV heads)",
                        f"use one of {tp_sizes(config)}")
    return config


def report(model: str, *, gpu: str, gpus: str, kv_memory_gib: float | None, gpu_memory_utilization: float,
           context: int, tp: int, kv_dtype: str, block_size: int) -> dict:
    """Capacity of `model` (a folder or its config.json) split over `tp` GPUs of profile
    `gpu` in the profiles file `gpus`, or with exactly `kv_memory_gib` of KV memory per GPU:
    KV bytes per token, blocks, KV cache tokens, concurrent sessions of `context` tokens."""
    _check_numbers(context=context, tp=tp, block_size=block_size, kv_memory_gib=kv_memory_gib,
                   gpu_memory_utilization=gpu_memory_utilization)
    config = _read_model_config(model, tp)
    model_dir = Path(model) if Path(model).is_dir() else Path(model).parent
    kv_memory = None if kv_memory_gib is None else int(kv_memory_gib * GIB)
    profile = None if kv_memory is not None else load_gpu_profile(gpus, gpu)
    try:
        spec, weights, kv_memory = kv_memory_for(model_dir, config, profile=profile, tp=tp,
                                                 utilization=gpu_memory_utilization, kv_dtype=kv_dtype,
                                                 kv_memory_bytes=kv_memory)
    except BadField as err:  # read only to estimate the weights where the folder has none
        raise field_refused(model, err) from None
    except (KeyError, ValueError, TypeError, ArithmeticError) as err:
        raise UserError(str(model_dir), f"weights' size not computable ({str(err)[:200]})",
                        "pass a folder with a decoder model's config.json and safetensors files") from None
    cap = capacity(spec, kv_memory_bytes=kv_memory, block_size=block_size, context_length=context)
    return {**cap.__dict__, "weights_bytes": weights, "session_kv_bytes": spec.session_bytes(context),
            "full_attention_layers": spec.full_layers, "sliding_layers": spec.sliding_layers,
            "fixed_state_layers": spec.other_layers}
