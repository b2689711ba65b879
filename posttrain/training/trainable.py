"""Partial training (a stage's `trainable:`): only the named weights learn, the rest are frozen.

Training only the top decoder layers cuts a step's backward pass and the optimizer's state
to those layers (on SmolLM2-135M with 8 of 30 layers, a CPU step costs a third of a full
one), and it is where an RL stage's change concentrates. The weights are frozen on the
trainer's model after TRL has built it and before `train()` makes the optimizer, which
then holds only the parameters that still require a gradient.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from pathlib import Path

from posttrain.errors import UserError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter belongs to (`model.layers.7.mlp.up_proj.weight` -> 7)."""
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


def selected(names: list[str], *, top_layers: int | None, patterns: list[str], num_layers: int) -> list[str]:
    """The parameter names that train: those of the last `top_layers` decoder layers and the
    final norm after them, and every name matching a glob of `patterns`."""
    chosen = []
    for name in names:
        index = layer_index(name)
        in_top = top_layers is not None and (index is not None and index >= num_layers - top_layers
                                             or index is None and _after_layers(name))
        if in_top or any(fnmatch.fnmatchcase(name, p) for p in patterns):
            chosen.append(name)
    return chosen


def _after_layers(name: str) -> bool:
    """The final norm (`model.norm.weight`): between the last layer and the head. Not the
    head: with tied embeddings it is the input embedding too."""
    return name.split(".")[-2:-1] in (["norm"], ["final_layernorm"], ["ln_f"])


def unmatched(names: list[str], patterns: list[str]) -> list[str]:
    """The patterns that name no parameter (a typo trains nothing it meant to)."""
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]


def check(where: str, spec, names: list[str], layers: int) -> None:
    """`spec` against a model's parameter names and decoder layers: no more top layers than it
    has, every pattern naming a parameter. `UserError` at `where` (e.g. `file: sft.trainable`)."""
    if spec.top_layers is not None and spec.top_layers > layers:
        raise UserError(f"{where}.top_layers", f"{spec.top_layers} exceeds the model's {layers} decoder layers",
                        f"use at most {layers}")
    missing = unmatched(names, list(spec.patterns))
    if missing:
        raise UserError(f"{where}.patterns", f"{missing[0][:80]!r} names no parameter of the model "
                        f"(e.g. {names[len(names) // 2]})", "fix the pattern (globs: * and ?)")


def parameter_names(config) -> tuple[list[str], int]:
    """(parameter names, decoder layers) of the pipeline's base model, built on the meta
    device from its config: no weights are read."""
    sizes, layers = parameter_sizes(config)
    return list(sizes), layers


def decoder_layers(config) -> int | None:
    """The base model's decoder layers from its config.json (the tiny model's from the config),
    without building it; None where config.json does not say `num_hidden_layers`."""
    path, _ = _model_key(config)
    if path is None:
        return config.model.tiny.num_layers
    try:
        layers = json.loads((Path(path) / "config.json").read_text()).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None
    return layers if isinstance(layers, int) and not isinstance(layers, bool) else None


def parameter_sizes(config) -> tuple[dict[str, int], int]:
    """(parameter name -> elements, decoder layers) of the base model, on the meta device; built
    once per model and process (`check` and the memory plan both ask)."""
    return _sizes(*_model_key(config))


def linear_modules(config) -> list[str]:
    """The names of the base model's linear modules (GaLore's targets), on the meta device."""
    return _linears(*_model_key(config))


def _model_key(config) -> tuple[str | None, str | None]:
    """(the resolved model path, or the tiny model's shape as JSON): what the meta-model caches key on."""
    if config.model.path is None:
        return None, json.dumps(config.model.tiny.model_dump(), sort_keys=True)
    from posttrain.plugins import resolve

    return str(resolve(config.model.path)), None


@functools.lru_cache(maxsize=4)
def _linears(path: str | None, tiny: str | None) -> list[str]:
    from torch import nn

    return [name for name, module in _meta_model(path, tiny).named_modules() if isinstance(module, nn.Linear)]


def _meta_model(path: str | None, tiny: str | None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if path is None:
        from posttrain.training.tiny_model import tiny_config

        model_config = tiny_config(**json.loads(tiny))
    else:
        model_config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


@functools.lru_cache(maxsize=4)
def _sizes(path: str | None, tiny: str | None) -> tuple[dict[str, int], int]:
    model = _meta_model(path, tiny)
    return {name: p.numel() for name, p in model.named_parameters()}, model.config.num_hidden_layers


def freeze(model, spec, where: str = "trainable") -> dict[str, float]:
    """Freeze every parameter of `model` that `spec` (a TrainableSection) does not select;
    returns the trainable and total parameter counts."""
    names = [name for name, _ in model.named_parameters()]
    check(where, spec, names, model.config.num_hidden_layers)
    keep = set(selected(names, top_layers=spec.top_layers, patterns=list(spec.patterns),
                        num_layers=model.config.num_hidden_layers))
    trained = 0
    for name, param in model.named_parameters():
        param.requires_grad_(name in keep)
        trained += param.numel() if name in keep else 0
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_params": float(trained), "total_params": float(total)}
