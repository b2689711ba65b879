"""One name for each pipeline stage. A stage is `prepare`, `sft`, `grpo@NAME` (one per
entry of the config's `grpo` mapping), `serving` or `evaluate`; its DVC name (also its
MLflow child run's), config field (also its metric prefix), log and model folder are
derived here, not assembled by string where they are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

KINDS = ("prepare", "sft", "grpo", "serving", "evaluate")
TRAINING = ("sft", "grpo")


@dataclass(frozen=True)
class StageId:
    kind: str              # one of KINDS
    name: str | None = None  # a GRPO stage's key in the config's `grpo` mapping

    @classmethod
    def parse(cls, text: str) -> StageId:
        """`sft`, `grpo@dense`, or DVC's address of one in another folder (`sub/dvc.yaml:grpo@dense`)."""
        kind, _, name = text.rpartition(":")[2].partition("@")
        if kind not in KINDS or bool(name) != (kind == "grpo"):
            raise ValueError(f"not a pipeline stage: {text!r}")
        return cls(kind, name or None)

    @classmethod
    def grpo(cls, name: str) -> StageId:
        return cls("grpo", name)

    def __str__(self) -> str:
        return self.dvc

    @property
    def dvc(self) -> str:
        """DVC's stage name (`grpo@dense`: dvc.yaml's foreach), also its MLflow child run's."""
        return f"grpo@{self.name}" if self.name else self.kind

    @property
    def field(self) -> str:
        """Its section of the config (`grpo.dense`), also the prefix of its metrics on the parent run."""
        return f"grpo.{self.name}" if self.name else self.kind

    @property
    def trains(self) -> bool:
        return self.kind in TRAINING

    @property
    def model(self) -> str:
        """The model folder a training stage outputs, under artifacts/models/ (dvc.yaml)."""
        return self.name or self.kind

    @property
    def log(self) -> PurePosixPath:
        """Its output, as the flow saves it in the workspace."""
        return PurePosixPath("logs") / f"{self.dvc}.log"


def known(text: str) -> StageId | None:
    """`StageId.parse(text)`, or None for a stage that is not the pipeline's (one a user added to dvc.yaml)."""
    try:
        return StageId.parse(text)
    except ValueError:
        return None


def kind_of(text: str) -> str | None:
    """The kind of stage `text` names (`grpo` for `grpo@dense`), None for one not the pipeline's."""
    stage = known(text)
    return stage.kind if stage else None


def training_stages(config) -> list[StageId]:
    """The training stages, in order: `sft` (unless `sft: off`), then each GRPO stage."""
    return [StageId("sft")] * config.sft.enabled + [*map(StageId.grpo, config.grpo)]


def final(config) -> StageId:
    """The stage whose model is the pipeline's result: the last GRPO stage."""
    return StageId.grpo(list(config.grpo)[-1])
