"""Stage `grpo@<name>`: one GRPO stage with TRL's GRPOTrainer, gated on held-out truth.

The stage starts from the model the previous stage accepted (`from:`), keeps only the
training prompts whose pass rate lies inside the configured band, trains, evaluates the
result on the held-out split, and outputs it only if the gate accepts it; otherwise it
outputs the previous model unchanged. Each stage's `trl:` block goes into `GRPOConfig`.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path


from posttrain.training import checkpoints
from posttrain.capacity import fit
from posttrain.runtime import launch
from posttrain.chat import grpo_rows, tool_ready
from posttrain.training.trl_bridge import build_trl_config, option, stage_options
from posttrain.envs import config_env
from posttrain.envs.tools import guard, is_tool_env, tool_limits
from posttrain.scoring.evaluation import add_timeout_counts, pass_rates, report_timeouts
from posttrain.files import read_jsonl, write_json
from posttrain.layout import PARAMS_FILE, read_card, resolve_model_dir, write_card
from posttrain.tracking.lineage import log_datasets
from posttrain.scoring.gate import decide, reward_trend
from posttrain.scoring.rewards import build_rewards
from posttrain.stageid import StageId
from posttrain.errors import UserError
from posttrain.scoring.audit import agreement, audit_stages, fix_for, summary
from posttrain.tracking.mlflow_runs import compute, stage_run
from posttrain.tracking.recorder import Recorder
from posttrain.training.trainable import freeze
from posttrain.training.trainer import gate_evaluation, gate_figures, lora_config, save_model, train

ZERO_STD_WARNING = 0.5


def main(config, *, name: str, data_dir: str, init_dir: str, out_dir: str, checkpoint_dir: str,
         metrics_path: str, curve_path: str, audit_path: str, layers_path: str,
         config_path: str = PARAMS_FILE) -> dict[str, float]:
    stage, stage_id = config.grpo[name], StageId.grpo(name)
    memory = fit.checked_plan(config, stage_id.dvc, config_path=config_path)  # a stage that cannot fit stops here
    with stage_run(config, stage_id.dvc) as recorder:
        fit.log_plan(memory, recorder)
        log_datasets({f"{data_dir}/train.jsonl": "training", f"{data_dir}/heldout.jsonl": "evaluation"})
        env = config_env(config.data)
        previous = read_card(init_dir)
        init_dir = resolve_model_dir(init_dir)  # `from: base` with model.path: prepare's pointer to the weights
        if not previous:  # the base model (`from: base`): its evaluation is also the sentinel's floor
            with compute("gate"):
                evaluation = gate_evaluation(init_dir, env, config, data_dir)
            previous = {"eval": evaluation, "base": evaluation if stage.from_ == "base" else None}
        train_rows = read_jsonl(Path(data_dir) / "train.jsonl")
        with compute("audit"):
            audited = audit_rewards(config_path, config, name, env, train_rows)
        if previous.get("stopped_at"):
            record_audit(audited, audit_path, recorder)
            return pass_through(init_dir, out_dir, metrics_path, curve_path, layers_path, recorder,
                                f"stopped at {previous['stopped_at']}")
        with compute("filter"):
            rows, metrics, samples = filter_prompts(config, name, env, init_dir, train_rows)
        audit_agreement(config, name, env, audited, *samples)  # the starting model's own samples, scored
        record_audit(audited, audit_path, recorder)
        refuse_audit(config_path, config, name, audited)
        needed = prompts_per_step(config, stage_id)
        if len(rows) < needed:  # TRL's sampler would yield no batch: zero steps, and a gate on an unchanged model
            reason = (f"the pass-rate filter kept {len(rows)} prompt(s), fewer than the {needed} one step takes (mean "
                      f"pass rate {metrics.get('pass_rate_mean', 0.0):.3f}): nothing left to learn from; the "
                      "previous model passes on unchanged")
            print(f"posttrain: WARNING: stage {name}: {reason}", flush=True)
            recorder.tag("posttrain.warning.no_prompts", reason)
            return pass_through(init_dir, out_dir, metrics_path, curve_path, layers_path, recorder, reason,
                                {**metrics, "prompts_per_step": float(needed)})
        run_dir = checkpoints.run_dir(checkpoint_dir, [config.seed, stage.model_dump(),  # and the launcher, as in sft
                                                       config.stage_launcher(stage_id).model_dump()],
                                      [Path(data_dir), init_dir])
        with compute("train"):
            trained = launch.train(config, stage_id.dvc, train_job, {"name": name, "rows": rows,
                                   "init_dir": init_dir, "out_dir": out_dir, "run_dir": run_dir})
        curve = trained["curve"]
        metrics.update(trained["metrics"], world_size=float(trained["world_size"]))
        with compute("diagnostics"):  # before the gate: a rejected candidate is gone after it
            metrics.update(diagnose(config, name, init_dir, out_dir, rows, curve, layers_path, recorder))
        with compute("gate"):
            candidate = gate_evaluation(out_dir, env, config, data_dir)
        decision = decide(previous["eval"], candidate, k=config.gate.k, tolerance=config.gate.tolerance,
                          alpha=config.stats.alpha, resamples=config.stats.bootstrap_resamples, seed=config.seed,
                          reward=reward_trend([point["reward"] for point in curve]), base=previous.get("base"))
        verdict = {"accepted": decision.accepted, "reason": decision.reason, "p_values": decision.p_values}
        card = {"stage": name, "eval": candidate, "base": previous.get("base"), "gate": verdict}
        if not decision.accepted:
            shutil.rmtree(out_dir)
            shutil.copytree(init_dir, out_dir)
            stop = name if config.gate.on_reject == "stop" else None
            card = {**previous, "rejected": name, "stopped_at": stop, "gate": verdict}
        write_card(out_dir, card)
        checkpoints.clear(checkpoint_dir)
        metrics.update(gate_metrics(candidate, decision, config.gate.k),
                       start_greedy_accuracy=previous["eval"]["greedy_accuracy"])
        add_timeout_counts(metrics, env)  # the filter's and the gate's, beside training's
        record(name, metrics, decision, curve, metrics_path, curve_path, recorder)
    return metrics


def audit_rewards(config_path: str, config, name: str, env, rows: list[dict]) -> dict:
    """The stage's reward audit (posttrain.scoring.audit) on its training rows, whatever its
    `audit` action (`off`: none); a breach is recorded and refused here, before the filter's
    compute, when the action is `refuse` (`posttrain run` refused it before any stage)."""
    action = config.grpo[name].audit.action
    if action == "off":
        return {"action": "off"}
    report = audit_stages(config_path, config, env, rows, names=[name])[name]
    audited = {"action": action, **report.as_dict()}
    print(f"posttrain: {summary(report, action)}", flush=True)
    if report.breaches and action == "refuse":
        record_audit(audited, None)
        refuse_audit(config_path, config, name, audited)
    return audited


def audit_agreement(config, name: str, env, audited: dict, rows: list[dict], samples: list[list[str]]) -> None:
    """The reward against the verifier on the filter's samples of the starting model, into
    `audited` (none without the filter); more false reward than `audit.max_false_reward`
    (its interval's low end above it) is a breach."""
    stage = config.grpo[name]
    if audited["action"] == "off" or not rows:
        return
    found = agreement(env, stage.rewards, stage.guardrails, rows, samples, audited["gold_min"], audited["stage_min"])
    audited["agreement"] = found
    if found["false_reward_interval"][0] > stage.audit.max_false_reward:
        audited["passed"] = False
        audited["breaches"].append({"family": "false reward", "kind": "agreement", "score": found["false_reward"],
                                    "ceiling": stage.audit.max_false_reward, "example": "", "answer": "",
                                    "line": (f"grpo.{name}.rewards: the reward pays {found['false_reward']:.1%} "
                                             f"(95% CI {found['false_reward_interval'][0]:.1%}.."
                                             f"{found['false_reward_interval'][1]:.1%}) of the starting model's "
                                             f"{found['wrong']} wrong samples as if right, above "
                                             f"audit.max_false_reward {stage.audit.max_false_reward}")})
    print(f"posttrain: stage {name}: the reward pays {found['false_reward']:.1%} of {found['wrong']} wrong samples "
          f"and misses {found['missed_reward']:.1%} of {found['right']} right ones", flush=True)


def record_audit(audited: dict, audit_path: str | None, recorder: Recorder) -> None:
    """The audit into the stage's MLflow run (audit.json, its counts, a tag) and `audit_path`."""
    if audit_path:
        write_json(audit_path, audited)
    if audited["action"] == "off":
        recorder.tag("posttrain.audit", "off")
        return
    recorder.dict(audited, "audit.json")
    found = audited.get("agreement", {})
    recorder.metrics({"audit.exploits": float(audited["exploits"]), "audit.breaches": float(len(audited["breaches"])),
                      "audit.gold_min": audited["gold_min"],
                      **{f"audit.{k}": float(found[k]) for k in ("false_reward", "missed_reward") if k in found}})
    verdict = "passed" if audited["passed"] else ("refused" if audited["action"] == "refuse" else "warned")
    recorder.tag("posttrain.audit", verdict)


def refuse_audit(config_path: str, config, name: str, audited: dict) -> None:
    """UserError at the first breach when the stage's action is `refuse`; a WARNING per
    breach when `warn`."""
    lines = [b["line"] for b in audited.get("breaches", [])]
    if lines and audited["action"] == "refuse":
        raise UserError(config_path, lines[0], fix_for(name))
    for line in lines:
        print(f"posttrain: WARNING: {line} (audit: warn)", flush=True)


def filter_prompts(config, name: str, env, init_dir: str, rows: list[dict]) -> tuple[list[dict], dict, tuple]:
    """The prompts inside the pass-rate band, the filter's counts and zero-std shares, and
    the rows it sampled with their samples (none when the filter is off).

    A prompt whose samples are all right or all wrong gives its group zero advantage; the
    share of such prompts is the zero-std share the stage would see without the filter.
    """
    band = config.grpo[name].pass_rate_filter
    if band.max_prompts is not None and len(rows) > band.max_prompts:
        rows = random.Random(config.seed).sample(rows, band.max_prompts)
    if not band.enabled:
        return rows, {"prompts_kept": float(len(rows)), "prompts_dropped": 0.0}, ([], [])
    stage_id = StageId.grpo(name)
    options = stage_options(config, stage_id, env)  # what the trainer samples with
    temperature = band.temperature or option(stage_id, options, "temperature")
    rates, sampled = pass_rates(init_dir, env, rows, samples=band.samples, temperature=temperature,
                       max_new_tokens=option(stage_id, options, "max_completion_length"),
                       seed=config.seed, limits=tool_limits(config), episodes_backend=config.gate.episodes_backend,
                       data=config.data)
    keep = [band.min_pass_rate < p < band.max_pass_rate for p in rates]
    if not any(keep):
        keep = [True] * len(rows)  # nothing inside the band: training on everything beats training on nothing
    kept = [r for r, k in zip(rows, keep) if k]
    share = sum(p in (0.0, 1.0) for p in rates) / len(rates)
    kept_share = sum(p in (0.0, 1.0) for p, k in zip(rates, keep) if k) / len(kept)
    return kept, {"prompts_kept": float(len(kept)), "prompts_dropped": float(len(rows) - len(kept)),
                  "zero_std_share_unfiltered_est": share, "zero_std_share_filtered_est": kept_share,
                  "pass_rate_mean": sum(rates) / len(rates)}, (rows, sampled)


def train_job(config, job: dict) -> dict:
    """Train with TRL and save the model to `job["out_dir"]` (on every rank of a launched
    job: posttrain.runtime.launch); returns the reward curve and the training summary."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    name, init_dir, run_dir = job["name"], job["init_dir"], job["run_dir"]
    stage = config.grpo[name]
    env = config_env(config.data)
    funcs, _ = build_rewards(env, stage.rewards, stage.guardrails)
    field = StageId.grpo(name).field
    args = build_trl_config(f"{field}.trl", GRPOConfig, stage_options(config, StageId.grpo(name), env),
                            output_dir=run_dir, report_to=[], run_name=name)
    dataset = Dataset.from_list(grpo_rows(job["rows"]))
    tokenizer, episodes = AutoTokenizer.from_pretrained(init_dir), {}
    if is_tool_env(env):  # TRL runs the episodes: one guarded instance per rollout
        tool_ready(tokenizer)
        episodes = {"environment_factory": guard(env.episode, tool_limits(config))}
    trainer = GRPOTrainer(model=init_dir, reward_funcs=funcs, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora_config(f"{field}.peft", stage.peft),
                          **episodes)
    counts = freeze(trainer.model, stage.trainable, f"{field}.trainable") if stage.trainable else {}
    recorder = Recorder.active()  # the stage's run, on the rank that logs (posttrain.runtime.launch)
    recorder.follow(trainer)
    seconds, resumed = train(trainer, run_dir)
    save_model(trainer, job["out_dir"], recorder)
    logs = [e for e in trainer.state.log_history if "reward" in e]
    curve = [{"step": e["step"], "reward": e["reward"], "frac_reward_zero_std": e["frac_reward_zero_std"],
              **{k.split("/")[1]: e[k] for k in e if k.startswith("rewards/") and k.endswith("/mean")}}
             for e in logs]
    zero_std = [e["frac_reward_zero_std"] for e in logs] or [0.0]
    summary = {"train_seconds": seconds, "steps": float(trainer.state.global_step), "resumed_from_step": float(resumed),
               "reward_first": logs[0]["reward"] if logs else 0.0, "reward_last": logs[-1]["reward"] if logs else 0.0,
               "frac_reward_zero_std_mean": sum(zero_std) / len(zero_std), "frac_reward_zero_std_last": zero_std[-1],
               **counts}
    return {"curve": curve, "metrics": add_timeout_counts(summary, env)}  # the rewards' matches cut at a limit


KL_PROMPTS, KL_SAMPLES = 16, 4
KL_MAX_BYTES = 4 << 30  # a larger checkpoint is not loaded twice more on the stage's host for the KL figure


def diagnose(config, name: str, init_dir: str, out_dir: str, rows: list[dict], curve: list[dict],
             layers_path: str, recorder: Recorder) -> dict[str, float]:
    """Why the stage learned or did not (posttrain.training.diagnostics): the relative weight
    change of each layer (`layers_path`, a plot by layer in MLflow), the KL of the trained
    policy to its start on its own samples of training prompts, and the share of groups
    that carried a gradient."""
    from posttrain.training.diagnostics import (change_figures, gradient_share, kl_to_start, plot_layers,
                                                weight_change_by_layer)

    layers = weight_change_by_layer(init_dir, out_dir)
    write_json(layers_path, layers)
    recorder.dict(layers, f"weight_change_{name}.json")
    plot_layers(layers, name, recorder)
    figures = {**change_figures(layers), "gradient_share": gradient_share(curve)}
    if sum(p.stat().st_size for p in Path(out_dir).glob("*.safetensors")) <= KL_MAX_BYTES:
        stage_id = StageId.grpo(name)
        length = option(stage_id, stage_options(config, stage_id), "max_completion_length")  # as the stage sampled
        figures["kl_to_start"] = kl_to_start(init_dir, out_dir, [r["prompt"] for r in rows[:KL_PROMPTS]],
                                             samples=KL_SAMPLES, seed=config.seed, max_new_tokens=length)
    return figures


def gate_metrics(candidate: dict, decision, k: int) -> dict:
    """The candidate's figures with their intervals, the verdict, and the p-values of the
    paired tests against the previous model (`gate_p_<figure>`)."""
    return {**gate_figures(candidate, k, prefix="candidate_"), "accepted": float(decision.accepted),
            **{f"gate_p_{name}": p for name, p in (decision.p_values or {}).items()}}


def record(name, metrics, decision, curve, metrics_path, curve_path, recorder: Recorder) -> None:
    """Metrics to the stage's run and metrics/, the gate's verdict as tags, loud warnings."""
    recorder.metrics(metrics, prefix="stage.")
    tags = {"posttrain.scoring.gate": "accepted" if decision.accepted else "rejected", "posttrain.gate_reason": decision.reason}
    if metrics.get("frac_reward_zero_std_mean", 0.0) > ZERO_STD_WARNING:
        warning = (f"stage {name}: {metrics['frac_reward_zero_std_mean']:.0%} of groups had zero reward variance "
                   "(no gradient); widen the pass-rate band, add a denser reward channel, or change temperature")
        print(f"posttrain: WARNING: {warning}", flush=True)
        tags["posttrain.warning.zero_std"] = warning
    report_timeouts(f"stage {name}", metrics, recorder)
    print(f"posttrain: gate {tags['posttrain.scoring.gate']} stage {name}: {decision.reason}", flush=True)
    recorder.tags(tags)
    write_json(metrics_path, metrics)
    write_json(curve_path, curve)


def prompts_per_step(config, stage_id) -> int:
    """The distinct prompts one optimizer step samples: per-device batch x processes x
    nodes x accumulation, over the generations per prompt (TRL's defaults where the
    stage's `trl:` block is silent)."""
    options, launcher = stage_options(config, stage_id), config.stage_launcher(stage_id)
    batch = option(stage_id, options, "per_device_train_batch_size") * launcher.processes * launcher.nodes
    return max(1, batch * option(stage_id, options, "gradient_accumulation_steps")
               // option(stage_id, options, "num_generations"))


def pass_through(init_dir, out_dir, metrics_path, curve_path, layers_path, recorder: Recorder, reason: str,
                 metrics: dict | None = None) -> dict[str, float]:
    """Output the model unchanged, untrained: an earlier stage was rejected with
    `on_reject: stop`, or the filter left too few prompts for one step."""
    shutil.copytree(init_dir, out_dir)
    recorder.tags({"posttrain.scoring.gate": "skipped", "posttrain.gate_reason": reason})
    metrics = {**(metrics or {}), "skipped": 1.0, "accepted": 0.0}
    write_json(metrics_path, metrics)
    write_json(curve_path, [])
    write_json(layers_path, [])  # nothing trained, nothing moved
    return metrics
