"""Integer arithmetic: `37+48=` -> `85`.

Every (a, b, op) triple lands in exactly one split, so held-out prompts are never
seen in training. `completion_format` shapes the SFT target around the answer; the
parser reads a bare number, so a format like `= {answer}` breaks the format contract.
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
_PROMPT = re.compile(r"^(\d+)([-+*])(\d+)=$")


class ArithmeticOptions(EnvOptions):
    """`data.options` of the arithmetic environment."""
    operand_max: int = Field(49, ge=0, le=999, description="Operands run 0..operand_max (<= 1,000,000 rows per op).")
    ops: tuple[Literal["+", "-", "*"], ...] = Field(("+",), min_length=1, description="Operators, each once.")
    heldout_size: int = Field(500, ge=0, description="Rows held out for evaluation; the rest train.")
    completion_format: str = Field("{answer}", max_length=200, description="SFT target; `{answer}` is the answer.")

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
    def _only_the_answer(cls, fmt):
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(fmt) if name is not None}
            fmt.format(answer="0")
        except (ValueError, KeyError, IndexError, AttributeError):
            fields = None
        if fields != {"answer"}:
            raise invalid("must name the field {answer} and no other", "use only {answer}; write literal braces as {{ }}")
        return fmt


class ArithmeticEnv:
    name = "arithmetic"
    Options = ArithmeticOptions

    def __init__(self, operand_max: int = 49, ops: tuple[str, ...] = ("+",),
                 heldout_size: int = 500, completion_format: str = "{answer}"):
        self.operand_max = operand_max
        self.completion_format = completion_format
        self.ops = tuple(ops)
        self.heldout_size = heldout_size

    def generate(self, seed: int) -> dict[str, list[dict]]:
        """All `a op b` pairs with 0 <= a, b <= operand_max, split train / heldout."""
        rows = [self.row(a, b, op) for op in self.ops
                for a in range(self.operand_max + 1) for b in range(self.operand_max + 1)]
        random.Random(seed).shuffle(rows)
        return {"train": rows[self.heldout_size:], "heldout": rows[:self.heldout_size]}

    def row(self, a: int, b: int, op: str) -> dict:
        answer = str(_OPS[op](a, b))
        return {"prompt": f"{a}{op}{b}=", "completion": self.completion_format.format(answer=answer), "answer": answer}

    def check_row(self, row: dict) -> str | None:
        """Why an incoming row is not a true `a op b=` fact, or None (posttrain.ingest)."""
        match = _PROMPT.fullmatch(row["prompt"])
        a, op, b = (int(match.group(1)), match.group(2), int(match.group(3))) if match else (0, "", 0)
        if not match or row["prompt"] != f"{a}{op}{b}=":  # canonical, so the held-out check sees it
            return f"prompt {row['prompt']!r} is not of the form `<a><op><b>=` (op one of {''.join(_OPS)})"
        truth = str(_OPS[op](a, b))
        return None if row["answer"] == truth else f"answer {row['answer']!r} is wrong: {a}{op}{b}={truth}"

    def parse(self, completion: str) -> str | None:
        match = _ANSWER.match(completion)
        return str(int(match.group(1))) if match else None

    def verify(self, completion: str, answer: str) -> bool:
        return self.parse(completion) == answer
