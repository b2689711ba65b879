"""TRL's SFTConfig / GRPOConfig options without importing TRL: a snapshot of their fields
(name, type, default) per TRL version, so `posttrain check` validates a `trl:` block in
milliseconds instead of the ten seconds of CPU that importing TRL, transformers and torch
costs (issue 45).

The snapshot (`trl_fields.json` beside this file) is written from the installed TRL by
`python -m posttrain.training.trl_fields` and checked against TRL itself in the tests; with
another TRL installed than the one it was written from, `snapshot()` is None and every
caller builds TRL's own objects, as before.

`fast_verdict` says what building the config would say, for the blocks whose every option is
one whose TRL invariants are replicated here (`PLAIN`); any other block (`use_vllm`,
`eval_strategy`, `generation_batch_size`, ...) gets None and is built with TRL itself. The
stage always builds the real config as its first act, before compute.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

SNAPSHOT = Path(__file__).with_name("trl_fields.json")
CLASSES = ("SFTConfig", "GRPOConfig")

# Options whose every TRL invariant is the type, a bound (trl_bridge.TRL_BOUNDS) or one below;
# a block of these alone is judged here (tests/test_trl_fields.py holds it to TRL's verdicts).
PLAIN = frozenset({
    "learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
    "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay", "max_grad_norm", "adam_beta1",
    "adam_beta2", "adam_epsilon", "logging_steps", "logging_first_step", "save_strategy", "save_steps",
    "save_total_limit", "disable_tqdm", "gradient_checkpointing", "seed", "data_seed", "bf16", "max_length",
    "packing", "completion_only_loss", "assistant_only_loss", "dataset_text_field", "max_completion_length",
    "num_generations", "temperature", "top_p", "top_k", "beta", "epsilon", "loss_type", "scale_rewards",
    "reward_weights", "multi_objective_aggregation", "num_iterations", "mask_truncated_completions",
    "log_completions", "shuffle_dataset", "remove_unused_columns",
})
# values of a PLAIN option that TRL or transformers treat specially (left to TRL itself); bf16 is
# judged here only where no GPU driver is loaded (TRL's configs then take use_cpu, which allows it)
SPECIAL = {"save_strategy": {"best"}, "lr_scheduler_type": {"reduce_lr_on_plateau", "warmup_stable_decay",
                                                             "cosine_with_min_lr", "cosine_warmup_with_min_lr"}}


def installed_trl() -> str | None:
    try:
        return metadata.version("trl")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def snapshot() -> dict | None:
    """The shipped snapshot when it was written from the installed TRL; None otherwise."""
    if not SNAPSHOT.is_file():
        return None
    data = json.loads(SNAPSHOT.read_text())
    return data if data.get("trl") == installed_trl() else None


def default(cls_name: str, key: str):
    """TRL's default of `key` (from the snapshot, or TRL's class where there is none)."""
    found = snapshot()
    if found is not None:
        return found["classes"][cls_name][key]["default"]
    import trl

    field = next(f for f in dataclasses.fields(getattr(trl, cls_name)) if f.name == key)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def option_names(cls_name: str) -> set[str]:
    found = snapshot()
    if found is not None:
        return set(found["classes"][cls_name])
    import trl

    return {f.name for f in dataclasses.fields(getattr(trl, cls_name))}


# --- the type of a field, as JSON ---------------------------------------------------------
def encode(hint) -> Any:
    """A type annotation as JSON: a builtin's name, {"enum": [...]}, {"literal": [...]},
    {"list": T}, {"dict": [K, V]}, {"union": [...]}, "any" (a nested dataclass or a class
    TRL checks itself)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "none"
    if hint is Any:
        return "any"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": [m.value for m in hint]}
    if isinstance(hint, type) and hint in (bool, int, float, str):
        return hint.__name__
    if hint in (dict, list):
        return {"dict": ["any", "any"]} if hint is dict else {"list": "any"}
    if origin is Literal:
        return {"literal": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"union": [encode(a) for a in args]}
    if origin is list:
        return {"list": encode(args[0]) if args else "any"}
    if origin is dict:
        return {"dict": [encode(a) for a in args] if args else ["any", "any"]}
    return "any"


def decode(spec) -> Any:
    """The annotation `encode` wrote, for pydantic: an enum as a Literal of its values."""
    if isinstance(spec, str):
        return {"none": type(None), "any": Any, "bool": bool, "int": int, "float": float, "str": str}[spec]
    kind, value = next(iter(spec.items()))
    if kind in ("enum", "literal"):
        return Literal[tuple(value)]
    if kind == "list":
        return list[decode(value)]
    if kind == "dict":
        return dict[decode(value[0]), decode(value[1])]
    return typing.Union[tuple(decode(v) for v in value)]


def annotation(cls_name: str, key: str):
    return decode(snapshot()["classes"][cls_name][key]["type"])


def jsonable(value) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def write_snapshot(path: Path = SNAPSHOT) -> dict:
    """The installed TRL's fields, as the snapshot file holds them."""
    import trl

    classes = {}
    for name in CLASSES:
        cls = getattr(trl, name)
        hints = typing.get_type_hints(cls)
        classes[name] = {f.name: {"type": encode(hints[f.name]),
                                  "default": jsonable(f.default_factory() if f.default is dataclasses.MISSING
                                                      else f.default)}
                         for f in dataclasses.fields(cls) if f.init}
    data = {"trl": trl.__version__, "classes": classes}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


# --- TRL's invariants for PLAIN blocks ------------------------------------------------------
def plain(options: dict) -> bool:
    """Whether every option is PLAIN, with no value TRL treats specially."""
    return all(key in PLAIN and not (isinstance(value, typing.Hashable) and value in SPECIAL.get(key, ()))
               for key, value in options.items())


def enum_values(spec) -> list:
    """The values of the enum a field's type names (`IntervalStrategy | str`), else []."""
    members = spec.get("union", [spec]) if isinstance(spec, dict) else []
    return next((m["enum"] for m in members if isinstance(m, dict) and "enum" in m), [])


def fast_verdict(cls_name: str, options: dict, world: int) -> str | None:
    """What building `cls_name(**options)` at `world` ranks would refuse ("" if nothing), or
    None when the block is not PLAIN (or there is no snapshot): build it with TRL then.
    Types and bounds are checked before (trl_bridge)."""
    if snapshot() is None or not plain(options):
        return None
    for key, value in options.items():  # an enum option TRL takes as a string: one of its values
        choices = enum_values(snapshot()["classes"][cls_name][key]["type"])
        if choices and value not in choices:
            return f"{value!r} is not a valid {key}; choose one of {', '.join(map(str, choices))}"
    if cls_name != "GRPOConfig":
        return ""
    option = lambda key: options.get(key, default(cls_name, key))  # noqa: E731
    generation = option("per_device_train_batch_size") * world * option("gradient_accumulation_steps")
    if generation % option("num_generations"):
        return (f"generation_batch_size ({generation}) must be divisible by num_generations "
                f"({option('num_generations')})")
    return ""


if __name__ == "__main__":
    written = write_snapshot()
    print(f"{SNAPSHOT}: TRL {written['trl']}, " + ", ".join(f"{c} {len(f)} options" for c, f in written["classes"].items()))
