"""GPU profiles: name -> memory per GPU and a reserve taken before the KV cache (GiB).

The serving check and `posttrain kv` look a profile up by name. A folder may hold its
own `gpus.yaml` (a workspace's `configs/`, a config's folder); otherwise the copy that
ships in the package is used, so an unknown GPU is an error wherever a command runs.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PACKAGED = Path(__file__).with_name("gpus.yaml")


class GPUProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    memory_gib: float = Field(..., gt=0, description="Memory per GPU as the driver reports it (GiB).")
    reserve_gib: float = Field(..., ge=0, description="Activations and runtime, taken before KV (GiB).")


def profiles_path(folder: str | Path) -> Path:
    """`folder/gpus.yaml` when there is one, else the package's."""
    local = Path(folder) / "gpus.yaml"
    return local if local.is_file() else PACKAGED


def load_profiles(path: str | Path) -> dict[str, dict]:
    """Name -> profile (as plain dicts) from `path`; `UserError` when it is not a
    mapping of names to `{memory_gib, reserve_gib}`."""
    from posttrain.yamlfile import read_yaml, schema_error

    try:
        profiles = TypeAdapter(dict[str, GPUProfile]).validate_python(read_yaml(Path(path)) or {})
    except ValidationError as err:
        raise schema_error(str(path), err) from None
    return {name: profile.model_dump() for name, profile in profiles.items()}


def load_gpu_profile(path: str | Path, name: str) -> dict:
    """The profile `name` in the profiles file `path`: `memory_gib` and `reserve_gib`."""
    from posttrain.errors import UserError

    if not Path(path).is_file():
        raise UserError(str(path), "GPU profiles file not found", f"pass an existing file, e.g. {PACKAGED}")
    profiles = load_profiles(path)
    if name not in profiles:
        raise UserError(str(path), f"unknown GPU profile {name[:60]!r}", f"use one of {sorted(profiles)}")
    return profiles[name]
