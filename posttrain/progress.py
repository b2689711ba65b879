"""How far a stage's work has got, as one line per update on stdout.

A stage names the piece of work it is in (`phase`: training, the pass-rate filter, a
gate's evaluation, sampling, the vLLM start; `tracking.compute` names them) and its loops
say how much of it is done (`update`). Each update is one line, `posttrain-progress
{json}`: the flow (tasks/display.py) turns them into its live display and keeps them out
of the stage's log; run by hand (`dvc repro`) they are readable as they are. Lines come
at most every 1% of a phase or every 2 s, whichever is rarer, and always at its end.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

PREFIX = "posttrain-progress "
MIN_SECONDS = 2.0
_state: dict = {"phase": None, "shown": (None, -1, 0.0)}  # (phase, percent, time) last shown


def emit(event: dict) -> None:
    print(PREFIX + json.dumps(event, sort_keys=True), file=sys.stdout, flush=True)


@contextlib.contextmanager
def phase(name: str):
    """The stage is in `name` for the block: an update without a total (the display shows
    its elapsed time) now, and updates from the loops inside it."""
    before = _state["phase"]
    _state["phase"], _state["shown"], _state["done"] = name, (name, 0, time.monotonic()), 0
    emit({"phase": name, "done": 0, "total": None})
    try:
        yield
    finally:
        _state["phase"] = before


def update(done: int, total: int | None, **figures: float) -> None:
    """`done` of `total` units of the current phase (steps, prompts), with figures to show
    (loss, reward). Shown at most every 1% or `MIN_SECONDS`, and at the end."""
    name = _state["phase"]
    if name is None:
        return
    percent = 100 * done // total if total else 0
    shown_phase, shown_percent, shown_at = _state["shown"]
    now = time.monotonic()
    if shown_phase == name and done < _state.get("done", 0):  # a new loop in the phase (the next model's prompts)
        shown_percent, shown_at = 0, now
    _state["done"] = done
    final = bool(total) and done >= total
    if shown_phase == name and not final and (percent <= shown_percent or now - shown_at < MIN_SECONDS):
        _state["shown"] = (name, shown_percent, shown_at)
        return
    _state["shown"] = (name, percent, now)
    emit({"phase": name, "done": done, "total": total,
          **{k: round(float(v), 4) for k, v in figures.items() if v is not None}})


def parse(line: str) -> dict | None:
    """The update a stage's output line carries, or None for any other line."""
    if not line.startswith(PREFIX):
        return None
    try:
        event = json.loads(line[len(PREFIX):])
    except ValueError:
        return None
    return event if isinstance(event, dict) and "phase" in event else None
