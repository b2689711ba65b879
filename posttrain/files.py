"""JSON and JSON-lines files: what stages read and write (metrics written atomically)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fh.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)


def write_json(path: str | Path, data) -> None:
    """Write atomically, so a crash never leaves a half-written metrics file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())
