"""A Hugging Face model's config.json: reading it, and the fields the KV-cache arithmetic
(posttrain/kv.py) and the training-memory plan (posttrain/memory.py) both read."""

from __future__ import annotations

import json
import math
from pathlib import Path

GIB = 2**30


def text_config(config: dict) -> dict:
    """The language model's part of a (possibly multimodal) config; ValueError when it is
    not a JSON object."""
    cfg = (config.get("text_config") or config) if isinstance(config, dict) else config
    if not isinstance(cfg, dict):
        raise ValueError("the config is not a JSON object")
    return cfg


def positive(cfg: dict, field: str, default=None) -> int:
    """`cfg[field]` (`default` where it is absent or null) as a whole number >= 1; KeyError
    when absent without a default, ValueError when not such a number."""
    value = default if default is not None and cfg.get(field) is None else cfg[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < 1:
        raise ValueError(f"{field} must be a whole number of at least 1, got {value!r}")
    return int(value)


def head_counts(config: dict) -> tuple[int, int]:
    """(query heads, KV heads): both at least 1, and the KV heads dividing the query heads."""
    cfg = text_config(config)
    heads = positive(cfg, "num_attention_heads")
    kv_heads = positive(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    return heads, kv_heads


def load_config_json(model: str | Path) -> dict:
    """`config.json` from a model folder or the file itself."""
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    return json.loads(path.read_text())
