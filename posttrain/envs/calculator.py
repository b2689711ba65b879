"""Arithmetic word problems with a calculator tool: the smallest tool environment.

`A crate holds 37 bottles. How many bottles are in 48 crates?` -> 1776. The model may
call `calc(expression)` (integers, + - * / and parentheses, evaluated by walking the
parsed expression: never `eval`) as often as it likes within the episode's turns, then
answers; the answer is read leniently (the last integer of the last reply) as the
arithmetic environment's `last_number` does. Each row carries the gold episode (`trace`:
the call, its result, the answer) that the SFT warmup trains on.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from pydantic import Field

from posttrain.envs.base import EnvOptions

_LAST_NUMBER = re.compile(r"-?\d+(?!.*\d)", re.DOTALL)
_ANSWER = re.compile(r"^\s*(-?\d+)\s*$")

# (question, expression over a and b, operand range of a, of b); every (template, a, b) is one row
PROBLEMS = [
    ("A crate holds {a} bottles. How many bottles are in {b} crates?", "{a} * {b}", range(12, 100), range(12, 100)),
    ("A train covers {a} km each hour. How many km does it cover in {b} hours?", "{a} * {b}", range(41, 100),
     range(12, 41)),
    ("Tom has {a} stamps and Ann has {b}. How many stamps do they have together?", "{a} + {b}", range(100, 1000, 7),
     range(100, 1000, 11)),
    ("A shop had {a} apples and sold {b} of them. How many apples are left?", "{a} - {b}", range(500, 1000, 7),
     range(100, 500, 9)),
]
MAX_EXPRESSION = 200
MAX_MAGNITUDE = 10 ** 15
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // % and parentheses.

    ValueError for anything else (names, calls, attributes, powers), for an expression
    longer than 200 characters, and for a value beyond 10**15 (no runaway products)."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_value(node.operand))
    else:
        raise ValueError(f"only numbers, + - * / // % and parentheses are allowed, not {type(node).__name__}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("the value is beyond 10**15")
    return value


def shown(value) -> str:
    """A result as the model reads it: integers without a decimal point."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class CalculatorEpisode:
    """One episode: the model may use the calculator; the answer is in its last reply."""

    def reset(self, **row) -> None:
        return None

    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

        Args:
            expression: The expression to evaluate, for example "37 * 48".
        """
        return shown(evaluate(expression))


class CalculatorOptions(EnvOptions):
    """`data.options` of the calculator environment."""
    heldout_size: int = Field(200, ge=1, le=2000, description="Problems held out for evaluation.")
    train_size: int = Field(4000, ge=1, le=20000, description="Problems to train on (of the ~23,000 the others "
                                                              "leave), drawn by the seed.")
    system: str | None = Field("Use the calc tool for arithmetic, then reply with the number only.",
                               max_length=2000, description="System prompt (before the tools' descriptions).")
    max_turns: int = Field(3, ge=1, le=20, description="Tool-calling rounds an episode may take.")


class CalculatorEnv:
    name = "calculator"
    Options = CalculatorOptions
    episode = CalculatorEpisode

    def __init__(self, heldout_size: int = 200, train_size: int = 4000,
                 system: str | None = CalculatorOptions().system, max_turns: int = 3):
        self.heldout_size, self.train_size, self.system, self.max_turns = heldout_size, train_size, system, max_turns

    def generate(self, seed: int) -> dict[str, list[dict]]:
        rows = [self.row(question, expression, a, b)
                for question, expression, a_range, b_range in PROBLEMS for a in a_range for b in b_range]
        rng = random.Random(seed)
        rng.shuffle(rows)
        return {"train": rows[self.heldout_size:self.heldout_size + self.train_size], "heldout": rows[:self.heldout_size]}

    @staticmethod
    def row(question: str, expression: str, a: int, b: int) -> dict:
        expr = expression.format(a=a, b=b)
        answer = shown(evaluate(expr))
        call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": expr}}}
        trace = [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "name": "calc", "content": answer},
                 {"role": "assistant", "content": answer}]
        return {"prompt": question.format(a=a, b=b), "completion": answer, "answer": answer, "trace": trace}

    def parse(self, completion: str) -> str | None:
        match = _LAST_NUMBER.search(completion[:10_000])
        return str(int(match.group(0))) if match else None

    def format_ok(self, completion: str) -> bool:
        return _ANSWER.match(completion) is not None

    def verify(self, completion: str, answer: str) -> bool:
        return self.parse(completion) == answer
