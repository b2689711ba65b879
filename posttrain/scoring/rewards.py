"""Reward channels and guardrails, open-r1 style: pure functions of the completions.

A channel is `(completions, **columns) -> list[float]`, made by a small factory from an
environment and looked up in `REWARDS` by the name the config uses. Each declares its
range, so a guardrail can pin a completion to the stage's minimum. TRL's GRPOTrainer
calls channels with the dataset's columns (`answer`, ...) as keyword arguments, and
logs each one's mean as `rewards/<name>/mean`.

A guardrail is `(completions, **columns) -> list[bool]` (True = broken). Guardrails are
rules, not weights: a completion that breaks one gets every channel's minimum, so its
reward is the stage's minimum under both TRL aggregations (summing weighted channels,
or normalising each channel within its group first, GDPO). The hit rate is logged per
step as `guardrails/<name>/hit_rate` through TRL's `log_metric` hook.

A stage may name its own channels and guardrails by import path, as TRL's CLI takes
reward functions (`rewards: {custom.rewards:brevity: 0.2}`): a reward function
`(completions, **columns) -> list[float]` (its `low` and `high` attributes give its
range, default 0..1), or a `Channel` (made from the environment); a guardrail function
`(completions, **columns) -> list[bool]`. Their curves are logged under the import path
with `.` for `:`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from posttrain.chat import completion_texts
from posttrain.envs.base import Environment
from posttrain.plugins import PluginError, lookup
from posttrain.yamlfile import show

RewardFn = Callable[..., list[float]]
GuardFn = Callable[..., list[bool]]


class Channel(NamedTuple):
    make: Callable[[Environment], RewardFn]
    low: float   # the channel's minimum: what a guardrail violation scores
    high: float


def correctness(env: Environment) -> RewardFn:
    """1.0 when the verifier accepts the completion, else 0.0."""
    def correctness(completions, answer, **_):
        return [float(env.verify(c, a)) for c, a in zip(completions, answer)]
    return correctness


def parseable(env: Environment) -> RewardFn:
    """1.0 when the environment's parser can read an answer from the completion."""
    def parseable(completions, **_):
        return [float(env.parse(c) is not None) for c in completions]
    return parseable


def digit_overlap(predicted: str | None, answer: str) -> float:
    """Share of digit positions right, aligned from the units digit, over the longer length.

    A dense signal for numeric answers: `84` for `85` scores 0.5, `185` for `85` 0.67.
    """
    if predicted is None:
        return 0.0
    width = max(len(predicted), len(answer))
    matches = sum(p == a for p, a in zip(reversed(predicted), reversed(answer)))
    return matches / width


def digits(env: Environment) -> RewardFn:
    """Partial credit per correct digit of the parsed answer (0..1)."""
    def digits(completions, answer, **_):
        return [digit_overlap(env.parse(c), a) for c, a in zip(completions, answer)]
    return digits


def similarity(env: Environment) -> RewardFn:
    """String similarity (difflib ratio, 0..1) of the completion to the reference answer.

    A cheap proxy that looks reasonable and is hackable: `age>35` and `age<35` are 83%
    alike and return opposite rows. It is here to show what the reward-hacking sentinel
    catches; train on `correctness` (execution) instead.
    """
    from difflib import SequenceMatcher

    def similarity(completions, answer, **_):
        return [SequenceMatcher(None, c.strip(), a).ratio() for c, a in zip(completions, answer)]
    return similarity


def format_channel(env: Environment) -> RewardFn:
    """1.0 when the completion keeps the task's format: the environment's `format_ok`
    (the dataset environment: `format_pattern`, else `answer_pattern` found), else
    whether its parser reads an answer."""
    ok = getattr(env, "format_ok", None) or (lambda c: env.parse(c) is not None)

    def format(completions, **_):
        return [float(bool(ok(c))) for c in completions]
    return format


LENGTH_SCALE = 1000  # characters: the length cost reaches its floor (-1) there


def length(env: Environment) -> RewardFn:
    """A length cost: -characters / 1000, at most -1. Weight it small (0.05-0.2) beside
    correctness to prefer the shorter of two right answers."""
    def length(completions, **_):
        return [-min(1.0, len(c) / LENGTH_SCALE) for c in completions]
    return length


def tool_use(env: Environment) -> RewardFn:
    """A tool environment's episodes: 1.0 when the episode called a tool at all (TRL passes
    the episodes' guarded instances as `environments`; 0.0 without them)."""
    def tool_use(completions, environments=None, **_):
        return [float(getattr(e, "tool_calls", 0) > 0) for e in environments] if environments else \
            [0.0] * len(completions)
    return tool_use


def tool_errors(env: Environment) -> RewardFn:
    """A tool environment's episodes: minus the share of the episode's tool calls that
    failed (raised, timed out, named no tool), 0 for an episode without calls."""
    def tool_errors(completions, environments=None, **_):
        if not environments:
            return [0.0] * len(completions)
        return [-getattr(e, "tool_errors", 0) / max(1, getattr(e, "tool_calls", 0)) for e in environments]
    return tool_errors


REWARDS: dict[str, Channel] = {
    "correctness": Channel(correctness, 0.0, 1.0),
    "parseable": Channel(parseable, 0.0, 1.0),
    "digits": Channel(digits, 0.0, 1.0),
    "similarity": Channel(similarity, 0.0, 1.0),
    "format": Channel(format_channel, 0.0, 1.0),
    "length": Channel(length, -1.0, 0.0),
    "tool_use": Channel(tool_use, 0.0, 1.0),
    "tool_errors": Channel(tool_errors, -1.0, 0.0),
}


def unparseable(env: Environment) -> GuardFn:
    """Broken when the environment's parser finds no answer (a format contract)."""
    def unparseable(completions, **_):
        return [env.parse(c) is None for c in completions]
    return unparseable


def overlong(env: Environment, max_chars: int = 8) -> GuardFn:
    """Broken when the completion is longer than `max_chars` characters."""
    def overlong(completions, **_):
        return [len(c) > max_chars for c in completions]
    return overlong


GUARDRAILS: dict[str, Callable[[Environment], GuardFn]] = {"unparseable": unparseable, "overlong": overlong}


def _by_name(name: str, registry: dict, what: str, signature: str):
    """`registry[name]`, else the function (or Channel) an import path names; PluginError
    (one line, with the fix) otherwise."""
    found = lookup(name, registry, what, "package.module:function")
    if not (callable(found) or isinstance(found, Channel)):
        raise PluginError(f"{show(name)} is a {type(found).__name__}, not a function", f"name a {what} {signature}")
    return found


def reward_channel(name: str) -> Channel:
    """The channel `name` names: a built-in (REWARDS) or an import path to a Channel or a
    reward function (its `low` / `high` attributes give its range, default 0..1)."""
    found = _by_name(name, REWARDS, "reward channel", "(completions, **columns) -> list[float]")
    if isinstance(found, Channel):
        return found
    return Channel(lambda env: found, float(getattr(found, "low", 0.0)), float(getattr(found, "high", 1.0)))


def guardrail(name: str) -> Callable[[Environment], GuardFn]:
    """The guardrail `name` names: a built-in (GUARDRAILS) or an import path to a function."""
    if name in GUARDRAILS:
        return GUARDRAILS[name]
    found = _by_name(name, GUARDRAILS, "guardrail", "(completions, **columns) -> list[bool]")
    return lambda env: found


def curve_name(name: str) -> str:
    """The name TRL logs a channel's curve under (`rewards/<name>/mean`): MLflow keys take no `:`."""
    return name.replace(":", ".")


class GuardHits:
    """The guardrails' verdicts on one batch, computed once for all the stage's channels:
    TRL (and the evaluate stage) call every channel with the same completions and columns
    objects, so the last batch is recognised by identity (held, so its ids stay its own)."""

    def __init__(self, guards: dict[str, GuardFn]):
        self.guards, self.batch, self.hits = guards, None, {}

    def __call__(self, completions, columns: dict) -> dict[str, list[bool]]:
        batch = (completions, columns)
        if self.batch is None or self.batch[0] is not completions or self.batch[1].keys() != columns.keys() \
                or any(self.batch[1][k] is not v for k, v in columns.items()):
            texts = completion_texts(completions)
            self.hits = {name: guard(texts, **columns) for name, guard in self.guards.items()}
            self.batch = batch
        return self.hits


def guarded(name: str, channel: Channel, env: Environment, guards: GuardHits, log: bool) -> RewardFn:
    """The channel, with every completion that breaks a guardrail pinned to its minimum.

    `log`: whether this wrapper reports the guardrails' hit rates (one channel does).
    """
    score = channel.make(env)

    def reward(completions, **columns):
        hits = guards(completions, columns)
        completions = completion_texts(completions)  # TRL passes messages for conversational prompts
        values = score(completions, **columns)
        broken = [any(flags) for flags in zip(*hits.values())] if hits else [False] * len(completions)
        if log and "log_metric" in columns:
            for guard_name, flags in hits.items():
                columns["log_metric"](f"guardrails/{curve_name(guard_name)}/hit_rate", sum(flags) / max(1, len(flags)))
        return [channel.low if b else v for b, v in zip(broken, values)]

    reward.__name__ = curve_name(name)  # TRL names the logged curve after the function
    return reward


def build_rewards(env: Environment, channels: dict[str, float] | list[str],
                  guardrails: list[str] = ()) -> tuple[list[RewardFn], list[float]]:
    """The stage's reward functions and weights, in config order, guardrails applied."""
    weights = channels if isinstance(channels, dict) else {name: 1.0 for name in channels}
    guards = GuardHits({name: guardrail(name)(env) for name in guardrails})
    funcs = [guarded(name, reward_channel(name), env, guards, log=(i == 0)) for i, name in enumerate(weights)]
    return funcs, [float(w) for w in weights.values()]
