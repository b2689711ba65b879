"""Stage `sft`: supervised warmup with TRL's SFTTrainer on the train split.

The `sft.trl` block goes into `SFTConfig` unchanged; posttrain sets only the output
folder (checkpoints outside the DVC output, so a rerun can resume) and MLflow logging.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow

from posttrain import checkpoints
from posttrain.config import build_trl_config
from posttrain.io import read_jsonl, resolve_model_dir, write_json
from posttrain.tracking import stage_run


def main(config, *, data_dir: str, base_dir: str, out_dir: str, checkpoint_dir: str,
         metrics_path: str) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    with stage_run(config, "sft"):
        rows = read_jsonl(Path(data_dir) / "train.jsonl")
        dataset = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
        base = resolve_model_dir(base_dir)
        run_dir = checkpoints.run_dir(checkpoint_dir, [config.seed, config.sft.trl], [Path(data_dir), base])
        args = build_trl_config("sft.trl", SFTConfig, {"seed": config.seed, **config.sft.trl},
                                output_dir=run_dir, report_to=["mlflow"], run_name="sft")
        trainer = SFTTrainer(model=base, args=args, train_dataset=dataset,
                             processing_class=AutoTokenizer.from_pretrained(base))
        seconds = train(trainer, run_dir)
        trainer.save_model(out_dir)
        checkpoints.clear(checkpoint_dir)
        metrics = {"train_seconds": seconds, "train_loss": trainer.state.log_history[-1].get("train_loss", 0.0),
                   "steps": float(trainer.state.global_step)}
        mlflow.log_metrics(metrics)
        write_json(metrics_path, metrics)
    return metrics


def train(trainer, checkpoint_dir: str) -> float:
    """Run `trainer.train()`, resuming from the newest checkpoint if one exists.

    Returns the wall time of `train()` in seconds (the orchestration benchmark's unit).
    """
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(checkpoint_dir) if Path(checkpoint_dir).is_dir() else None
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=last)
    return time.perf_counter() - start
