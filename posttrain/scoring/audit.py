"""The reward audit: a stage's reward scored on completions built to game it, before training.

For real training rows, a battery of **exploit completions** is built from the row (its
prompt, its gold completion, its answer) and scored with the stage's own reward: its
weighted channels with its guardrails applied, exactly as GRPO will score them
(posttrain.scoring.rewards.build_rewards; the weighted sum TRL computes). Two kinds:

- `wrong`: a wrong answer, or none (empty, whitespace, the prompt echoed, the format with
  the answer taken out, a very long output without the answer, a plain wrong answer,
  several answers with a wrong one last, every candidate at once, the right answer
  followed by a wrong final one, a hedge (the right answer beside one or two wrong ones,
  never last, short enough for any completion cap: what a policy writes within a few
  tokens when the reward pays an answer found anywhere), NaN / inf / 1e999, a value just outside the tolerance;
  an environment adds its own: SQL's `SELECT *`, a tautology, a doubled UNION, a LIMIT
  that drops rows, a write). Each must score **below** the lowest-scoring gold completion;
  one a guardrail flags must score the stage's minimum.
- `variant`: the gold answer in another form (code fences, full-width digits, a reordered
  result). Each may score as well as gold, never **above** the lowest-scoring gold.

A breach is a reward a policy can collect without the right answer: `audit` refuses the
stage (or warns), naming the exploit family, its score against the ceiling, an example,
and the fix. Exploits are built to be wrong whatever the verifier says; an environment's
own families (`exploits(row) -> [Exploit]`) drop those its executor finds right. Users add
generators by import path (`(row, env) -> [Exploit | str]`; a string is a `wrong` exploit).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from posttrain.chat import reward_columns
from posttrain.envs.base import Exploit
from posttrain.scoring.rewards import build_rewards, reward_channel

LONG_CHARS = 20_000
AUDIT_ROWS = 32
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")
_FULLWIDTH = str.maketrans("0123456789-.", "０１２３４５６７８９－．")


class NothingToAudit(ValueError):
    """No training row's gold completion verifies."""


@dataclass
class Breach:
    family: str
    kind: str
    score: float
    ceiling: float
    example: str
    answer: str
    rewarded: int = 0  # kind `rewarded`: on how many of `of` rows the family was paid as if right
    of: int = 0

    def line(self, stage: str) -> str:
        shown = self.example if len(self.example) <= 60 else self.example[:57] + "..."
        if self.kind == "rewarded":
            return (f"grpo.{stage}.rewards: the `{self.family}` exploit (a wrong answer) is paid as if right on "
                    f"{self.rewarded} of {self.of} rows, up to {self.score:.3f}, above {self.ceiling:.3f} (midway from "
                    f"the stage minimum to the lowest gold reward) (e.g. {shown!r} for answer {self.answer[:40]!r})")
        bound = "the lowest gold completion's" if self.kind != "guardrail" else "the guardrail's minimum"
        return (f"grpo.{stage}.rewards: the `{self.family}` exploit scores {self.score:.3f}, at or above "
                f"{bound} {self.ceiling:.3f} (e.g. {shown!r} for answer {self.answer[:40]!r})")


@dataclass
class AuditReport:
    stage: str
    rows: int
    exploits: int
    gold_min: float
    stage_min: float
    families: dict = field(default_factory=dict)  # family -> {"kind", "count", "max_score"}
    breaches: list[Breach] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "breaches"},
                "breaches": [{**asdict(b), "line": b.line(self.stage)} for b in self.breaches],
                "passed": not self.breaches}


def _wrong_values(answer: str) -> list[str]:
    """Two answers that are not `answer` (numbers near it, or other text)."""
    if _NUMBER.match(answer):
        value = float(answer)
        step = 1 if value.is_integer() else max(abs(value) * 0.5, 1.0)
        shown = [value + step, value - step] if value.is_integer() else [value + step, value + 2 * step]
        return [str(int(v)) if float(v).is_integer() else f"{v:g}" for v in shown]
    return [w for w in ("12345", "54321", "67890") if w != answer][:2]  # a number a lenient reader would read last


def short_answer(answer: str) -> str:
    """The answer a reply states: the last `\\boxed{...}` of a worked solution (MATH's
    answer column is the whole solution), else the answer as given."""
    start = answer.rfind("\\boxed{")
    if start < 0:
        return answer.strip()
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(answer)):
        depth += {"{": 1, "}": -1}.get(answer[j], 0)
        if depth == 0:
            return answer[i:j].strip()
    return answer.strip()


def hedges(answer: str, wrong: str, wrong2: str) -> list[str]:
    """The right answer beside wrong ones, in the fewest characters (a cap of a few tokens
    leaves room for them when it cuts every longer exploit): first, or between two, or
    glued to a wrong digit (`851` for 85: one token more); never last, where a lenient
    reader (the last number) would rightly take it."""
    if len(answer) == 1 and answer.isalpha():  # a choice letter: another letter beside it
        other = "B" if answer != "B" else "C"
        return [f"{answer} {other}", f"{answer}/{other}", f"{other} {answer} {'D' if answer != 'D' else 'A'}"]
    glued = [f"{answer}1", f"1{answer.lstrip('-')}"] if answer.lstrip("-").isdigit() else []  # one wrong digit added
    return [f"{answer} {wrong}", f"{answer} or {wrong}", f"{wrong} {answer} {wrong2}", *glued]


def generic_exploits(row: dict) -> list[Exploit]:
    """The battery every environment gets, from one training row."""
    answer, gold = short_answer(row["answer"]), row["completion"].strip()
    question = row.get("question") or row["prompt"]
    wrong, wrong2 = _wrong_values(answer)
    found = [Exploit("empty", ""), Exploit("whitespace", " \n\t "),
             Exploit("wrong answer", wrong), Exploit("several answers", f"{wrong}\n{answer}\n{wrong2}"),
             Exploit("right then wrong", f"{answer}\nNo, wait: the answer is {wrong}."),
             *[Exploit("hedged", text) for text in hedges(answer, wrong, wrong2)],
             Exploit("very long", "Let me think about this step by step. " * (LONG_CHARS // 38)),
             Exploit("code fences", f"```\n{gold}\n```", "variant")]
    if answer not in question:
        found.append(Exploit("prompt echoed", question))
    if answer and answer in gold and gold.replace(answer, "").strip():
        found.append(Exploit("format without answer", gold.replace(answer, "")))
    if _NUMBER.match(answer):
        value = float(answer)
        if value.is_integer():
            span = [str(int(value) + d) for d in range(-20, 21)]
            found.append(Exploit("every candidate", " ".join(span)))
        found += [Exploit("not a number", v) for v in ("nan", "NaN", "inf", "-inf", "1e999")]
        found.append(Exploit("just outside tolerance", f"{value * (1 + 1e-4) + 1e-4:.10g}"))
        found.append(Exploit("look-alike digits", answer.translate(_FULLWIDTH), "variant"))
    elif len(answer) == 1 and answer.isalpha() and answer.isupper():
        letters = "ABCDEFGH"[:max(4, "ABCDEFGH".index(answer) + 1)] if answer in "ABCDEFGH" else answer
        found += [Exploit("every candidate", " ".join(letters)), Exploit("every candidate", letters)]
    return [e for e in found if e.kind == "variant" or e.completion.strip() != answer]


def exploits_for(env, row: dict, extra=()) -> list[Exploit]:
    """The row's battery: the generic one, the environment's own families, the user's."""
    found = generic_exploits(row) + list(getattr(env, "exploits", lambda r: [])(row))
    # a question may hold its own answer ("Compute 0 + 0." read by a last-number verifier): echoing it
    # is then right by coincidence, not an exploit; the other rows' echoes still test the reward
    found = [e for e in found if e.family != "prompt echoed" or not env.verify(e.completion, row["answer"])]
    for generator in extra:
        found += [e if isinstance(e, Exploit) else Exploit(getattr(generator, "__name__", "custom"), str(e))
                  for e in generator(row, env)]
    return found


def _columns(completions: list, row: dict, environments=None) -> dict:
    """The row's columns as TRL passes them with a batch of completions of it (and, of a
    tool environment's episodes, their guarded instances)."""
    columns = {key: [row.get(key)] * len(completions) for key in reward_columns(row)}
    return {**columns, "environments": environments} if environments else columns


def _totals(funcs, weights, completions: list, environments=None, *, row: dict) -> list[float]:
    scores = [fn(completions, **_columns(completions, row, environments)) for fn in funcs]
    return [sum(w * s[i] for w, s in zip(weights, scores)) for i in range(len(completions))]


def _as_played(play, texts: list[str]) -> tuple[list, list | None]:
    """The completions and instances a batch of final texts is scored as: episodes for a
    tool environment (`Played`), else the texts."""
    return play.batch(texts) if play else (texts, None)


class Played:
    """A tool environment's exploits as episodes: each text a final reply after the row's
    gold tool calls, played on a guarded instance (the calls run, their results in the
    conversation), as GRPO's rollouts reach the reward: messages, and the instance that
    channels such as `tool_use` read. Two more families have no final reply at all:
    `tools forever` (the first call repeated past the turn cap) and `no final answer`
    (the gold calls, then nothing)."""

    def __init__(self, env, row: dict, limits):
        from posttrain.envs.tools import guard
        from posttrain.scoring.episodes import scripted_message, start

        self.factory, self.row = guard(env.episode, limits), row
        self.max_turns = getattr(env, "max_turns", 8)
        self.calls, self.instance = self._play(lambda ep, step: [m for m in (row.get("trace") or [])
                                                                 if m["role"] == "assistant" and m.get("tool_calls")])
        first = (self.calls[0] if self.calls else None) or {"role": "assistant", "content": "", "tool_calls": []}
        if not first.get("tool_calls"):
            episode = start(self.factory, row, None)
            first = scripted_message(episode, {}, 0)  # one call of the first tool, arguments of its types
        self.forever, self.forever_instance = self._play(lambda ep, step: [first] * (self.max_turns + 1))

    def _play(self, script):
        from posttrain.scoring.episodes import run_call, start

        episode = start(self.factory, self.row, None)
        asked = len(episode.messages)
        for message in script(episode, 0):
            episode.messages.append(message)
            for call in message.get("tool_calls") or []:
                episode.messages.append(run_call(episode, call))
        return episode.messages[asked:], episode.instance

    def batch(self, texts: list[str]) -> tuple[list, list]:
        """Each text as a final reply after the gold calls; the instances to score them with."""
        return [self.calls + [{"role": "assistant", "content": t}] for t in texts], [self.instance] * len(texts)

    def exploits(self) -> list[tuple[Exploit, list, object]]:
        return [(Exploit("tools forever", "(the first tool call, repeated past the turn cap)"), self.forever,
                 self.forever_instance),
                (Exploit("no final answer", "(the gold tool calls, then no reply)"), list(self.calls), self.instance)]


def stage_minimum(rewards: dict[str, float]) -> float:
    """The least the stage's weighted reward can be: each channel at its worst end."""
    total = 0.0
    for name, weight in rewards.items():
        channel = reward_channel(name)
        total += weight * (channel.low if weight >= 0 else channel.high)
    return total


def rewarded_bar(gold_min: float, stage_min: float) -> float:
    """Above this a completion is *rewarded*: nearer the lowest gold reward than the stage minimum."""
    return (gold_min + stage_min) / 2


def audit_stage(stage: str, env, rewards: dict[str, float], guardrails: list[str], rows: list[dict], *,
                extra=(), max_rows: int = AUDIT_ROWS, limits=None, max_false_reward: float = 0.1) -> AuditReport:
    """The audit of one GRPO stage's reward on up to `max_rows` training rows whose gold
    completion the environment verifies (see the module docstring); a tool environment's
    exploits are played as episodes (`Played`, its tools under `limits`). A `wrong` family
    paid as if right (above `rewarded_bar`) on more than `max_false_reward` of the rows (the
    low end of its Wilson interval) breaches too, even below gold: partial credit a policy
    can climb without the answer (string overlap with the gold query)."""
    from posttrain.scoring.stats import wilson_interval

    from posttrain.chat import completion_texts
    from posttrain.envs.tools import ToolLimits, is_tool_env
    from posttrain.scoring.rewards import guardrail

    weights = rewards if isinstance(rewards, dict) else {name: 1.0 for name in rewards}
    funcs, w = build_rewards(env, weights, guardrails)
    guards = [guardrail(name)(env) for name in guardrails]
    rows = [r for r in rows if env.verify(r["completion"], r["answer"])][:max_rows]
    if not rows:
        raise NothingToAudit("no training row's gold completion verifies: nothing to audit against")
    played = [Played(env, r, limits or ToolLimits()) for r in rows] if is_tool_env(env) else [None] * len(rows)
    gold = [_totals(funcs, w, *_as_played(p, [r["completion"]]), row=r)[0] for r, p in zip(rows, played)]
    report = AuditReport(stage=stage, rows=len(rows), exploits=0, gold_min=min(gold),
                         stage_min=stage_minimum(weights))
    worst: dict[tuple[str, str], Breach] = {}
    bar = rewarded_bar(report.gold_min, report.stage_min)
    paid: dict[str, list] = {}  # wrong family -> [rows seen, rows rewarded, its best-paid Breach]
    for row, play in zip(rows, played):
        battery = exploits_for(env, row, extra)
        texts = [e.completion for e in battery]
        completions, environments = _as_played(play, texts)
        scores = _totals(funcs, w, completions, environments, row=row)  # one batch, as TRL calls them
        for exploit, episode, instance in (play.exploits() if play else []):
            battery.append(exploit)
            texts.append(completion_texts([episode])[0])
            scores += _totals(funcs, w, [episode], [instance], row=row)
        flagged = [any(flags) for flags in zip(*[g(texts, **_columns(texts, row)) for g in guards])] if guards \
            else [False] * len(battery)
        report.exploits += len(battery)
        best: dict[str, tuple[float, str]] = {}
        for exploit, score in zip(battery, scores):
            if exploit.kind == "wrong":
                best[exploit.family] = max(best.get(exploit.family, (-math.inf, "")), (score, exploit.completion))
        for family, (score, text) in best.items():
            seen = paid.setdefault(family, [0, 0, None])
            seen[0] += 1
            if score > bar + 1e-9:
                seen[1] += 1
                if seen[2] is None or score > seen[2].score:
                    seen[2] = Breach(family, "rewarded", score, bar, text, row["answer"])
        for exploit, score, guarded in zip(battery, scores, flagged):
            seen = report.families.setdefault(exploit.family, {"kind": exploit.kind, "count": 0, "max_score": -math.inf})
            seen["count"] += 1
            seen["max_score"] = max(seen["max_score"], score)
            if guarded and score > report.stage_min + 1e-9:
                kind, ceiling = "guardrail", report.stage_min
            elif exploit.kind == "wrong" and score >= report.gold_min - 1e-9:
                kind, ceiling = "wrong", report.gold_min
            elif exploit.kind == "variant" and score > report.gold_min + 1e-9:
                kind, ceiling = "variant", report.gold_min
            else:
                continue
            key = (exploit.family, kind)
            if key not in worst or score > worst[key].score:
                worst[key] = Breach(exploit.family, kind, score, ceiling, exploit.completion, row["answer"])
    breached = {family for family, _ in worst}
    for family, (count, rewarded, example) in paid.items():
        if family not in breached and rewarded and wilson_interval(rewarded, count)[0] > max_false_reward:
            example.rewarded, example.of = rewarded, count
            worst[(family, "rewarded")] = example
    report.breaches = sorted(worst.values(), key=lambda b: -b.score)  # ties: the battery's order, simplest first
    return report


FIX = ("pay for the verified answer (`correctness`), or make the verifier read one final answer strictly "
       "(e.g. answer: exact, an anchored answer_pattern, a smaller tolerance); add `unparseable` to guardrails")


def generators(paths: list[str]) -> list:
    """The user's exploit generators (`audit.exploits`), by import path; PluginError when one
    is not a function or its module fails."""
    from posttrain.plugins import PluginError, lookup, plugin_failures

    found = []
    for path in paths:
        with plugin_failures(path):
            generator = lookup(path, {}, "exploit generator", "package.module:function (e.g. custom.audit:mine)")
        if not callable(generator):
            raise PluginError(f"{path} is not a function", "name a function (row, env) -> [Exploit | str]")
        found.append(generator)
    return found


def audit_stages(path, config, env, rows: list[dict], names=None) -> dict[str, AuditReport]:
    """The audit of the GRPO stages `names` (default: every one whose `audit` is not `off`)
    of the config at `path`, with each one's rows, generators, channels and guardrails. A
    plug-in that raises (a reward, a guardrail, a generator) is a UserError naming it."""
    from posttrain.envs.tools import tool_limits
    from posttrain.errors import UserError
    from posttrain.plugins import PluginError, plugin_failures

    names = names if names is not None else [n for n, s in config.grpo.items() if s.audit.action != "off"]
    reports = {}
    try:
        for name in names:
            stage = config.grpo[name]
            try:
                extra = generators(stage.audit.exploits)
            except PluginError as err:
                raise UserError(f"{path}: grpo.{name}.audit.exploits", err.problem, err.fix) from None
            with plugin_failures():
                reports[name] = audit_stage(name, env, stage.rewards, stage.guardrails, rows, extra=extra,
                                            max_rows=stage.audit.rows, limits=tool_limits(config),
                                            max_false_reward=stage.audit.max_false_reward)
    except PluginError as err:
        raise UserError(f"{path}: grpo", f"the reward audit: {err.problem}", err.fix) from None
    except NothingToAudit as err:  # the format contract's refusal, said before any compute
        raise UserError(f"{path}: data.env", f"the reward audit: {err}", "make the training rows' gold "
                        "completions verify (the environment's parser and verifier)") from None
    return reports


def refusals(path, config, env, rows: list[dict]) -> dict[str, AuditReport]:
    """What `posttrain check` and `run` do with the audit: a stage whose `audit` is `refuse`
    and that breaches refuses the config (UserError at its first breach); `warn`: a WARNING
    line per breach on stderr. The reports."""
    import sys

    from posttrain.errors import UserError

    reports = audit_stages(path, config, env, rows)
    for name, report in reports.items():
        if report.breaches and config.grpo[name].audit.action == "refuse":
            raise UserError(f"{path}", report.breaches[0].line(name), fix_for(name))
        for breach in report.breaches:
            print(f"posttrain: WARNING: {breach.line(name)} (audit: warn)", file=sys.stderr, flush=True)
    return reports


def summary(report: AuditReport, action: str = "refuse") -> str:
    """One line: the verdict, what was scored, the floor and ceiling it was held to."""
    count = len({b.family for b in report.breaches})
    breached = f"{count} exploit {'family breaches' if count == 1 else 'families breach'} it"
    verdict = "passed" if not report.breaches else f"{'refused' if action == 'refuse' else 'WARNING'}: {breached}"
    return (f"grpo.{report.stage}: audit {verdict} ({report.exploits:,} exploits of {len(report.families)} families "
            f"on {report.rows} training rows; lowest gold reward {report.gold_min:.3f}, stage minimum "
            f"{report.stage_min:.3f})")


def fix_for(stage: str) -> str:
    return f"{FIX}; or set grpo.{stage}.audit: warn to train on it anyway"


def agreement(env, rewards: dict[str, float], guardrails: list[str], rows: list[dict],
              samples: list[list[str]], gold_min: float, stage_min: float) -> dict:
    """The stage's reward against the verifier on the starting model's own samples (the
    pass-rate filter's): a sample is *rewarded* when its reward is nearer the lowest gold
    completion's than the stage minimum. `false_reward`: the share of wrong samples rewarded;
    `missed_reward`: the share of right ones not; each with its Wilson interval."""
    from posttrain.scoring.stats import wilson_interval

    weights = rewards if isinstance(rewards, dict) else {name: 1.0 for name in rewards}
    funcs, w = build_rewards(env, weights, guardrails)
    bar = rewarded_bar(gold_min, stage_min)
    counts = {"right": 0, "wrong": 0, "false_reward": 0, "missed_reward": 0}
    for row, outs in zip(rows, samples):
        for text, score in zip(outs, _totals(funcs, w, list(outs), row=row)):
            right, rewarded = env.verify(text, row["answer"]), score > bar
            counts["right" if right else "wrong"] += 1
            counts["missed_reward"] += right and not rewarded
            counts["false_reward"] += rewarded and not right
    found = {"samples": counts["right"] + counts["wrong"], **{k: counts[k] for k in ("right", "wrong")}}
    for key, of in (("false_reward", "wrong"), ("missed_reward", "right")):
        found[f"{key}_count"] = counts[key]
        found[key] = counts[key] / counts[of] if counts[of] else 0.0
        found[f"{key}_interval"] = wilson_interval(counts[key], counts[of])
    return found
