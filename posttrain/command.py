"""How every `posttrain` command starts and ends, the CLI's and a stage's alike: offline
defaults, standard streams that mask passwords, and bad input as one line on stderr with
its exit code (2: bad input, 3: a gate failed, 4: replay failed, 1: training or a stage
failed), no traceback. No printed message carries a password.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from posttrain.errors import GateFailure, ReplayError, StageFailed, TrainingFailed, UserError
from posttrain.redact import guard_standard_streams, redact_text

# Offline by default: real models are local paths; Prefect and DVC send no telemetry.
OFFLINE_DEFAULTS = {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


def run_command(work: Callable[[], int | None]) -> int:
    """Run one command's `work`: its exit code (None: 0), or the one-line refusal's."""
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    guard_standard_streams()  # libraries print tracking URIs, passwords included (MLflow's "View run")
    try:
        code = work() or 0
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:
        if not reader_gone():
            raise
        return quiet_after_reader_gone()
    except UserError as err:
        return refuse("error", err, 2)
    except GateFailure as err:
        return refuse("gate failed", err, 3)
    except ReplayError as err:
        return refuse("replay failed", err, 4)
    except TrainingFailed as err:
        return refuse("training failed", err, 1)
    except StageFailed as err:
        return refuse("stage failed", err, 1)


def reader_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it (`posttrain memory ... | head -1`), as
    opposed to a broken socket of a server's (which stays an error)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor (a test's StringIO)
        return False


def quiet_after_reader_gone() -> int:
    """End as `cat` does when its reader leaves: no traceback, exit 128 + SIGPIPE. stdout goes
    to /dev/null first, so the interpreter's flush at exit finds nothing to fail on (the
    Python docs' recipe, signal module, "Note on SIGPIPE")."""
    import signal

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def refuse(kind: str, err: Exception, code: int) -> int:
    """Print the one-line reason, passwords masked (library errors quote URIs whole)."""
    print(redact_text(f"posttrain: {kind}: {err}"), file=sys.stderr)
    return code
