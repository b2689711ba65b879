"""What the memory savers cost in quality: the default recipe's GRPO stage trained three ways
from the same SFT warmup (same seed, same CPU: the warmup is the same model), on the same
held-out split.

- `full`: the default recipe as it ships (every weight, AdamW);
- `8bit`: `grpo.dense.trl.optim: adamw_bnb_8bit` (bitsandbytes' 8-bit AdamW states);
- `top_half`: `grpo.dense.trainable: {top_layers: 2}` (the top 2 of the tiny model's 4 layers
  and the final norm train; the embedding, which is also the head, and the lower layers are frozen).

Per variant and seed: the final model's held-out greedy accuracy and pass@8 with 95% intervals,
its change from the SFT model (paired McNemar / bootstrap p) and from the `full` run on the same
prompts (paired), the gate's verdict, the stage's training seconds and its planned peak memory
(the optimizer states and the total, as the stage logged its plan).

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


def summarise(ws: Path, name: str, seed: int, full: Path, resamples: int) -> dict:
    evaluate, grpo = read_json(ws / "metrics" / "evaluate.json"), read_json(ws / "metrics" / "grpo" / "dense.json")
    outcomes = read_json(ws / "reports" / "heldout_outcomes.json")
    reference = read_json(full / "reports" / "heldout_outcomes.json")
    plans = read_json(ws / "reports" / "memory.json")["stages"]["grpo@dense"]
    test = {m: stats.compare(outcomes["sft"], outcomes["grpo"], m, resamples=resamples, seed=seed)
            for m in ("greedy_accuracy", f"pass_at_k.{K}")}
    versus = {m: stats.compare(reference["grpo"], outcomes["grpo"], m, resamples=resamples, seed=seed)
              for m in ("greedy_accuracy", f"pass_at_k.{K}")}
    final, sft, base = evaluate["grpo"], evaluate["sft"], read_json(full / "metrics" / "evaluate.json")["grpo"]
    return {"variant": name, "seed": seed, "sft_greedy": sft["greedy_accuracy"],
            "final_greedy": final["greedy_accuracy"], "final_greedy_ci95": final["greedy_accuracy_ci95"],
            "final_pass8": final["pass_at_k"][str(K)], "final_pass8_ci95": final["pass_at_k_ci95"][str(K)],
            "gain": final["greedy_accuracy"] - sft["greedy_accuracy"], "gain_p": test["greedy_accuracy"].p_value,
            "vs_full_greedy": final["greedy_accuracy"] - base["greedy_accuracy"],
            "vs_full_greedy_p": versus["greedy_accuracy"].p_value,
            "vs_full_pass8": final["pass_at_k"][str(K)] - base["pass_at_k"][str(K)],
            "vs_full_pass8_p": versus[f"pass_at_k.{K}"].p_value,
            "accepted": bool(grpo.get("accepted")), "train_seconds": grpo.get("train_seconds", 0.0),
            "trainable_params": plans["trainable_params"], "optimizer_bytes": plans["optimizer_bytes"],
            "planned_bytes": plans["total_bytes"], "n_prompts": final["n_prompts"]}


def table(rows: list[dict]) -> str:
    lines = [f"| variant | seed | trained params | planned optimizer / peak MiB | final greedy [95% CI] | gain over SFT "
             f"(p) | vs full (paired p) | pass@{K} [95% CI] | vs full (paired p) | gate | train s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['seed']} | {r['trainable_params']:,} "
                     f"| {r['optimizer_bytes'] / MIB:.1f} / {r['planned_bytes'] / MIB:.0f} "
                     f"| {interval(r['final_greedy'], r['final_greedy_ci95'])} "
                     f"| {r['gain']:+.3f} ({stats.format_p(r['gain_p'])}) "
                     f"| {r['vs_full_greedy']:+.3f} ({stats.format_p(r['vs_full_greedy_p'])}) "
                     f"| {interval(r['final_pass8'], r['final_pass8_ci95'])} "
                     f"| {r['vs_full_pass8']:+.3f} ({stats.format_p(r['vs_full_pass8_p'])}) "
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
