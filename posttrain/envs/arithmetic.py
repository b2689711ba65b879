"""Integer arithmetic: `37+48=` -> `85`.

Every (a, b, op) triple lands in exactly one split, so held-out prompts are never
seen in training. `completion_format` shapes the SFT target around the answer; the
parser reads a bare number, so a format like `= {answer}` breaks the format contract.

For an instruct model (`data.chat: true`): `prompt_format` words the question (`What is
{a} {op} {b}?`), `system` is the system turn, and `answer: last_number` reads the last
integer of the reply ("27 + 82 = 109." reads 109), so what is measured is whether the sum
is right, not whether the model answered in one bare number; `format_ok` (the `format`
channel, and the evaluation's `format_rate`) still asks for the bare number.
"""

from __future__ import annotations

import random
import re
import string
from typing import Literal

from pydantic import Field, field_validator

from posttrain.envs.base import EnvOptions
from posttrain.errors import invalid

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ANSWER = re.compile(r"^\s*(-?\d+)\s*$")
_LAST_NUMBER = re.compile(r"-?\d+(?!.*\d)", re.DOTALL)
PROMPT_FIELDS = {"a", "op", "b"}


class ArithmeticOptions(EnvOptions):
    """`data.options` of the arithmetic environment."""
    operand_max: int = Field(49, ge=0, le=999, description="Operands run 0..operand_max (<= 1,000,000 rows per op).")
    ops: tuple[Literal["+", "-", "*"], ...] = Field(("+",), min_length=1, description="Operators, each once.")
    heldout_size: int = Field(500, ge=0, description="Rows held out for evaluation; the rest train.")
    completion_format: str = Field("{answer}", max_length=200, description="SFT target; `{answer}` is the answer, "
                                   "and it may restate the question with {a}, {op} and {b} (e.g. "
                                   "`{a} {op} {b} = {answer}`, read with answer: last_number).")
    prompt_format: str = Field("{a}{op}{b}=", max_length=500, description="The question; names {a}, {op} and {b}, "
                               "e.g. `What is {a} {op} {b}?` for an instruct model.")
    answer: Literal["exact", "last_number"] = Field("exact", description="How a completion is read: exact (the "
                                                    "whole completion is the number) or last_number (the last "
                                                    "integer in it: lenient, for instruct models' sentences).")
    system: str | None = Field(None, max_length=2000, description="System prompt of conversational prompts "
                               "(data.chat); null: the model template's own default.")

    @field_validator("ops")
    @classmethod
    def _each_op_once(cls, ops):
        if len(set(ops)) < len(ops):  # a repeated op would put one fact in both splits
            raise invalid("an operator is listed twice", "list each operator once")
        return ops

    @field_validator("heldout_size")
    @classmethod
    def _rows_left_to_train(cls, heldout_size, info):
        if {"ops", "operand_max"} <= info.data.keys():  # both valid (declared above)
            rows = len(info.data["ops"]) * (info.data["operand_max"] + 1) ** 2
            if heldout_size >= rows:
                raise invalid(f"{heldout_size} leaves none of the {rows} rows to train on", f"use at most {rows - 1}")
        return heldout_size

    @field_validator("completion_format")
    @classmethod
    def _the_answer(cls, fmt):
        fields = _format_fields(fmt)
        if fields is None or "answer" not in fields or not fields <= PROMPT_FIELDS | {"answer"}:
            raise invalid("must name the field {answer}, and no other than {a}, {op} and {b}",
                          "e.g. `{answer}` or `{a} {op} {b} = {answer}`; write literal braces as {{ }}")
        return fmt

    @field_validator("prompt_format")
    @classmethod
    def _the_operands(cls, fmt):
        if _format_fields(fmt) != PROMPT_FIELDS:
            raise invalid("must name each of {a}, {op} and {b}, and no other field",
                          "e.g. `What is {a} {op} {b}?`; write literal braces as {{ }}")
        return fmt


def _format_fields(fmt: str) -> set[str] | None:
    """The fields a str.format template names, None when it is no valid template."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(fmt) if name is not None}
        fmt.format(**{name: "0" for name in fields})
    except (ValueError, KeyError, IndexError, AttributeError):
        return None
    return fields


class ArithmeticEnv:
    name = "arithmetic"
    Options = ArithmeticOptions

    def __init__(self, operand_max: int = 49, ops: tuple[str, ...] = ("+",), heldout_size: int = 500,
                 completion_format: str = "{answer}", prompt_format: str = "{a}{op}{b}=", answer: str = "exact",
                 system: str | None = None):
        self.operand_max = operand_max
        self.completion_format = completion_format
        self.ops = tuple(ops)
        self.heldout_size = heldout_size
        self.prompt_format, self.answer, self.system = prompt_format, answer, system
        self._prompt = re.compile(_prompt_pattern(prompt_format))

    def generate(self, seed: int) -> dict[str, list[dict]]:
        """All `a op b` pairs with 0 <= a, b <= operand_max, split train / heldout."""
        rows = [self.row(a, b, op) for op in self.ops
                for a in range(self.operand_max + 1) for b in range(self.operand_max + 1)]
        random.Random(seed).shuffle(rows)
        return {"train": rows[self.heldout_size:], "heldout": rows[:self.heldout_size]}

    def row(self, a: int, b: int, op: str) -> dict:
        answer = str(_OPS[op](a, b))
        return {"prompt": self.prompt_format.format(a=a, op=op, b=b),
                "completion": self.completion_format.format(a=a, op=op, b=b, answer=answer), "answer": answer}

    def check_row(self, row: dict) -> str | None:
        """Why an incoming row is not a true `a op b` fact in this prompt format, or None (posttrain.ingest)."""
        match = self._prompt.fullmatch(row["prompt"])
        a, op, b = (int(match["a"]), match["op"], int(match["b"])) if match else (0, "", 0)
        if not match or row["prompt"] != self.prompt_format.format(a=a, op=op, b=b):  # canonical: the held-out check sees it
            shown = self.prompt_format.format(a="<a>", op="<op>", b="<b>")
            return f"prompt {row['prompt']!r} is not of the form `{shown}` (op one of {''.join(_OPS)})"
        truth = str(_OPS[op](a, b))
        return None if row["answer"] == truth else f"answer {row['answer']!r} is wrong: {a}{op}{b}={truth}"

    def parse(self, completion: str) -> str | None:
        match = _ANSWER.match(completion) if self.answer == "exact" else _LAST_NUMBER.search(completion[:10_000])
        return str(int(match.group(match.lastindex or 0))) if match else None

    def format_ok(self, completion: str) -> bool:
        """The reply is the bare number, whichever way `answer` reads it."""
        return _ANSWER.match(completion) is not None

    def verify(self, completion: str, answer: str) -> bool:
        return self.parse(completion) == answer


def _prompt_pattern(fmt: str) -> str:
    """A regex that reads a, op and b back out of a prompt written with `fmt`."""
    groups = {"a": r"(?P<a>\d+)", "b": r"(?P<b>\d+)", "op": r"(?P<op>[-+*])"}
    parts = []
    for literal, name, _, _ in string.Formatter().parse(fmt):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append(groups[name])
    return "".join(parts)
