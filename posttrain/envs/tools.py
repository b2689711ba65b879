"""Tool environments: the model acts over several turns, the environment answers.

A tool environment is an environment (posttrain.envs.base: `generate`, `parse`, `verify`)
with one attribute more:
- `episode`: a class (or a function returning an instance) in the shape TRL's
  `GRPOTrainer(environment_factory=...)` takes, so a TRL environment runs unchanged: one
  instance per episode; `reset(**row) -> str | None` starts an episode (a string is
  appended to the user turn); every other public method is a tool, with typed arguments
  and a docstring whose `Args:` section describes each (transformers' `get_json_schema`
  turns it into the schema the chat template shows the model); an optional
  `get_reward() -> float` scores the episode from the instance's own state (TRL adds it
  as a reward channel of weight 1).
Optional: `max_turns` (the tool-calling rounds an episode may take).

The episode's verdict, the ground truth of the gate and the evaluation, is `verify` on
the episode's last assistant reply, as for a single-turn environment.

posttrain runs every tool under `guard`: a call that runs past its time limit, raises,
or returns more than the size cap becomes an error or a truncated reply that goes back
to the model as the tool's result (TRL's loop already turns an exception into
`{"error": ...}`), and the episode is scored; never a crash or a hang. `tool_problems`
is what `posttrain check` refuses before compute.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import reprlib
import signal
import sys
import threading
from dataclasses import dataclass

NOT_TOOLS = ("reset", "get_reward")


@dataclass(frozen=True)
class ToolLimits:
    """What one tool call may take: wall seconds, and characters of reply (the rest is cut)."""
    seconds: float = 5.0
    max_chars: int = 2000


class ToolTimeout(Exception):
    pass


def is_tool_env(env) -> bool:
    return getattr(env, "episode", None) is not None


def episode_class(factory) -> type:
    """The class of the instances `factory` (a class, or a function returning an instance) builds."""
    return factory if isinstance(factory, type) else type(factory())


def tool_names(cls: type) -> list[str]:
    """The tools of an episode class, as TRL finds them: its public functions but reset and get_reward."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS]


def tool_problems(factory) -> list[str]:
    """Why an episode class cannot run as a tool environment, one line each (empty when it can):
    no `reset`, no tools, a tool transformers cannot describe to the model (an argument
    without a type, a missing docstring or `Args:` entry)."""
    from transformers.utils import get_json_schema

    cls = episode_class(factory)
    problems = []
    if not callable(getattr(cls, "reset", None)):
        problems.append(f"{cls.__name__} has no reset(**row) method (TRL calls it to start each episode)")
    names = tool_names(cls)
    if not names:
        problems.append(f"{cls.__name__} has no tools: public methods other than reset and get_reward")
    for name in names:
        try:
            get_json_schema(getattr(cls, name))
        except Exception as err:  # transformers' DocstringParsingException / TypeHintParsingException
            problems.append(f"tool {cls.__name__}.{name}: {str(err).splitlines()[0]}")
    return problems


def guard(factory, limits: ToolLimits = ToolLimits()):
    """A factory of guarded episodes: each wraps one instance of `factory`'s and exposes
    the same `reset`, tools (same names, signatures and docstrings, so TRL and the chat
    template see the same schema) and `get_reward`, each tool call under `limits`.
    A guarded episode counts its tool calls and failed calls (`tool_calls`,
    `tool_errors`) since its last reset: reward channels read them."""
    cls = episode_class(factory)
    namespace = {"__doc__": cls.__doc__, "__init__": _init, "reset": _reset, "_factory": staticmethod(factory),
                 "_limits": limits}
    for name in tool_names(cls):
        namespace[name] = _guarded_tool(getattr(cls, name), name)
    if callable(getattr(cls, "get_reward", None)):
        namespace["get_reward"] = _get_reward
    # the user's class name: TRL names the get_reward channel after it
    return type(cls.__name__, (), {**namespace, "__qualname__": f"guarded {cls.__qualname__}"})


def _init(self):
    self.inner = self._factory()
    self.tool_calls = 0
    self.tool_errors = 0


def _reset(self, **row):
    """The episode's reset; what it returns (appended to the question) as text of at most
    `max_chars`, whatever it was; what it prints goes to stderr, never stdout."""
    self.tool_calls = 0
    self.tool_errors = 0
    with contextlib.redirect_stdout(sys.stderr):
        observation = self.inner.reset(**row)
    return None if observation is None else cap(as_text(observation, self._limits.max_chars), self._limits.max_chars)


def _get_reward(self):
    return self.inner.get_reward()


def _guarded_tool(function, name: str):
    @functools.wraps(function)
    def tool(self, *args, **kwargs):
        self.tool_calls += 1
        try:
            with contextlib.redirect_stdout(sys.stderr):  # a tool's prints are not the process's output
                result = call_with_limit(getattr(self.inner, name), args, kwargs, self._limits.seconds)
        except BaseException as err:
            if not isinstance(err, Exception):  # SystemExit, KeyboardInterrupt of the tool's own making
                err = RuntimeError(f"{type(err).__name__} {err}")
            self.tool_errors += 1
            raise RuntimeError(cap(f"{type(err).__name__}: {err}", self._limits.max_chars)) from None
        return cap(as_text(result, self._limits.max_chars), self._limits.max_chars)

    return tool


def as_text(value, max_chars: int) -> str:
    """A tool's result as the model reads it: a string as it is, anything else by a repr that
    stops at `max_chars` and at cycles (a recursive or 10^7-item structure costs no more)."""
    if isinstance(value, str):
        return value
    shown = reprlib.Repr()  # Python 3.11's takes no keywords
    shown.maxlevel, shown.maxstring, shown.maxlong, shown.maxother = 8, max_chars, max_chars, max_chars
    for name in ("maxdict", "maxlist", "maxtuple", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
        setattr(shown, name, 256)
    try:
        return shown.repr(value)  # a __repr__ that raises is shown as `<Type instance at ...>`
    except Exception as err:  # one that raises where reprlib does not catch it (a container's)
        return f"(a {type(value).__name__} that cannot be shown: {type(err).__name__})"


def cap(text: str, max_chars: int) -> str:
    """`text`, cut to `max_chars` with a note of how much was cut."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [cut: {len(text) - max_chars} more characters]"


def call_with_limit(function, args, kwargs, seconds: float):
    """`function(*args, **kwargs)`, stopped with ToolTimeout after `seconds`.

    In the main thread a real-time timer interrupts it (SIGALRM: a busy loop or a sleep
    stops at once); elsewhere it runs in a daemon thread that is abandoned at the limit."""
    if threading.current_thread() is threading.main_thread():
        def expired(signum, frame):
            raise ToolTimeout(f"the tool ran past its {seconds:g} s limit")

        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return function(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict = {}

    def run():
        try:
            box["result"] = function(*args, **kwargs)
        except BaseException as err:  # handed to the caller below
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise ToolTimeout(f"the tool ran past its {seconds:g} s limit")
    if "error" in box:
        raise box["error"]
    return box["result"]


def tool_schemas(factory) -> list[dict]:
    """The JSON schemas the chat template shows the model for the episode's tools (the
    same TRL renders from the instance's methods)."""
    from transformers.utils import get_json_schema

    cls = episode_class(factory)
    return [get_json_schema(getattr(cls, name)) for name in tool_names(cls)]


def tool_limits(config) -> ToolLimits:
    """The config's limits on one tool call (`data.tool_limits`), the defaults without it."""
    section = getattr(config.data, "tool_limits", None)
    return ToolLimits(**section.model_dump()) if section is not None else ToolLimits()
