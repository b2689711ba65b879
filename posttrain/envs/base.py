"""The environment protocol every task implements."""

from __future__ import annotations

from typing import Protocol


class Environment(Protocol):
    """A task with verifiable answers.

    `generate` returns the splits as lists of rows with at least `prompt`, `completion`
    (the SFT target) and `answer` (what the verifier compares against). `parse` turns a
    model completion into an answer (None when unparseable); `verify` says whether a
    completion is correct. Neither does I/O, so rewards built on them stay pure.
    """

    name: str

    def generate(self, seed: int) -> dict[str, list[dict]]: ...

    def parse(self, completion: str) -> str | None: ...

    def verify(self, completion: str, answer: str) -> bool: ...
