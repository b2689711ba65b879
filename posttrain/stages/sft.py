"""Stage `sft`: supervised warmup with TRL's SFTTrainer on the train split.

The `sft.trl` block goes into `SFTConfig` unchanged; posttrain sets only the output
folder (checkpoints outside the DVC output, so a rerun can resume) and MLflow logging.
With `sft.stop_when`, training stops once greedy accuracy on a validation split carved
from the training rows reaches the target (`posttrain.training.stopping`); the validation curve
goes to MLflow (`validation_greedy_accuracy` by step) and to `curve_path`, the step it
stopped at to the metrics. The warmed-up model is evaluated on the held-out split: the
first GRPO gate's baseline. With `sft: off` the stage trains nothing: its output holds
only a card saying so, and the first GRPO stage starts from the base model.
"""

from __future__ import annotations

import functools
from pathlib import Path

from posttrain.training import checkpoints
from posttrain.capacity import fit
from posttrain.runtime import launch
from posttrain.chat import sft_rows, tool_ready
from posttrain.training.trl_bridge import build_trl_config, stage_options
from posttrain.envs import config_env
from posttrain.envs.tools import is_tool_env, tool_schemas
from posttrain.scoring.evaluation import add_timeout_counts, check_format_contract, report_timeouts
from posttrain.files import read_jsonl, write_json
from posttrain.stageid import StageId
from posttrain.layout import PARAMS_FILE, resolve_model_dir, write_card
from posttrain.tracking.lineage import log_datasets
from posttrain.training.stopping import StopOnTarget, carve_validation, validation_curve
from posttrain.tracking.mlflow_runs import compute, stage_run
from posttrain.tracking.recorder import Recorder
from posttrain.training.trainable import freeze
from posttrain.training.trainer import gate_evaluation, gate_figures, lora_config, save_model, train


def main(config, *, data_dir: str, base_dir: str, out_dir: str, checkpoint_dir: str,
         metrics_path: str, curve_path: str, config_path: str = PARAMS_FILE) -> dict[str, float]:
    if not config.sft.enabled:
        return off(config, out_dir, metrics_path, curve_path)
    env = config_env(config.data)
    train_path = Path(data_dir) / "train.jsonl"
    rows = read_jsonl(train_path)
    contract = check_format_contract(env, rows, where=str(train_path))  # before any run or compute
    rows, validation = split_validation(config, rows)
    memory = fit.checked_plan(config, "sft", config_path=config_path)  # a stage that cannot fit stops here
    with stage_run(config, "sft") as recorder:
        fit.log_plan(memory, recorder)
        log_datasets({str(train_path): "training", f"{data_dir}/heldout.jsonl": "evaluation"})
        base = resolve_model_dir(base_dir)
        # a checkpoint resumes only under the same launcher (world size, sharding)
        run_dir = checkpoints.run_dir(checkpoint_dir, [config.seed, config.sft.model_dump(),
                                                       config.stage_launcher("sft").model_dump()], [Path(data_dir), base])
        with compute("train"):
            trained = launch.train(config, "sft", train_job, {"rows": rows, "validation": validation,
                                   "base": base, "run_dir": run_dir, "out_dir": out_dir})
        checkpoints.clear(checkpoint_dir)
        with compute("gate"):
            evaluation = gate_evaluation(out_dir, env, config, data_dir)
            # the base model's score: the floor the reward-hacking sentinel holds every later stage to
            base_evaluation = gate_evaluation(base, env, config, data_dir)
        write_card(out_dir, {"stage": "sft", "eval": evaluation, "base": base_evaluation})
        curve = validation_curve(trained["log_history"])
        metrics = {"train_seconds": trained["seconds"], "steps": float(trained["steps"]),
                   "resumed_from_step": float(trained["resumed"]), "world_size": float(trained["world_size"]),
                   "train_loss": next((e["train_loss"] for e in reversed(trained["log_history"])
                                       if "train_loss" in e), 0.0),
                   "format_contract": contract, **trained.get("counts", {}),
                   **stop_metrics(config, curve, trained["steps"], trained["measuring"], recorder),
                   **gate_figures(evaluation, config.gate.k)}
        report_timeouts("stage sft", add_timeout_counts(metrics, env), recorder)  # the gate's matches cut at a limit
        recorder.metrics(metrics, prefix="stage.")
        write_json(metrics_path, metrics)
        write_json(curve_path, curve)
    return metrics


def off(config, out_dir: str, metrics_path: str, curve_path: str) -> dict[str, float]:
    """`sft: off`: no warmup, no model; the output folder holds the card that says so (DVC
    keeps it as the stage's output, so the graph is the same with or without a warmup)."""
    with stage_run(config, "sft") as recorder:
        recorder.tag("posttrain.sft", "off: the first GRPO stage starts from the base model")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_card(out_dir, {"stage": "sft", "off": True})
        metrics = {"off": 1.0}
        recorder.metrics(metrics, prefix="stage.")
        write_json(metrics_path, metrics)
        write_json(curve_path, [])
    return metrics


def split_validation(config, rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(rows SFT trains on, validation rows `stop_when` measures on; [] without it).
    The config check made sure the split leaves at least half the rows to train on."""
    stop = config.sft.stop_when
    return (rows, []) if stop is None else carve_validation(rows, stop.validation_size, config.seed)


def train_job(config, job: dict) -> dict:
    """Train with TRL and save the model to `job["out_dir"]` (on every rank of a launched
    job: posttrain.runtime.launch); what the stage reads back: the log history, the step count, wall
    seconds of train(), the step it resumed from, the seconds spent measuring for `stop_when`."""
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer
    from trl import SFTConfig, SFTTrainer

    base, run_dir = job["base"], job["run_dir"]
    env = config_env(config.data)
    tokenizer, tools = AutoTokenizer.from_pretrained(base), None
    if is_tool_env(env):  # the gold episodes, the tool results masked out of the loss (stage_options)
        tool_ready(tokenizer)
        tools = tool_schemas(env.episode)
    dataset = Dataset.from_list(sft_rows(job["rows"], tools))
    args = build_trl_config("sft.trl", SFTConfig, stage_options(config, StageId("sft"), env), output_dir=run_dir,
                            report_to=[], run_name="sft")
    trainer = SFTTrainer(model=base, args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora_config("sft.peft", config.sft.peft))
    counts = freeze(trainer.model, config.sft.trainable, "sft.trainable") if config.sft.trainable else {}
    recorder = Recorder.active()  # the stage's run, on the rank that logs (posttrain.runtime.launch)
    recorder.follow(trainer)
    stop, stopper = config.sft.stop_when, None
    if stop is not None:
        # Trainer.log, not SFTTrainer.log: TRL's override would take the token-accuracy averages it logs next
        stopper = StopOnTarget(env, job["validation"],
                               target=stop.greedy_accuracy, every_steps=stop.every_steps,
                               max_new_tokens=config.evaluate.max_new_tokens, log=functools.partial(Trainer.log, trainer))
        trainer.add_callback(stopper)
    seconds, resumed = train(trainer, run_dir)
    save_model(trainer, job["out_dir"], recorder)
    return {"log_history": trainer.state.log_history, "steps": trainer.state.global_step, "seconds": seconds,
            "resumed": resumed, "measuring": stopper.seconds if stopper else 0.0, "counts": counts}


def stop_metrics(config, curve: list[dict], steps: int, measuring: float, recorder: Recorder) -> dict[str, float]:
    """Where `stop_when` stopped: the step, whether the target was reached, the last value.
    A warmup that hit the cap first says so, loudly: GRPO then starts from a weaker model."""
    stop = config.sft.stop_when
    if stop is None:
        return {}
    last = curve[-1]["greedy_accuracy"] if curve else 0.0
    reached = last >= stop.greedy_accuracy
    recorder.tag("posttrain.sft_stop", f"target {stop.greedy_accuracy} {'reached' if reached else 'NOT reached'}"
                                         f" at step {steps} (validation greedy {last:.3f})")
    if not reached:
        print(f"posttrain: WARNING: sft.stop_when: validation greedy accuracy {last:.3f} at the cap (step {steps}) "
              f"is below the target {stop.greedy_accuracy}; raise the `trl:` epochs or the learning rate", flush=True)
    return {"stopped_at_step": float(steps), "stop_target_reached": float(reached),
            "validation_greedy_accuracy": last, "validation_rows": float(stop.validation_size),
            "validation_seconds": measuring}
