"""Stage `sft`: supervised warmup with TRL's SFTTrainer on the train split.

The `sft.trl` block goes into `SFTConfig` unchanged; posttrain sets only the output
folder (checkpoints outside the DVC output, so a rerun can resume) and MLflow logging.
The warmed-up model is evaluated on the held-out split: the first GRPO gate's baseline.
"""

from __future__ import annotations

from pathlib import Path

import mlflow

from posttrain import checkpoints
from posttrain.config import build_trl_config
from posttrain.envs import get_env
from posttrain.evaluation import check_format_contract
from posttrain.io import read_jsonl, resolve_model_dir, write_json
from posttrain.tracking import stage_run
from posttrain.training import gate_evaluation, train, write_card


def main(config, *, data_dir: str, base_dir: str, out_dir: str, checkpoint_dir: str,
         metrics_path: str) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    env = get_env(config.data.env, **config.data.options)
    train_path = Path(data_dir) / "train.jsonl"
    rows = read_jsonl(train_path)
    contract = check_format_contract(env, rows, where=str(train_path))  # before any run or compute
    with stage_run(config, "sft"):
        dataset = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
        base = resolve_model_dir(base_dir)
        run_dir = checkpoints.run_dir(checkpoint_dir, [config.seed, config.sft.trl], [Path(data_dir), base])
        args = build_trl_config("sft.trl", SFTConfig, {"seed": config.seed, **config.sft.trl},
                                output_dir=run_dir, report_to=["mlflow"], run_name="sft")
        trainer = SFTTrainer(model=base, args=args, train_dataset=dataset,
                             processing_class=AutoTokenizer.from_pretrained(base))
        seconds, resumed = train(trainer, run_dir)
        trainer.save_model(out_dir)
        checkpoints.clear(checkpoint_dir)
        evaluation = gate_evaluation(out_dir, env, config, data_dir)
        # the base model's score: the floor the reward-hacking sentinel holds every later stage to
        write_card(out_dir, {"stage": "sft", "eval": evaluation, "base": gate_evaluation(base, env, config, data_dir)})
        k = config.gate.k
        metrics = {"train_seconds": seconds, "steps": float(trainer.state.global_step),
                   "resumed_from_step": float(resumed),
                   "train_loss": next((e["train_loss"] for e in reversed(trainer.state.log_history)
                                       if "train_loss" in e), 0.0),
                   "format_contract": contract, "greedy_accuracy": evaluation["greedy_accuracy"],
                   f"pass_at_{k}": evaluation["pass_at_k"][str(k)]}
        mlflow.log_metrics({f"stage.{k}": v for k, v in metrics.items()})
        write_json(metrics_path, metrics)
    return metrics
