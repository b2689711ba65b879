"""Integer arithmetic: `37+48=` -> `85`.

Every (a, b, op) triple lands in exactly one split, so held-out prompts are never
seen in training. `completion_format` shapes the SFT target around the answer; the
parser reads a bare number, so a format like `= {answer}` breaks the format contract.
"""

from __future__ import annotations

import random
import re

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ANSWER = re.compile(r"^\s*(-?\d+)\s*$")
_PROMPT = re.compile(r"^(\d+)([-+*])(\d+)=$")


class ArithmeticEnv:
    name = "arithmetic"

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
