"""A Hugging Face model's config.json: reading it, and the fields the KV-cache arithmetic
(posttrain/capacity/kv.py) and the training-memory plan (posttrain/capacity/memory.py) both read."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.yamlfile import show

GIB = 2**30
LARGEST_DIMENSION = 2**24  # bound on every count and width read here: no model comes near (vocabularies ~10^5-10^6)
CONFIG_JSON_MAX_BYTES = 16 * 2**20  # a config.json is a few KiB; a huge file is not one
FIELD_FIX = "correct that field of config.json (save_pretrained writes it), or pass another model"


class BadField(ValueError):
    """A config.json field the arithmetic reads holds what no model has (4.0 layers, 10^400
    words, 3 KV heads for 4 heads): the model could not load either, so a check refuses it."""


def field_refused(model: str | Path, err: BadField):
    """The one-line `UserError` for a bad field of `model`'s config.json (a folder or the file)."""
    from posttrain.errors import UserError

    return UserError(str(model), f"config.json: {err}", FIELD_FIX)


def text_config(config: dict) -> dict:
    """The language model's part of a (possibly multimodal) config; ValueError when it is
    not a JSON object."""
    cfg = (config.get("text_config") or config) if isinstance(config, dict) else config
    if not isinstance(cfg, dict):
        raise ValueError("the config is not a JSON object")
    return cfg


def positive(cfg: dict, field: str, default=None) -> int:
    """`cfg[field]` (`default` where it is absent or null) as a whole number in
    1..LARGEST_DIMENSION; KeyError when absent without a default, BadField naming the
    field when not such a number (a float such as 4.0 or 1e30 included: transformers
    builds layers with range(), which takes integers only)."""
    value = default if default is not None and cfg.get(field) is None else cfg[field]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LARGEST_DIMENSION:
        raise BadField(f"{field} must be a whole number from 1 to {LARGEST_DIMENSION:,}, got {show(value)}")
    return value


def count(cfg: dict, field: str) -> int:
    """An optional count (experts, say): 0 where absent, null or 0, else `positive`."""
    return positive(cfg, field) if cfg.get(field) not in (None, 0) else 0


def head_counts(config: dict) -> tuple[int, int]:
    """(query heads, KV heads): both at least 1, and the KV heads dividing the query heads."""
    cfg = text_config(config)
    heads = positive(cfg, "num_attention_heads")
    kv_heads = positive(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise BadField(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    return heads, kv_heads


def load_config_json(model: str | Path) -> dict:
    """`config.json` from a model folder or the file itself. FileNotFoundError when there is
    none; ValueError when it is not a regular file of at most CONFIG_JSON_MAX_BYTES holding
    JSON (a FIFO would block the read, a huge file take minutes, deep nesting overflow the parser)."""
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(str(path))
    if not path.is_file():
        raise ValueError(f"{path.name} is not a regular file")
    if path.stat().st_size > CONFIG_JSON_MAX_BYTES:
        raise ValueError(f"{path.name} is {path.stat().st_size:,} bytes, over the {CONFIG_JSON_MAX_BYTES:,} a "
                         "model's config.json could need")
    try:
        return json.loads(path.read_text())
    except RecursionError:
        raise ValueError(f"{path.name} nests too deeply to be a model's config.json") from None
