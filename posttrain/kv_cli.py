"""`posttrain kv`: capacity of any model on a GPU, from its config alone (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.errors import UserError
from posttrain.kv import GIB, capacity, kv_memory_for, kv_spec, load_config_json, tp_fits, tp_sizes
from posttrain.profiles import load_gpu_profile

LARGEST = 2**40  # bound on every count and size: no model or GPU comes near, and the arithmetic stays exact


def _check_numbers(args) -> None:
    """Whole numbers >= 1, KV memory a finite size >= 0 GiB, utilisation in (0, 1]; NaN fails every test."""
    for flag, value in [("--context", args.context), ("--tp", args.tp), ("--block-size", args.block_size)]:
        if not 1 <= value <= LARGEST:
            raise UserError(f"posttrain kv {flag}", f"must be between 1 and {LARGEST:,}, got {value}",
                            "pass a positive whole number")
    gib = args.kv_memory_gib
    if gib is not None and not 0 <= gib <= 2**20:
        raise UserError("posttrain kv --kv-memory-gib", f"must be a size between 0 and {2**20:,} GiB, got {gib}",
                        "pass the KV memory per GPU in GiB, e.g. 40")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError("posttrain kv --gpu-memory-utilization",
                        f"must be a fraction above 0 and at most 1, got {args.gpu_memory_utilization}",
                        "pass a fraction such as 0.92")


def _read_model_config(model: str, tp: int) -> dict:
    """The model's config.json, checked: its layout is computable and `tp` splits its heads."""
    path = Path(model)
    if not (path / "config.json" if path.is_dir() else path).is_file():
        raise UserError(model, "no config.json found", "pass a model folder or a config.json path")
    try:
        config = load_config_json(model)
        kv_spec(config)
    except (KeyError, ValueError, TypeError, ArithmeticError, OSError) as err:
        detail = f"no {err}" if isinstance(err, KeyError) else str(err)[:200]
        raise UserError(model, f"config lacks a usable value the estimate needs ({detail})",
                        "pass a decoder model's config.json") from None
    if not tp_fits(config, tp):
        raise UserError(f"posttrain kv --tp {tp}", f"{tp} GPUs cannot split the model's attention heads evenly "
                        "(vLLM needs TP to divide the query heads, and divide or be a multiple of the KV heads)",
                        f"use one of {tp_sizes(config)}")
    return config


def estimate(args) -> dict:
    """The capacity report for the parsed `posttrain kv` arguments."""
    _check_numbers(args)
    config = _read_model_config(args.model, args.tp)
    model_dir = Path(args.model) if Path(args.model).is_dir() else Path(args.model).parent
    kv_memory = None if args.kv_memory_gib is None else int(args.kv_memory_gib * GIB)
    profile = None if kv_memory is not None else load_gpu_profile(args.gpus, args.gpu)
    try:
        spec, weights, kv_memory = kv_memory_for(model_dir, config, profile=profile, tp=args.tp,
                                                 utilization=args.gpu_memory_utilization, kv_dtype=args.kv_dtype,
                                                 kv_memory_bytes=kv_memory)
    except (KeyError, ValueError, TypeError, ArithmeticError) as err:
        raise UserError(str(model_dir), f"weights' size not computable ({str(err)[:200]})",
                        "pass a folder with a decoder model's config.json and safetensors files") from None
    cap = capacity(spec, kv_memory_bytes=kv_memory, block_size=args.block_size, context_length=args.context)
    return {**cap.__dict__, "weights_bytes": weights, "session_kv_bytes": spec.session_bytes(args.context),
            "full_attention_layers": spec.full_layers, "sliding_layers": spec.sliding_layers,
            "fixed_state_layers": spec.other_layers}


def run_kv(args) -> int:
    report = estimate(args)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width}}  {value:,.2f}" if isinstance(value, float) else f"{key:<{width}}  {value:,}")
    return 0
