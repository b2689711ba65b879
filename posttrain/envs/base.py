"""The environment protocol every task implements."""

from __future__ import annotations

from typing import ClassVar, Protocol

from pydantic import BaseModel, ConfigDict


class EnvOptions(BaseModel):
    """Base of an environment's `data.options` schema: typed, bounded, no unknown keys.
    `get_env` validates the config's options against it before the environment is built,
    so a bad option is one line naming it, not a traceback mid-pipeline."""
    model_config = ConfigDict(extra="forbid", frozen=True)


class Environment(Protocol):
    """A task with verifiable answers.

    `Options` is the `EnvOptions` schema of the constructor's keyword options.
    `generate` returns the splits as lists of rows with at least `prompt`, `completion`
    (the SFT target) and `answer` (what the verifier compares against). `parse` turns a
    model completion into an answer (None when unparseable); `verify` says whether a
    completion is correct. Neither does I/O, so rewards built on them stay pure.
    """

    name: str
    Options: ClassVar[type[EnvOptions]]

    def generate(self, seed: int) -> dict[str, list[dict]]: ...

    def parse(self, completion: str) -> str | None: ...

    def verify(self, completion: str, answer: str) -> bool: ...
