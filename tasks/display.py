"""What the terminal shows while a stage runs: its progress (posttrain.progress lines),
not its raw output, which goes to the stage's log.

On a terminal: a live display (rich) of the stage's current phase (training, the
pass-rate filter, a gate, sampling, the vLLM start) with its step and total, the latest
loss and reward, the elapsed time and an estimate of what is left. Elsewhere (CI, a
Prefect worker, a file): a plain line when a phase starts and at each further 10% of it.
"""

from __future__ import annotations

import logging
import sys
import time

from posttrain.errors import StageFailed
from posttrain.tracking.summary import duration

def figures(event: dict) -> str:
    return ", ".join(f"{k} {event[k]:.4g}" for k in ("loss", "reward") if k in event)


class StageDisplay:
    """One stage's progress on the terminal, for the `with` block its command runs in."""

    def __init__(self, stage: str, stream=None):
        from rich.console import Console

        self.stage, self.stream = stage, stream or sys.stdout
        self.console = Console(file=self.stream)
        self.live = self.console.is_terminal
        self.phase, self.started, self.shown, self.done = None, 0.0, 0, 0  # shown: tenths of the phase
        self.bar = self.task = None

    def __enter__(self):
        if self.live:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[figures]}"), TimeElapsedColumn(), TextColumn("elapsed,"),
                                TimeRemainingColumn(), TextColumn("left"), console=self.console, transient=True)
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False

    def update(self, event: dict) -> None:
        phase, done, total = event["phase"], int(event.get("done") or 0), event.get("total")
        new_phase, new_loop = phase != self.phase, bool(total) and done < self.done  # a loop in it starts again
        self.done = done
        if new_phase or new_loop:
            # a loop's first update starts its clock: its line comes at the next tenth, with a real estimate
            self.phase, self.started = phase, time.monotonic()
            self.shown = 10 * done // total if new_loop else 0
            if self.bar is not None:
                if self.task is not None:
                    self.bar.remove_task(self.task)
                self.task = self.bar.add_task(f"{self.stage} {phase}", total=total, figures="")
            elif new_phase:
                self.plain(f"{self.stage}: {phase}")
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total, figures=figures(event))
            return
        tenth = 10 * done // total if total else 0
        if not total or (tenth <= self.shown and done < total):
            return
        self.shown = tenth
        elapsed = time.monotonic() - self.started
        left = f", about {duration(elapsed * (total - done) / done)} left" if 0 < done < total else ""
        extra = figures(event)
        self.plain(f"{self.stage}: {phase} {done:,}/{total:,} ({done / total:.0%}){', ' + extra if extra else ''}; "
                   f"{duration(elapsed)}{left}")

    def plain(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def echo(self, line: str) -> None:
        """A line of the stage's own that the terminal shows (posttrain's messages)."""
        if self.bar is not None:
            self.bar.console.print(line.rstrip("\n"), markup=False, highlight=False)
        else:
            self.plain(line.rstrip("\n"))


class StageFailureFormatter(logging.Formatter):
    """Prefect's console format, without the traceback of a failed stage (StageFailed):
    its one line says which stage failed, with what and where its output is; the stage's log
    and the task run (Prefect's API handler keeps the traceback) hold the rest."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info and isinstance(record.exc_info[1], StageFailed)):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info = record.exc_text = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def quiet_stage_failures() -> None:
    """Prefect's console handlers show a failed stage as lines, not tracebacks (Prefect logs
    each failed task and flow run with its traceback: three of them for one stage)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    for handler in {h for logger in loggers for h in getattr(logger, "handlers", ())}:  # Prefect's is the root's
        if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, StageFailureFormatter):
            handler.setFormatter(StageFailureFormatter(handler.formatter))
