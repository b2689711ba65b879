"""The reward audit: a stage's reward scored on completions built to game it, before training.

For real training rows, a battery of **exploit completions** is built from the row (its
prompt, its gold completion, its answer) and scored with the stage's own reward: its
weighted channels with its guardrails applied, exactly as GRPO will score them
(posttrain.scoring.rewards.build_rewards; the weighted sum TRL computes). Two kinds:

- `wrong`: a wrong answer, or none (empty, whitespace, the prompt echoed, the format with
  the answer taken out, a very long output without the answer, a plain wrong answer,
  several answers with a wrong one last, every candidate at once, the right answer
  followed by a wrong final one, NaN / inf / 1e999, a value just outside the tolerance;
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


@dataclass
class Breach:
    family: str
    kind: str
    score: float
    ceiling: float
    example: str
    answer: str

    def line(self, stage: str) -> str:
        bound = "the lowest gold completion's" if self.kind != "guardrail" else "the guardrail's minimum"
        shown = self.example if len(self.example) <= 60 else self.example[:57] + "..."
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
                "breaches": [asdict(b) for b in self.breaches], "passed": not self.breaches}


def _wrong_values(answer: str) -> list[str]:
    """Two answers that are not `answer` (numbers near it, or other text)."""
    if _NUMBER.match(answer):
        value = float(answer)
        step = 1 if value.is_integer() else max(abs(value) * 0.5, 1.0)
        shown = [value + step, value - step] if value.is_integer() else [value + step, value + 2 * step]
        return [str(int(v)) if float(v).is_integer() else f"{v:g}" for v in shown]
    return [w for w in ("12345", "54321", "67890") if w != answer][:2]  # a number a lenient reader would read last


def generic_exploits(row: dict) -> list[Exploit]:
    """The battery every environment gets, from one training row."""
    answer, gold = row["answer"].strip(), row["completion"].strip()
    question = row.get("question") or row["prompt"]
    wrong, wrong2 = _wrong_values(answer)
    found = [Exploit("empty", ""), Exploit("whitespace", " \n\t "),
             Exploit("wrong answer", wrong), Exploit("several answers", f"{wrong}\n{answer}\n{wrong2}"),
             Exploit("right then wrong", f"{answer}\nNo, wait: the answer is {wrong}."),
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
    for generator in extra:
        found += [e if isinstance(e, Exploit) else Exploit(getattr(generator, "__name__", "custom"), str(e))
                  for e in generator(row, env)]
    return found


def _columns(completions: list[str], row: dict) -> dict:
    """The row's columns as TRL passes them with a batch of completions of it."""
    return {key: [row.get(key)] * len(completions) for key in reward_columns(row)}


def _totals(funcs, weights, completions: list[str], row: dict) -> list[float]:
    scores = [fn(completions, **_columns(completions, row)) for fn in funcs]
    return [sum(w * s[i] for w, s in zip(weights, scores)) for i in range(len(completions))]


def stage_minimum(rewards: dict[str, float]) -> float:
    """The least the stage's weighted reward can be: each channel at its worst end."""
    total = 0.0
    for name, weight in rewards.items():
        channel = reward_channel(name)
        total += weight * (channel.low if weight >= 0 else channel.high)
    return total


def audit_stage(stage: str, env, rewards: dict[str, float], guardrails: list[str], rows: list[dict], *,
                extra=(), max_rows: int = AUDIT_ROWS) -> AuditReport:
    """The audit of one GRPO stage's reward on up to `max_rows` training rows whose gold
    completion the environment verifies (see the module docstring)."""
    from posttrain.scoring.rewards import guardrail

    weights = rewards if isinstance(rewards, dict) else {name: 1.0 for name in rewards}
    funcs, w = build_rewards(env, weights, guardrails)
    guards = [guardrail(name)(env) for name in guardrails]
    rows = [r for r in rows if env.verify(r["completion"], r["answer"])][:max_rows]
    if not rows:
        raise ValueError("no training row's gold completion verifies: nothing to audit against")
    gold = [_totals(funcs, w, [r["completion"]], r)[0] for r in rows]
    report = AuditReport(stage=stage, rows=len(rows), exploits=0, gold_min=min(gold),
                         stage_min=stage_minimum(weights))
    worst: dict[tuple[str, str], Breach] = {}
    for row in rows:
        battery = exploits_for(env, row, extra)
        scores = _totals(funcs, w, [e.completion for e in battery], row)  # one batch, as TRL calls them
        texts = [e.completion for e in battery]
        flagged = [any(flags) for flags in zip(*[g(texts, **_columns(texts, row)) for g in guards])] if guards \
            else [False] * len(battery)
        report.exploits += len(battery)
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
    report.breaches = sorted(worst.values(), key=lambda b: (-b.score, b.family))
    return report


FIX = ("pay for the verified answer (`correctness`), or make the verifier read one final answer strictly "
       "(e.g. answer: exact, an anchored answer_pattern, a smaller tolerance); add `unparseable` to guardrails")
