"""Where a training stage keeps its resumable checkpoints.

Checkpoints live outside the stage's DVC outputs (DVC deletes outputs before rerunning
a stage). The folder is keyed by a fingerprint of the stage's settings and inputs, so
a rerun after a crash resumes, while a rerun with changed settings or data starts over
instead of resuming someone else's run. It is deleted once the stage has finished.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path


def _identity(path: Path) -> list:
    """(name, size, mtime_ns) of every file under `path`: changes whenever it is rewritten."""
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def fingerprint(settings, inputs: list[str | Path]) -> str:
    """12 hex digits identifying `settings` (JSON-able) and the current state of `inputs`."""
    blob = json.dumps([settings, [_identity(Path(p)) for p in inputs]], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def run_dir(root: str | Path, settings, inputs: list[str | Path]) -> str:
    """The checkpoint folder for this run; stale folders of other runs are removed."""
    root = Path(root)
    current = root / fingerprint(settings, inputs)
    if root.is_dir():
        for stale in root.iterdir():
            if stale != current:
                shutil.rmtree(stale, ignore_errors=True)
    return str(current)


def clear(root: str | Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
