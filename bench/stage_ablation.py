"""What each stage buys, side by side: base / SFT only / GRPO only / SFT then GRPO on one task,
each trained arm at the same budget of training samples seen, over seeds.

A *sample seen* is one training sequence: an SFT row (its gold completion) or a GRPO
completion (sampled and scored). The SFT-then-GRPO arm is `--config` as shipped (by default
the headroom recipe: a warmup that stops at its target, then the GRPO stage), so its workspace
is also that recipe's bench seed (`make bench-headroom` reads it with `--root <root>/sft_grpo`).
It runs first; the samples it saw (SFT steps x batch + GRPO steps x batch, world size
included) are the budget the two other arms get: SFT only trains budget / sft_batch steps
(`--config`'s warmup with no `stop_when`, its GRPO stage left with no prompts: it passes the
SFT model on, untrained), GRPO only budget / grpo_batch steps from the base model
(`--zero-config`: a GRPO stage that starts from the base model; its rewards must teach what
the SFT targets teach). Every arm is a whole `posttrain run` in its own workspace (the Prefect
flow, the gates, evaluate on the held-out split); the base model is each run's `base`, the
same prompts everywhere. The two extra arms skip the serving checks (they measure learning).

    make smollm2 && make bench-stages                                  # seeds 0-2, hours on 2 cores
    .venv/bin/python bench/stage_ablation.py --seeds 0 --root /tmp/stages

Per seed and arm it records held-out greedy accuracy with its Wilson interval, the format
rate, pass@k with its interval, p against the base model and against every other arm, paired
on the same prompts (greedy: exact McNemar; pass@k: paired bootstrap), training seconds (`train()` of the arm's stages),
the budget, machine and commit, into `bench/results/stage_ablation.json` (`--out`) after
each seed; the table to stdout. A finished arm's workspace is read, not rerun.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from real_model import commit as source_commit, machine  # noqa: E402
from seed_sweep import run_seed  # noqa: E402

from posttrain.config import read_config_dict  # noqa: E402
from posttrain.files import read_json  # noqa: E402
from posttrain.scoring import stats  # noqa: E402

ARMS = ("base", "sft", "grpo", "sft+grpo")


def stage_batch(trl: dict, default: int) -> int:
    return int(trl.get("per_device_train_batch_size", default))


def samples_seen(ws: Path, config: dict) -> int:
    """Training samples the workspace's run saw: SFT rows and GRPO completions, every rank's."""
    sft = read_json(ws / "metrics" / "sft.json")
    seen = 0 if sft.get("off") else int(sft["steps"] * sft.get("world_size", 1) * stage_batch(config["sft"]["trl"], 8))
    for name, stage in config["grpo"].items():
        grpo = read_json(ws / "metrics" / "grpo" / f"{name}.json")
        if not grpo.get("skipped"):
            seen += int(grpo["steps"] * grpo.get("world_size", 1) * stage_batch(stage["trl"], 8))
    return seen


def arm_configs(config: dict, zero: dict, budget: int) -> dict[str, dict]:
    """The SFT-only and GRPO-only arms' configs at `budget` samples seen each."""
    sft_batch = stage_batch(config["sft"]["trl"], 8)
    name, stage = next(iter(config["grpo"].items()))
    zero_name, zero_stage = next(iter(zero["grpo"].items()))
    zero_batch = stage_batch(zero_stage["trl"], 8)
    quiet = {"vllm_check": {"enabled": False}, "load_test": {"enabled": False}}

    def steps(section: dict, count: int, batch: int) -> dict:
        return {**section, "trl": {**section["trl"], "max_steps": max(1, count // batch)}}

    sft_only = copy.deepcopy(config)
    sft_only["sft"] = {**steps(config["sft"], budget, sft_batch), "stop_when": None}
    # no prompt left for one step: the stage passes the SFT model on untrained (and says so)
    sft_only["grpo"] = {name: {**stage, "pass_rate_filter": {**stage.get("pass_rate_filter", {}), "max_prompts": 1},
                               "audit": "off"}}
    grpo_only = copy.deepcopy(zero)
    grpo_only["grpo"] = {zero_name: steps(zero_stage, budget, zero_batch)}
    for arm in (sft_only, grpo_only):
        arm["serving"] = {**arm.get("serving", {}), **quiet}
    return {"sft": sft_only, "grpo": grpo_only}


def arm_outcomes(ws: Path, arm: str) -> tuple[dict, dict, float]:
    """The arm's own model's evaluation and per-prompt outcomes, and its training seconds."""
    evaluate, outcomes = read_json(ws / "metrics" / "evaluate.json"), read_json(ws / "reports" / "heldout_outcomes.json")
    model = "sft" if arm == "sft" else "grpo"
    seconds = sum(read_json(p).get("train_seconds", 0.0)
                  for p in [ws / "metrics" / "sft.json", *sorted((ws / "metrics" / "grpo").glob("*.json"))])
    return evaluate[model], outcomes[model], seconds


def seed_records(root: Path, config: dict, zero: dict, seed: int, uri: str, k: int, resamples: int,
                 where: dict) -> list[dict]:
    """One record per arm of `seed`: its figures and its paired tests against every other arm."""
    ws = run_seed(root / "sft_grpo", config, seed, uri)
    budget = samples_seen(ws, config)
    found = {"sft+grpo": arm_outcomes(ws, "sft+grpo")}
    evaluate, outcomes = read_json(ws / "metrics" / "evaluate.json"), read_json(ws / "reports" / "heldout_outcomes.json")
    found["base"] = (evaluate["base"], outcomes["base"], 0.0)
    for arm, arm_config in arm_configs(config, zero, budget).items():
        found[arm] = arm_outcomes(run_seed(root / arm, arm_config, seed, uri), arm)
    records = []
    for arm in ARMS:
        figures, _, seconds = found[arm]
        record = {"seed": seed, "arm": arm, "greedy": figures["greedy_accuracy"],
                  "ci": figures["greedy_accuracy_ci95"], "format_rate": figures.get("format_rate"),
                  f"pass_at_{k}": figures["pass_at_k"][str(k)], f"pass_at_{k}_ci": figures["pass_at_k_ci95"][str(k)],
                  "train_seconds": seconds, "budget_samples": 0 if arm == "base" else budget, **where}
        for other in ARMS:
            if other != arm:
                test = stats.compare(found[other][1], found[arm][1], "greedy_accuracy", resamples=resamples, seed=seed)
                record[f"p_vs_{other}"], record[f"gain_vs_{other}"] = test.p_value, test.difference
                test = stats.compare(found[other][1], found[arm][1], f"pass_at_k.{k}", resamples=resamples, seed=seed)
                record[f"pass_at_{k}_p_vs_{other}"], record[f"pass_at_{k}_gain_vs_{other}"] = test.p_value, test.difference
        records.append(record)
    return records


def table(records: list[dict], k: int) -> str:
    lines = [f"| seed | arm | greedy [95% CI] | format | pass@{k} | vs base (p) | vs SFT only (p) | vs GRPO only (p) "
             "| train s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        versus = [f"{r[f'gain_vs_{o}']:+.3f} ({stats.format_p(r[f'p_vs_{o}'])})" if f"p_vs_{o}" in r else "-"
                  for o in ("base", "sft", "grpo")]
        rate = "-" if r["format_rate"] is None else f"{r['format_rate']:.2f}"
        lines.append(f"| {r['seed']} | {r['arm']} | {r['greedy']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | {rate} "
                     f"| {r[f'pass_at_{k}']:.3f} | {' | '.join(versus)} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "recipes" / "smollm2-arithmetic-headroom.yaml"),
                        help="the SFT-then-GRPO recipe, run as shipped (its warmup is the SFT-only arm)")
    parser.add_argument("--zero-config", default=str(REPO / "configs" / "recipes" / "smollm2-arithmetic-zero.yaml"),
                        help="the GRPO-only recipe (sft: off, the first stage from: base)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default=str(REPO / "runs" / "bench-stages"))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "stage_ablation.json"))
    args = parser.parse_args()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    config, zero = read_config_dict(Path(args.config)), read_config_dict(Path(args.zero_config))
    for c in (config, zero):
        c["model"]["path"] = str((REPO / c["model"]["path"]).resolve())
        if not (Path(c["model"]["path"]) / "config.json").is_file():
            raise SystemExit(f"{c['model']['path']}: no model there; run `make smollm2` first")
    k = max(config.get("evaluate", {}).get("k", [8]))
    resamples = config.get("stats", {}).get("bootstrap_resamples", 2000)
    commit = source_commit()
    where = {"machine": machine(), "commit": commit}
    out = Path(args.out)
    records = [r for r in (read_json(out).get("records", []) if out.is_file() else []) if r["seed"] not in args.seeds]
    for seed in args.seeds:
        found = seed_records(root, config, zero, seed, uri, k, resamples, where)
        records = sorted(records + found, key=lambda r: (r["seed"], ARMS.index(r["arm"])))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": str(Path(args.config).relative_to(REPO)) if Path(args.config).resolve()
                                   .is_relative_to(REPO) else args.config,
                                   "budget": "training samples seen by each trained arm (SFT rows, GRPO completions): "
                                             "what the SFT-then-GRPO recipe saw as shipped",
                                   "records": records}, indent=2) + "\n")
        print(table(found, k), flush=True)
    print(f"\nMachine: {where['machine']}; commit {commit}\n")
    print(table(records, k))


if __name__ == "__main__":
    main()
