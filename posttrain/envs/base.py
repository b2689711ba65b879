"""The environment protocol every task implements: the one place it is written down.

An environment is a task with verifiable answers. The built-ins (`arithmetic`, `sql`)
follow it, and so must one of your own (`data.env: custom.mytask:make_env`, or an entry
point in the group `posttrain.envs`); `get_env` checks what a factory returns.

Required:
- `generate(seed) -> {"train": [row, ...], "heldout": [row, ...]}`: the splits. A row has
  at least `prompt`, `completion` (the SFT target) and `answer` (what `verify` compares
  against); other columns reach reward functions as keyword arguments (TRL passes the
  dataset's columns). The same seed gives the same splits; no held-out prompt is in train.
- `parse(completion) -> str | None`: the answer a model completion gives, None when it
  gives none (the `parseable` channel and the `unparseable` guardrail use it).
- `verify(completion, answer) -> bool`: whether the completion is right (the
  `correctness` channel, the gate, evaluation, pass@k). The SFT targets must verify:
  the format contract refuses SFT before compute otherwise.
Neither `parse` nor `verify` does I/O or keeps state, so rewards built on them stay pure
(a task that must execute model output does it sandboxed: `posttrain.sandbox`).

Optional:
- `name` (str): how messages name it (default: what `data.env` says).
- `Options`: an `EnvOptions` schema of the factory's keyword options (`data.options`);
  with it, a bad option is a one-line error naming it and listing the valid ones.
  Without it the options are passed as keyword arguments unchecked.
- `check_row(row) -> str | None`: why an incoming row (`incoming/`, posttrain.ingest)
  is not a valid example beyond verifying its own completion, or None.
- `exploits(row) -> [Exploit]`: the environment's own families for the reward audit
  (posttrain.scoring.audit), completions built from the row to game a reward.
- Reward channels are not the environment's: `posttrain.scoring.rewards` builds them from
  `parse`/`verify`, and a stage may add its own by import path.

What an import path may name (posttrain.plugins): a function or class of your own module
(`custom/`) or of an installed package; not the standard library or builtins (`os:system`,
`builtins:eval`, nor a module of yours re-exporting them), not posttrain's internals (its
built-ins go by name). Its module must finish importing within 60 s
(POSTTRAIN_PLUGIN_IMPORT_SECONDS): do slow work in the factory, not at import. What your
code raises, and a `sys.exit` in it, ends `posttrain check` or the stage in one line that
names the plug-in and its own last frame (file:line); to refuse bad input on purpose, raise
`posttrain.errors.UserError` / `OptionError`, whose own line is shown. `custom/` holds files
and folders of the project only: a link that leads out of it, to nothing or into a loop,
and a FIFO, socket or device, are refused before anything reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

REQUIRED = ("generate", "parse", "verify")


@dataclass(frozen=True)
class Exploit:
    """A completion built to game a reward (posttrain.scoring.audit): `wrong` ones hold no
    right answer where a strict reader reads and must score below every gold completion;
    `variant` ones are the gold answer in another form and must never score above one."""
    family: str
    completion: str
    kind: str = "wrong"


class EnvOptions(BaseModel):
    """Base of an environment's `data.options` schema: typed, bounded, no unknown keys.
    `get_env` validates the config's options against it before the environment is built,
    so a bad option is one line naming it, not a traceback mid-pipeline."""
    model_config = ConfigDict(extra="forbid", frozen=True)


class Environment(Protocol):
    """A task with verifiable answers (the module docstring gives the contract)."""

    name: str
    Options: ClassVar[type[EnvOptions]]

    def generate(self, seed: int) -> dict[str, list[dict]]: ...

    def parse(self, completion: str) -> str | None: ...

    def verify(self, completion: str, answer: str) -> bool: ...


def missing_methods(env) -> list[str]:
    """The required methods `env` lacks."""
    return [method for method in REQUIRED if not callable(getattr(env, method, None))]
