"""JSON and JSON-lines files: what stages read and write (metrics written atomically)."""

from __future__ import annotations

import json
import os
from pathlib import Path

MAX_LINE_BYTES = 2**20  # one JSON-lines row; a longer line is refused unparsed


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


def json_lines(fh):
    """(line number, value, problem) for each non-blank line of a JSON-lines file opened
    in binary: the line's JSON value and None, or None and why it is not one (not UTF-8,
    not JSON, longer than MAX_LINE_BYTES: skipped rather than held in memory). A user's
    file is read with it, so a bad line is named, not a parser's traceback."""
    number = 0
    while raw := fh.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            while raw and not raw.endswith(b"\n"):
                raw = fh.readline(MAX_LINE_BYTES + 1)
            yield number, None, f"line longer than {MAX_LINE_BYTES // 2**20} MiB, not parsed"
        elif raw.strip():
            yield number, *_json_value(raw)


def _json_value(raw: bytes):
    """(value, None) for a line of UTF-8 JSON, else (None, why not)."""
    try:
        return json.loads(raw.decode("utf-8")), None
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text (byte {err.start} of the line)"
    except json.JSONDecodeError as err:
        return None, f"not JSON ({err.msg})"
    except ValueError as err:  # a number of 5000 digits: past Python's int-string limit
        return None, f"not JSON this reader accepts ({first_clause(err)})"
    except RecursionError:
        return None, "not JSON this reader accepts (nested too deeply)"


def first_clause(err: Exception) -> str:
    """The error's own words up to the first colon: Python's advice after it is for programmers."""
    return str(err).split(":")[0]
