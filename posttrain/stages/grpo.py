"""Stage `grpo`: GRPO stages with TRL's GRPOTrainer, each starting where the last ended.

Reward channels come from the environment's registry (`posttrain.rewards`); each
stage's `trl:` block goes into `GRPOConfig` unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow

from posttrain import checkpoints
from posttrain.config import build_trl_config
from posttrain.envs import get_env
from posttrain.io import read_jsonl, write_json
from posttrain.rewards import build_rewards
from posttrain.stages.sft import train
from posttrain.tracking import stage_run


def main(config, *, data_dir: str, init_dir: str, out_dir: str, checkpoint_dir: str,
         metrics_path: str, curve_path: str) -> dict[str, float]:
    with stage_run(config, "grpo"):
        env = get_env(config.data.env, **config.data.options)
        rows = read_jsonl(Path(data_dir) / "train.jsonl")
        metrics, curve, start = {}, [], init_dir
        for stage in config.grpo:
            stage_out = str(Path(out_dir) / stage.name)
            run_dir = checkpoints.run_dir(Path(checkpoint_dir) / stage.name,
                                          [config.seed, stage.model_dump()], [Path(data_dir), start])
            stage_metrics, stage_curve = run_stage(config, stage, env, rows, start, stage_out, run_dir)
            metrics[stage.name] = stage_metrics
            curve += [{"stage": stage.name, **point} for point in stage_curve]
            start = stage_out
        shutil.copytree(start, Path(out_dir) / "final")
        checkpoints.clear(checkpoint_dir)
        mlflow.log_metrics({f"{name}.{k}": v for name, m in metrics.items() for k, v in m.items()})
        write_json(metrics_path, metrics)
        write_json(curve_path, curve)
    return metrics


def run_stage(config, stage, env, rows, init_dir, out_dir, checkpoint_dir):
    """Train one GRPO stage; returns its summary metrics and its reward curve."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    args = build_trl_config(f"grpo.{stage.name}.trl", GRPOConfig, {"seed": config.seed, **stage.trl},
                            output_dir=checkpoint_dir, report_to=["mlflow"], run_name=stage.name)
    trainer = GRPOTrainer(model=init_dir, reward_funcs=build_rewards(env, stage.rewards), args=args,
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(init_dir))
    seconds = train(trainer, checkpoint_dir)
    trainer.save_model(out_dir)
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    curve = [{"step": e["step"], "reward": e["reward"], "frac_reward_zero_std": e["frac_reward_zero_std"]}
             for e in logs]
    zero_std = [e["frac_reward_zero_std"] for e in logs] or [0.0]
    return {"train_seconds": seconds, "steps": float(trainer.state.global_step),
            "reward_first": logs[0]["reward"] if logs else 0.0, "reward_last": logs[-1]["reward"] if logs else 0.0,
            "frac_reward_zero_std_mean": sum(zero_std) / len(zero_std),
            "frac_reward_zero_std_last": zero_std[-1]}, curve
