"""What the memory savers cost in quality: the default recipe's GRPO stage trained three ways
from the same SFT warmup (same seed, same CPU: the warmup is the same model), on the same
held-out split.

- `full`: the default recipe as it ships (every weight, AdamW);
- `8bit`: `grpo.dense.trl.optim: adamw_bnb_8bit` (bitsandbytes' 8-bit AdamW states);
- `top_half`: `grpo.dense.trainable: {top_layers: 2}` (the top 2 of the tiny model's 4 layers
  and the final norm train; the embedding, which is also the head, and the lower layers are frozen).

Per variant and seed: the trained model's held-out greedy accuracy and pass@8 with 95%
intervals (the gate's evaluation of what the stage trained, `gate.n_samples` per prompt, kept even
when the gate rejects it and passes the SFT model on), its change from the SFT model (the gate's
paired McNemar / bootstrap p) and from the `full` run on the same prompts (paired, on the evaluate
stage's samples, where both models were kept; a rejected model's per-prompt outcomes are not, so
its row gives the gate figures' difference, not paired), the training reward's first and last
logged values, the gate's verdict, the stage's training seconds and its planned peak memory (the
optimizer states and the total, as the stage logged its plan).

    .venv/bin/python bench/memory_savers.py                        # seed 0, ~25 min on 2 cores
    .venv/bin/python bench/memory_savers.py --seeds 0 1 --root /tmp/savers

A finished workspace is read, not rerun. Output: stdout and `<root>/memory_savers.{md,json}`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from real_model import interval, machine  # noqa: E402
from seed_sweep import K, run_seed  # noqa: E402

from posttrain import workspace  # noqa: E402
from posttrain.config import read_config_dict  # noqa: E402
from posttrain.files import read_json  # noqa: E402
from posttrain.scoring import stats  # noqa: E402

VARIANTS = {"full": {}, "8bit": {"trl": {"optim": "adamw_bnb_8bit"}}, "top_half": {"trainable": {"top_layers": 2}}}
MIB = 2**20


def variant(name: str) -> dict:
    """configs/pipeline.yaml with its GRPO stage changed as VARIANTS[name] says."""
    config = read_config_dict(REPO / "configs" / "pipeline.yaml")
    stage = copy.deepcopy(config["grpo"]["dense"])
    change = VARIANTS[name]
    stage["trl"] = {**stage["trl"], **change.get("trl", {})}
    stage.update({k: v for k, v in change.items() if k != "trl"})
    config["grpo"] = {"dense": stage}
    return config


def run_variant(root: Path, name: str, seed: int, uri: str, full: Path) -> Path:
    """`name`'s workspace for `seed`: a copy of the finished `full` one (git, DVC cache, the SFT
    model) with its config changed, run again (`posttrain run`): DVC reruns the GRPO stage and what
    follows it, not the warmup, so every variant starts from the same SFT model."""
    ws = root / name / f"seed{seed}"
    done = ws / "variant-finished"
    if done.is_file():
        return ws
    shutil.rmtree(ws, ignore_errors=True)
    shutil.copytree(full, ws, symlinks=True, ignore=shutil.ignore_patterns("posttrain-retrain.lock"))
    (ws / "configs" / "pipeline.yaml").write_text(yaml.safe_dump({**variant(name), "seed": seed}, sort_keys=False))
    with open(root / name / f"seed{seed}.log", "w") as out:
        ran = subprocess.run([workspace.tool_path("posttrain"), "run", "--workdir", str(ws)], cwd=ws, stdout=out,
                             stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_TRACKING_URI": uri})
    if ran.returncode:
        raise SystemExit(f"{name} seed {seed}: posttrain run failed (exit {ran.returncode}); see its log")
    done.write_text("")
    return ws


def figures(metrics: dict, prefix: str = "") -> dict:
    """Greedy accuracy and pass@K with their intervals, as a stage's metrics hold a gate
    evaluation (posttrain.training.trainer.gate_figures: the SFT model's unprefixed, a GRPO
    stage's trained model's as `candidate_*`)."""
    return {"greedy": metrics[f"{prefix}greedy_accuracy"], "greedy_ci95": metrics[f"{prefix}greedy_accuracy_ci95"],
            "pass8": metrics[f"{prefix}pass_at_{K}"], "pass8_ci95": metrics[f"{prefix}pass_at_{K}_ci95"]}


def summarise(ws: Path, name: str, seed: int, full: Path, resamples: int) -> dict:
    """`name`'s row for `seed`: what its GRPO stage trained (the gate's held-out evaluation),
    against the SFT model (the gate's paired p) and against the `full` run's: paired on the
    evaluate stage's outcomes where both models were kept, else the gate figures' difference."""
    grpo, reference = read_json(ws / "metrics" / "grpo" / "dense.json"), read_json(full / "metrics" / "grpo" / "dense.json")
    sft, trained, base = figures(read_json(ws / "metrics" / "sft.json")), figures(grpo, "candidate_"), figures(reference, "candidate_")
    plans = read_json(ws / "reports" / "memory.json")["stages"]["grpo@dense"]
    versus = {}
    if grpo.get("accepted") and reference.get("accepted"):  # both models' per-prompt outcomes were kept
        outcomes, kept = (read_json(w / "reports" / "heldout_outcomes.json")["grpo"] for w in (ws, full))
        versus = {f: stats.compare(kept, outcomes, metric, resamples=resamples, seed=seed)
                  for f, metric in (("greedy", "greedy_accuracy"), ("pass8", f"pass_at_k.{K}"))}
    row = {"variant": name, "seed": seed, "sft_greedy": sft["greedy"], "sft_pass8": sft["pass8"],
           **{f"trained_{key}": value for key, value in trained.items()},
           "gain": trained["greedy"] - sft["greedy"], "gain_p": grpo.get("gate_p_greedy_accuracy"),
           "gain_pass8": trained["pass8"] - sft["pass8"], "gain_pass8_p": grpo.get(f"gate_p_pass_at_{K}"),
           "accepted": bool(grpo.get("accepted")), "train_seconds": grpo.get("train_seconds", 0.0),
           "reward_first": grpo.get("reward_first"), "reward_last": grpo.get("reward_last"),
           "trainable_params": plans["trainable_params"], "optimizer_bytes": plans["optimizer_bytes"],
           "planned_bytes": plans["total_bytes"], "n_prompts": read_json(ws / "metrics" / "evaluate.json")["sft"]["n_prompts"]}
    for f, key in (("greedy", "vs_full_greedy"), ("pass8", "vs_full_pass8")):
        test = versus.get(f)
        row[key], row[f"{key}_p"] = (test.difference, test.p_value) if test else (trained[f] - base[f], None)
    return row


def change(value: float, p: float | None) -> str:
    """A difference with its paired p, or with "not paired" where no per-prompt outcomes exist."""
    return f"{value:+.3f} ({stats.format_p(p) if p is not None else 'not paired'})"


def table(rows: list[dict]) -> str:
    lines = [f"| variant | seed | trained params | planned optimizer / peak MiB | trained greedy [95% CI] | vs SFT (p) "
             f"| vs full (p) | pass@{K} [95% CI] | vs SFT (p) | vs full (p) | reward first -> last | gate | train s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['seed']} | {r['trainable_params']:,} "
                     f"| {r['optimizer_bytes'] / MIB:.1f} / {r['planned_bytes'] / MIB:.0f} "
                     f"| {interval(r['trained_greedy'], r['trained_greedy_ci95'])} | {change(r['gain'], r['gain_p'])} "
                     f"| {change(r['vs_full_greedy'], r['vs_full_greedy_p']) if r['variant'] != 'full' else '-'} "
                     f"| {interval(r['trained_pass8'], r['trained_pass8_ci95'])} "
                     f"| {change(r['gain_pass8'], r['gain_pass8_p'])} "
                     f"| {change(r['vs_full_pass8'], r['vs_full_pass8_p']) if r['variant'] != 'full' else '-'} "
                     f"| {r['reward_first']:.2f} -> {r['reward_last']:.2f} "
                     f"| {'accepted' if r['accepted'] else 'rejected'} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--root", default=str(REPO / "runs" / "bench-savers"))
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
    rows = []
    for seed in args.seeds:
        (root / "full").mkdir(exist_ok=True)
        full = run_seed(root / "full", variant("full"), seed, uri)
        for name in ["full"] + [v for v in args.variants if v != "full"]:
            (root / name).mkdir(exist_ok=True)
            ws = full if name == "full" else run_variant(root, name, seed, uri, full)
            rows.append(summarise(ws, name, seed, full, args.resamples))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"Measured on {machine()}; the default recipe (tiny model, {rows[0]['n_prompts']} held-out prompts), "
            "the GRPO stage changed alone.\n\n" + table(rows))
    print("\n" + text)
    (root / "memory_savers.md").write_text(text + "\n")
    (root / "memory_savers.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
