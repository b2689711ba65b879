"""A training stage's optimizer, checked before any compute: transformers' own `optim`,
`optim_args` and `optim_target_modules` (a stage's `trl:` block passes them through to the
Trainer unchanged), as the Trainer will build them.

- 8-bit states: an 8-bit name transformers has (bitsandbytes' `adamw_bnb_8bit`, `adamw_8bit`,
  `paged_adamw_8bit`, `lion_8bit`, ...); a name with no 8-bit form (`sgd_8bit`) is refused.
- GaLore (galore-torch): `optim: galore_adamw`, `optim_target_modules` (module names, a regular
  expression, or `all-linear`), `optim_args: "rank=64, update_proj_gap=200, scale=0.25"`
  (transformers' defaults: 128, 200, 0.25, proj_type std). Not with a LoRA adapter (GaLore
  trains the full weights), nor under DeepSpeed or FSDP (it projects each weight's whole
  gradient), nor its 8-bit form on a CPU (bitsandbytes' kernel needs CUDA).
- `logra` is a planning row (`posttrain memory --optim logra`), not an optimizer anything here runs.
"""

from __future__ import annotations

import functools
import importlib.util
import re

from posttrain.errors import UserError
from posttrain.yamlfile import show

GALORE_ARGS = {"rank": int, "update_proj_gap": int, "scale": float, "proj_type": str}
GALORE_PROJECTIONS = ("std", "reverse_std", "right", "left", "full")
GALORE_EXAMPLE = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"


@functools.cache
def optimizer_names() -> frozenset[str]:
    """transformers' `optim` names (`OptimizerNames`)."""
    from transformers.training_args import OptimizerNames

    return frozenset(o.value for o in OptimizerNames)


def galore_args(where: str, optim_args) -> dict:
    """`optim_args` as transformers parses it for GaLore (`key=value, ...`), each value checked."""
    if optim_args is None:
        return {}
    if not isinstance(optim_args, str):
        raise UserError(f"{where}.optim_args", f"{show(optim_args)} is not a string",
                        'write it as transformers takes it, e.g. "rank=64, update_proj_gap=200, scale=0.25"')
    found = {}
    for part in filter(None, (p.strip() for p in optim_args.replace(" ", "").split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in GALORE_ARGS:
            raise UserError(f"{where}.optim_args", f"{part[:40]!r} is not one of GaLore's key=value options",
                            f"use {', '.join(k + '=...' for k in GALORE_ARGS)}")
        try:
            found[key] = GALORE_ARGS[key](value)
        except ValueError:
            raise UserError(f"{where}.optim_args", f"{key}={value[:40]} is not a {GALORE_ARGS[key].__name__}",
                            f"give {key} a {GALORE_ARGS[key].__name__}") from None
    bad = [k for k in ("rank", "update_proj_gap") if k in found and found[k] < 1] + \
        (["scale"] if "scale" in found and not found["scale"] > 0 else [])
    if bad:
        raise UserError(f"{where}.optim_args", f"{bad[0]}={found[bad[0]]} is out of range", f"give {bad[0]} a value > 0")
    if found.get("proj_type", "std") not in GALORE_PROJECTIONS:
        raise UserError(f"{where}.optim_args", f"proj_type={found['proj_type'][:20]} is not a GaLore projection",
                        f"use one of {', '.join(GALORE_PROJECTIONS)}")
    return found


def matching(targets, modules: list[str]) -> list[str]:
    """The linear modules `optim_target_modules` names, as transformers matches them
    (`check_target_module_exists`; `all-linear`: every one)."""
    if isinstance(targets, str) and targets.replace("_", "-") == "all-linear":
        return list(modules)
    from transformers.trainer_utils import check_target_module_exists

    return [m for m in modules if check_target_module_exists(list(targets) if isinstance(targets, tuple) else targets, m)]


def galore_modules(where: str, targets, linear_modules: list[str]) -> list[str]:
    """The linear modules `optim_target_modules` names, as transformers matches them
    (`check_target_module_exists`; `all-linear`: every one); none is a `UserError`."""
    if targets is None:
        raise UserError(f"{where}.optim_target_modules", "GaLore needs the linear layers it projects",
                        f"name them, e.g. optim_target_modules: {GALORE_EXAMPLE}")
    if not (isinstance(targets, str) or isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise UserError(f"{where}.optim_target_modules", f"{show(targets)} is not a list of names or a regex",
                        f"e.g. optim_target_modules: {GALORE_EXAMPLE}")
    try:
        found = matching(targets, linear_modules)
    except re.error as err:
        raise UserError(f"{where}.optim_target_modules", f"not a regular expression ({err})",
                        f"name them in a list, e.g. {GALORE_EXAMPLE}") from None
    if not found:
        raise UserError(f"{where}.optim_target_modules", f"{show(targets)} names none of the model's linear layers "
                        f"(e.g. {linear_modules[len(linear_modules) // 2]})", f"e.g. optim_target_modules: {GALORE_EXAMPLE}")
    return found


def check(where: str, trl: dict, *, peft: bool, sharded: bool, processes: int, linear_modules,
          cuda: bool) -> None:
    """A stage's optimizer options (module docstring); `where`: `file: field.trl`;
    `linear_modules`: a callable giving the model's linear module names (asked only for
    GaLore); `cuda`: whether the stage trains on a CUDA GPU here."""
    optim = trl.get("optim")
    if optim is None:
        return
    if not isinstance(optim, str):
        raise UserError(f"{where}.optim", f"{show(optim)} is not an optimizer name", "e.g. optim: adamw_bnb_8bit")
    names = optimizer_names()
    if optim == "logra":
        raise UserError(f"{where}.optim", "LoGRA is a planning row (posttrain memory --optim logra): no maintained "
                        "implementation trains here", "use galore_adamw or adamw_bnb_8bit to train with less memory")
    if optim not in names:
        if "8bit" in optim:
            base = optim.replace("_8bit", "").replace("8bit", "")
            eight = ", ".join(sorted(n for n in names if "8bit" in n))
            raise UserError(f"{where}.optim", f"{optim[:40]!r}: {base or optim} has no 8-bit form",
                            f"use an 8-bit optimizer transformers has ({eight})")
        raise UserError(f"{where}.optim", f"{optim[:40]!r} is not a transformers optimizer",
                        "use one of transformers' `optim` names, e.g. adamw_torch, adamw_bnb_8bit, galore_adamw")
    galore = optim.startswith("galore_")
    needs = "galore_torch" if galore else "bitsandbytes" if "bnb" in optim or "8bit" in optim or \
        optim.startswith(("paged_", "lion_", "rmsprop_bnb")) else None
    if needs and importlib.util.find_spec(needs) is None:
        raise UserError(f"{where}.optim", f"{optim} needs the {needs.replace('_', '-')} package, not installed here",
                        f"pip install {needs.replace('_', '-')} (posttrain's own install has it)")
    if not galore:
        return
    if peft:
        raise UserError(f"{where}.optim", "GaLore trains the full weights through projected gradients, a LoRA stage "
                        "only its adapter", "remove the stage's peft: block, or use another optim")
    if sharded:
        raise UserError(f"{where}.optim", "GaLore projects each weight's whole gradient, which DeepSpeed and FSDP "
                        "shard", "train it under DDP (in_process or torchrun), or use another optim")
    if "8bit" in optim and not cuda:
        raise UserError(f"{where}.optim", f"{optim} runs bitsandbytes' 8-bit kernel, which needs a CUDA GPU",
                        "use galore_adamw on a CPU")
    if optim.endswith("layerwise") and (processes > 1 or trl.get("gradient_accumulation_steps", 1) != 1):
        raise UserError(f"{where}.optim", f"{optim} steps each weight as its gradient arrives: one process, no "
                        "gradient accumulation (transformers)", "use galore_adamw")
    galore_args(where, trl.get("optim_args"))
    galore_modules(where, trl.get("optim_target_modules"), linear_modules())
