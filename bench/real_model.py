"""The learning result on a real model: SmolLM2-135M-Instruct through the whole pipeline,
over seeds, base instruct model against the final model on the held-out split.

Runs `configs/recipes/smollm2-arithmetic.yaml` (or `--config`) once per seed, each in its own
git + DVC workspace (`posttrain run`: the Prefect flow, every stage), and prints per seed the
base and final models' held-out greedy accuracy and pass@8 with their 95% intervals, the paired
p-values (exact McNemar on greedy, paired bootstrap on pass@8, same prompts), the base model's
format rate (replies that are the bare number: the verifier reads the last number, so the
accuracy counts right sums, not format), the SFT model between them, and the minutes each
training stage took (train() only, and the whole stage with its gate evaluations).

    make smollm2 && make bench-real                     # seeds 0-2, about an hour on 2 cores
    .venv/bin/python bench/real_model.py --seeds 0 --root /tmp/real

A seed whose workspace finished is read, not rerun. The table goes to stdout and, with the
raw numbers, to `<root>/real_model.{md,json}`. The goal (issue 27): the final model beats the
base by >= 15 points of greedy accuracy on every seed with p < 0.01, pass@8 not lower, at most
30 minutes of training per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from seed_sweep import last_run, run_seed  # noqa: E402

from posttrain.config import read_config_dict  # noqa: E402
from posttrain.files import read_json  # noqa: E402
from posttrain.scoring import stats  # noqa: E402
from posttrain.training import trl_bridge  # noqa: E402

K = 8  # pass@K: the largest k of the config's evaluate.k (main sets it)
GAIN, P_MAX, TRAIN_MINUTES = 0.15, 0.01, 30.0  # issue 27's goal


def summarise(ws: Path, seed: int, resamples: int, uri: str) -> dict:
    evaluate, outcomes = read_json(ws / "metrics" / "evaluate.json"), read_json(ws / "reports" / "heldout_outcomes.json")
    sft = read_json(ws / "metrics" / "sft.json")
    warmed = "sft" in evaluate  # `sft: off`: GRPO from the base model, no SFT model to report
    grpo = {p.stem: read_json(p) for p in sorted((ws / "metrics" / "grpo").glob("*.json"))}
    _, children = last_run(ws, uri)
    stage_seconds = {name: (c.end_time - c.start_time).total_seconds() for name, c in children.items()}
    base, final = evaluate["base"], evaluate["grpo"]
    test = {m: stats.compare(outcomes["base"], outcomes["grpo"], m, resamples=resamples, seed=seed)
            for m in ("greedy_accuracy", f"pass_at_k.{K}")}
    # what GRPO did: the final model against the model it started from (SFT's, else the base), same prompts
    start = "sft" if warmed else "base"
    rl = stats.compare(outcomes[start], outcomes["grpo"], "greedy_accuracy", resamples=resamples, seed=seed)
    train_seconds = sft.get("train_seconds", 0.0) + sum(m.get("train_seconds", 0.0) for m in grpo.values())
    models = (("base", "base"), ("sft", "sft"), ("final", "grpo"))  # sft_*: None without a warmup
    return {"seed": seed, "n_prompts": base["n_prompts"], "warmup": warmed,
            **{f"{name}_{figure}": evaluate[key][src] if key in evaluate else None for name, key in models
               for figure, src in (("greedy", "greedy_accuracy"), ("greedy_ci95", "greedy_accuracy_ci95"),
                                   ("format_rate", "format_rate"))},
            **{f"{name}_pass8": evaluate[key]["pass_at_k"][str(K)] for name, key in (("base", "base"), ("final", "grpo"))},
            **{f"{name}_pass8_ci95": evaluate[key]["pass_at_k_ci95"][str(K)] for name, key in (("base", "base"),
                                                                                               ("final", "grpo"))},
            "gain": final["greedy_accuracy"] - base["greedy_accuracy"], "gain_p": test["greedy_accuracy"].p_value,
            "grpo_gain": final["greedy_accuracy"] - evaluate[start]["greedy_accuracy"], "grpo_gain_p": rl.p_value,
            # tool environments: calls per greedy episode, base -> SFT -> final
            "tool_calls": [evaluate.get(key, {}).get("episodes", {}).get("tool_calls") for key in ("base", "sft", "grpo")],
            "pass8_p": test[f"pass_at_k.{K}"].p_value,
            "gates": {name: "accepted" if m.get("accepted") else "rejected" for name, m in grpo.items()},
            "grpo_diagnostics": {name: {k: m.get(k) for k in DIAGNOSTICS} for name, m in grpo.items()},
            "train_minutes": train_seconds / 60,
            "training_stage_minutes": sum(v for k, v in stage_seconds.items() if k == "sft" or k.startswith("grpo@")) / 60,
            "grpo_seconds_per_step": sum(m.get("train_seconds", 0.0) for m in grpo.values())
            / max(1.0, sum(m.get("steps", 0.0) for m in grpo.values())),
            "pipeline_minutes": read_json(ws / "metrics" / "wall_seconds.json")["pipeline"] / 60
            if (ws / "metrics" / "wall_seconds.json").is_file() else None}


DIAGNOSTICS = ("frac_reward_zero_std_mean", "gradient_share", "kl_to_start", "weight_change_max",
               "weight_change_max_layer", "weight_change_top3_share")


def records(rows: list[dict], machine_name: str, commit: str) -> list[dict]:
    """The rows as issue 44's records: per seed the final model's greedy accuracy with its
    interval, its gain over the base model (exact McNemar p, same prompts) and, after a
    warmup, over the SFT model, the format rate, the training minutes, machine and commit."""
    out = []
    for r in rows:
        record = {"seed": r["seed"], "greedy": r["final_greedy"], "ci": r["final_greedy_ci95"],
                  "gain_vs_base": r["gain"], "p_vs_base": r["gain_p"], "format_rate": r["final_format_rate"],
                  "base_greedy": r["base_greedy"], "base_format_rate": r["base_format_rate"],
                  f"pass_at_{K}": r["final_pass8"], f"pass_at_{K}_ci": r["final_pass8_ci95"],
                  "train_minutes": r["train_minutes"], "gates": r["gates"], "diagnostics": r["grpo_diagnostics"],
                  "machine": machine_name, "commit": commit}
        if r["warmup"]:
            record.update(sft_greedy=r["sft_greedy"], gain_vs_sft=r["grpo_gain"], p_vs_sft=r["grpo_gain_p"])
        out.append(record)
    return out


def interval(value: float, ci: list[float]) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def table(rows: list[dict]) -> str:
    lines = [f"| seed | base greedy [95% CI] | base format rate | SFT greedy | final greedy [95% CI] | gain (McNemar p) "
             f"| base pass@{K} -> final (paired p) | GRPO: final - SFT (McNemar p) | gates | training min (stages) "
             f"| GRPO s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {interval(r['base_greedy'], r['base_greedy_ci95'])} | {r['base_format_rate']:.3f} "
            f"| {'off' if r['sft_greedy'] is None else format(r['sft_greedy'], '.3f')} | {interval(r['final_greedy'], r['final_greedy_ci95'])} "
            f"| {r['gain']:+.3f} ({stats.format_p(r['gain_p'])}) "
            f"| {interval(r['base_pass8'], r['base_pass8_ci95'])} -> {interval(r['final_pass8'], r['final_pass8_ci95'])} "
            f"({stats.format_p(r['pass8_p'])}) | {r['grpo_gain']:+.3f} ({stats.format_p(r['grpo_gain_p'])}) "
            f"| {', '.join(f'{k} {v}' for k, v in r['gates'].items())} "
            f"| {r['train_minutes']:.1f} ({r['training_stage_minutes']:.1f}) | {r['grpo_seconds_per_step']:.2f} |")
    if len(rows) > 1:
        mean = {k: statistics.mean(r[k] or 0.0 for r in rows) for k in ("base_greedy", "sft_greedy", "final_greedy",
                                                                        "gain", "base_pass8", "final_pass8",
                                                                        "train_minutes")}
        lines.append(f"| mean | {mean['base_greedy']:.3f} | | {mean['sft_greedy']:.3f} | {mean['final_greedy']:.3f} "
                     f"| {mean['gain']:+.3f} | {mean['base_pass8']:.3f} -> {mean['final_pass8']:.3f} "
                     f"| {statistics.mean(r['grpo_gain'] for r in rows):+.3f} | | {mean['train_minutes']:.1f} | |")
    calls = [r for r in rows if r["tool_calls"][0] is not None]
    if calls:
        lines += ["", "Tool calls per greedy episode (base -> SFT -> final): "
                  + "; ".join(f"seed {r['seed']}: " + " -> ".join(f"{c:.2f}" for c in r["tool_calls"]) for r in calls)]
    return "\n".join(lines)


def verdict(rows: list[dict]) -> list[str]:
    """The goal, point by point, as the rows show it."""
    return [f"gain >= {GAIN:.2f} on every seed: {all(r['gain'] >= GAIN for r in rows)} "
            f"(smallest {min(r['gain'] for r in rows):+.3f})",
            f"McNemar p < {P_MAX} on every seed: {all(r['gain_p'] < P_MAX for r in rows)}",
            f"pass@{K} not lower on any seed: {all(r['final_pass8'] >= r['base_pass8'] for r in rows)}",
            f"training <= {TRAIN_MINUTES:.0f} min per seed: {all(r['train_minutes'] <= TRAIN_MINUTES for r in rows)} "
            f"(longest {max(r['train_minutes'] for r in rows):.1f} min)"]


def machine() -> str:
    """The CPU the table was measured on: its name, cores and the bf16 units `bf16: auto` reads."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    extras = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in trl_bridge.cpu_flags()]
    return f"{model}, {os.cpu_count()} cores, {' '.join(extras) or 'no AVX-512'}"


def commit() -> str:
    """The checkout's short commit, recorded beside every figure."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def write_records(path: Path, config: str, found: list[dict]) -> None:
    """Merge `found` into the records file by seed: a seed run again replaces its record, the
    others (run in another session, on another machine) are kept, each with its own machine."""
    kept = []
    if path.is_file():
        kept = [r for r in json.loads(path.read_text()).get("records", [])
                if r["seed"] not in {f["seed"] for f in found}]
    merged = sorted(kept + found, key=lambda r: r["seed"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "records": merged}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "recipes" / "smollm2-arithmetic.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default=str(REPO / "runs" / "bench-real"))
    parser.add_argument("--tracking-uri", help="default: sqlite:///<root>/mlflow.db")
    parser.add_argument("--records", help="also write the seeds as {\"records\": [...]} here (e.g. "
                        "bench/results/grpo_zero.json)")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = args.tracking_uri or f"sqlite:///{root / 'mlflow.db'}"
    config = read_config_dict(Path(args.config))
    model = Path(config["model"]["path"])
    config["model"]["path"] = str(model if model.is_absolute() else (REPO / model).resolve())
    if not (Path(config["model"]["path"]) / "config.json").is_file():
        raise SystemExit(f"{config['model']['path']}: no model there; run `make smollm2` first")
    resamples = config.get("stats", {}).get("bootstrap_resamples", 2000)
    global K
    K = max(config.get("evaluate", {}).get("k", [K]))
    rows = []
    for seed in args.seeds:
        ws = run_seed(root, config, seed, uri)
        rows.append(summarise(ws, seed, resamples, uri))
        print(table(rows[-1:]), flush=True)
    report = "\n".join([f"Machine: {machine()}", "", table(rows), "", *verdict(rows)])
    print("\n" + report)
    (root / "real_model.md").write_text(report + "\n")
    (root / "real_model.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")
    if args.records:
        write_records(Path(args.records), str(args.config), records(rows, machine(), commit()))


if __name__ == "__main__":
    main()
