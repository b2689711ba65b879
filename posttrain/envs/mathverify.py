"""HF math-verify (open-r1's verifier) with a time limit that holds on any thread.

math-verify bounds its own work with SIGALRM, which only a main thread may set (a Prefect
task runs in a worker thread) and which cannot stop one long C call: `9^{9^{9^{9}}}` asks
sympy for a number of 370 million digits. So every parse and comparison runs in a worker
process (posttrain.sandbox.Worker, reused from call to call) that is killed when a call
runs past MATH_TIMEOUT_S, and text nested deeper than MAX_LATEX_DEPTH is not sent at all.
A call over either limit raises MathLimit: the dataset environment scores the completion
unparseable and counts it.

Measured on this machine: a boxed answer parses in ~20 ms, a 30-deep fraction in 0.3 s, a
200-deep one in 1.3 s, a 500-deep group in 5 s; the worker starts in ~1 s (sympy).
"""

from __future__ import annotations

import functools
import os
import sys

MATH_TIMEOUT_S = 2.0   # per parse or verification (math-verify's own defaults: 5 s each)
KILL_GRACE_S = 0.2     # past the limit before the worker is killed
MAX_LATEX_DEPTH = 50   # nested brackets ({, (, [) a text may have to be parsed at all
WORKER_ADDRESS_BYTES = 2 << 30  # the worker's address space: a runaway sympy number fails, not the machine
_OPEN, _CLOSE = "{([", "})]"


class MathLimit(Exception):
    """The text is nested too deeply, or math-verify ran past its time limit on it."""


def nesting_depth(text: str) -> int:
    """How deeply brackets nest in `text` (an unmatched closing one is ignored)."""
    depth = deepest = 0
    for char in text:
        if char in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif char in _CLOSE and depth:
            depth -= 1
    return deepest


def parse(text: str) -> str | None:
    """The answer math-verify reads in `text`, as text (None when it finds none)."""
    return _call(("parse", text))


def verify(answer: str, text: str) -> bool:
    """Whether `text` gives the reference `answer` (plain or LaTeX), per math-verify."""
    return _call(("verify", answer, text))


def _call(request: tuple):
    for text in request[1:]:
        if nesting_depth(text) > MAX_LATEX_DEPTH:
            raise MathLimit(f"nested more than {MAX_LATEX_DEPTH} brackets deep")
    kind, value = _worker().call(request, deadline_s=MATH_TIMEOUT_S + KILL_GRACE_S, limit_s=MATH_TIMEOUT_S)
    if kind == "error":
        raise MathLimit(value)
    return value


@functools.cache
def _worker():
    """This process's math-verify worker (a forked child starts its own)."""
    import atexit

    from posttrain.sandbox import Worker

    # -I: neither the environment nor the current folder decides what the worker imports
    worker = Worker([sys.executable, "-I", __file__])
    atexit.register(worker.close)
    os.register_at_fork(after_in_child=worker.forget)
    return worker


# --- in the worker --------------------------------------------------------------------
def _serve(fd: int) -> None:
    """Import math-verify (before "ready": its import is not a call's time), then answer
    each request until the caller goes."""
    import resource
    import signal

    from posttrain.sandbox import serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; the worker ends on EOF
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_BYTES, WORKER_ADDRESS_BYTES))
    except (ValueError, OSError):
        pass  # the deadline still holds
    import math_verify

    serve(fd, functools.partial(_reply, math_verify))


def _reply(math_verify, request: tuple) -> tuple:
    try:
        return "ok", _answer(math_verify, *request)
    except BaseException as err:  # noqa: BLE001 - any failure scores the text as wrong, never ends the worker
        return "error", f"{type(err).__name__}: {err}"[:200]


def _answer(math_verify, kind: str, *texts: str):
    # the worker's kill is the time limit: math-verify's own (SIGALRM) is off
    if kind == "parse":
        parsed = math_verify.parse(texts[0], parsing_timeout=None)
        return str(parsed[1] if len(parsed) > 1 else parsed[0]) if parsed else None
    answer, text = texts
    gold = _gold(math_verify, answer)
    guess = math_verify.parse(text, parsing_timeout=None)
    return bool(gold and guess and math_verify.verify(list(gold), guess, timeout_seconds=None))


@functools.lru_cache(maxsize=65536)
def _gold(math_verify, answer: str) -> tuple:
    """A reference answer parsed once: every sample of a prompt is verified against it."""
    return tuple(math_verify.parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=None))


if __name__ == "__main__":
    # -I left the current folder off the path: the posttrain this file belongs to goes first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    _serve(int(sys.argv[1]))
