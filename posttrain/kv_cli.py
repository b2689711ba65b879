"""`posttrain kv`: capacity of any model on a GPU, from its config alone (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.errors import UserError
from posttrain.kv import capacity, kv_memory_on_gpu, kv_spec, load_config_json, load_gpu_profile, weight_bytes

GIB = 2**30


def _check_numbers(args) -> None:
    for flag, value, low in [("--context", args.context, 1), ("--tp", args.tp, 1), ("--block-size", args.block_size, 1),
                             ("--kv-memory-gib", args.kv_memory_gib, 0),
                             ("--gpu-memory-utilization", args.gpu_memory_utilization, 0)]:
        if value is not None and value < low:
            raise UserError(f"posttrain kv {flag}", f"must be at least {low}, got {value}", "pass a positive value")
    if args.gpu_memory_utilization > 1:
        raise UserError("posttrain kv --gpu-memory-utilization", "must be at most 1", "pass a fraction such as 0.92")


def _read_model_config(model: str) -> dict:
    path = Path(model)
    if not (path / "config.json" if path.is_dir() else path).is_file():
        raise UserError(model, "no config.json found", "pass a model folder or a config.json path")
    try:
        config = load_config_json(model)
        kv_spec(config)
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(model, f"config lacks a field the estimate needs ({err})",
                        "pass a decoder model's config.json") from None
    return config


def estimate(args) -> dict:
    """The capacity report for the parsed `posttrain kv` arguments."""
    _check_numbers(args)
    config = _read_model_config(args.model)
    spec = kv_spec(config, tp=args.tp, kv_dtype=args.kv_dtype)
    model_dir = Path(args.model) if Path(args.model).is_dir() else Path(args.model).parent
    weights = weight_bytes(model_dir, config) // args.tp
    if args.kv_memory_gib is not None:
        kv_memory = int(args.kv_memory_gib * GIB)
    else:
        gpu = load_gpu_profile(args.gpus, args.gpu)
        kv_memory = kv_memory_on_gpu(int(gpu["memory_gib"] * GIB), args.gpu_memory_utilization,
                                     weights, int(gpu["reserve_gib"] * GIB))
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
