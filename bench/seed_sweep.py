"""Seed sweep: does the default recipe hold on this machine, whatever the seed?

Runs the default pipeline (`posttrain run`, the whole Prefect flow) once per seed, each
in its own git + DVC workspace, and prints per seed: where the SFT warmup stopped, its
held-out greedy accuracy, the final model's, pass@8 before and after GRPO (evaluate,
n=64, T=1), the gate's verdict and the stage times; then the mean and standard
deviation over seeds, and the acceptance checks of issue 11. The seed drives the data
split, the model's init, TRL's sampling and the evaluation's sampling.

    .venv/bin/python bench/seed_sweep.py                       # seeds 0-4, ~50 min on 2 cores
    .venv/bin/python bench/seed_sweep.py --seeds 0 1 --root /tmp/sweep --config configs/pipeline.yaml

A seed whose workspace already finished is read, not rerun, so a stopped sweep resumes.
The table goes to stdout and, with the raw numbers, to `<root>/seed_sweep.{md,json}`.
All seeds log to one MLflow store (`<root>/mlflow.db`, or `--tracking-uri`), so any two
can be put side by side: `posttrain compare RUN_A RUN_B --tracking-uri sqlite:///<root>/mlflow.db`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain.scoring import stats
from posttrain import workspace  # noqa: E402
from posttrain.config import read_config_dict  # noqa: E402
from posttrain.files import read_json  # noqa: E402

K = 8
BAND, GAIN, GRPO_SECONDS = (0.2, 0.7), 0.15, 480.0  # issue 11's acceptance


def run_seed(root: Path, config: dict, seed: int, uri: str) -> Path:
    """The workspace of `seed`, its pipeline run to the end (`posttrain run`, logging to `uri`)."""
    ws = root / f"seed{seed}"
    if (ws / "metrics" / "evaluate.json").is_file():
        return ws
    if ws.exists():
        raise SystemExit(f"{ws} exists but never finished: remove it to rerun seed {seed}")
    workspace.create(ws, {**config, "seed": seed})
    started = time.monotonic()
    log = root / f"seed{seed}.log"
    with open(log, "w") as out:
        done = subprocess.run([workspace.tool_path("posttrain"), "run", "--workdir", str(ws)], cwd=ws,
                              stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_TRACKING_URI": uri})
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: posttrain run failed (exit {done.returncode}); see {log}")
    (ws / "metrics" / "wall_seconds.json").write_text(json.dumps({"pipeline": time.monotonic() - started}))
    return ws


def last_run(ws: Path, uri: str):
    """The last finished retrain run of workspace `ws` and its child runs, by stage name."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(search_all_experiments=True, order_by=["start_time DESC"],
                              filter_string=f"tags.`posttrain.flow` = 'retrain' and attributes.status = 'FINISHED' "
                                            f"and tags.`posttrain.workspace` = '{ws.resolve()}'")
    children = mlflow.search_runs(search_all_experiments=True,
                                  filter_string=f"tags.`mlflow.parentRunId` = '{runs.iloc[0].run_id}'")
    return runs.iloc[0], {c["tags.mlflow.runName"]: c for _, c in children.iterrows()}


def summarise(ws: Path, seed: int, resamples: int, uri: str) -> dict:
    """One seed's row: the acceptance figures, with intervals and the paired tests."""
    evaluate, sft = read_json(ws / "metrics" / "evaluate.json"), read_json(ws / "metrics" / "sft.json")
    outcomes = read_json(ws / "reports" / "heldout_outcomes.json")
    grpo_metrics = {p.stem: read_json(p) for p in sorted((ws / "metrics" / "grpo").glob("*.json"))}
    parent, children = last_run(ws, uri)
    seconds = {name: (c.end_time - c.start_time).total_seconds() for name, c in children.items()}
    before, after = evaluate["sft"], evaluate["grpo"]
    test = {m: stats.compare(outcomes["sft"], outcomes["grpo"], m, resamples=resamples, seed=seed)
            for m in ("greedy_accuracy", f"pass_at_k.{K}")}
    return {
        "seed": seed, "run_id": parent.run_id, "sft_stopped_at_step": sft.get("stopped_at_step", sft["steps"]),
        "sft_validation_greedy": sft.get("validation_greedy_accuracy"),
        "sft_greedy": before["greedy_accuracy"], "sft_greedy_ci95": before["greedy_accuracy_ci95"],
        "final_greedy": after["greedy_accuracy"], "final_greedy_ci95": after["greedy_accuracy_ci95"],
        "gain": after["greedy_accuracy"] - before["greedy_accuracy"], "gain_p": test["greedy_accuracy"].p_value,
        "sft_pass8": before["pass_at_k"][str(K)], "final_pass8": after["pass_at_k"][str(K)],
        "pass8_p": test[f"pass_at_k.{K}"].p_value,
        "gates": {name: "accepted" if m.get("accepted") else "rejected" for name, m in grpo_metrics.items()},
        "sft_seconds": seconds.get("sft", 0.0),
        "grpo_seconds": sum(v for k, v in seconds.items() if k.startswith("grpo@")),
        "grpo_train_seconds": sum(m.get("train_seconds", 0.0) for m in grpo_metrics.values()),
        "pipeline_seconds": read_json(ws / "metrics" / "wall_seconds.json")["pipeline"]
        if (ws / "metrics" / "wall_seconds.json").is_file() else None,
    }


def table(rows: list[dict]) -> str:
    lines = ["| seed | SFT stop step (validation) | SFT greedy [95% CI] | final greedy [95% CI] | gain (McNemar p) "
             f"| pass@{K} SFT -> final (paired p) | gates | SFT s | GRPO s (train) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["sft_greedy_ci95"]
        flo, fhi = r["final_greedy_ci95"]
        val = f" ({r['sft_validation_greedy']:.3f})" if r["sft_validation_greedy"] is not None else ""
        lines.append(
            f"| {r['seed']} | {r['sft_stopped_at_step']:.0f}{val} | {r['sft_greedy']:.3f} [{lo:.3f}, {hi:.3f}] "
            f"| {r['final_greedy']:.3f} [{flo:.3f}, {fhi:.3f}] | {r['gain']:+.3f} ({stats.format_p(r['gain_p'])}) "
            f"| {r['sft_pass8']:.3f} -> {r['final_pass8']:.3f} ({stats.format_p(r['pass8_p'])}) "
            f"| {', '.join(f'{k} {v}' for k, v in r['gates'].items())} | {r['sft_seconds']:.0f} "
            f"| {r['grpo_seconds']:.0f} ({r['grpo_train_seconds']:.0f}) |")
    for name, fn in (("mean", statistics.mean), ("std", statistics.stdev if len(rows) > 1 else lambda v: 0.0)):
        cells = {key: fn([r[key] for r in rows]) for key in ("sft_stopped_at_step", "sft_greedy", "final_greedy",
                                                              "gain", "sft_pass8", "final_pass8", "sft_seconds",
                                                              "grpo_seconds", "grpo_train_seconds")}
        lines.append(f"| {name} | {cells['sft_stopped_at_step']:.0f} | {cells['sft_greedy']:.3f} | "
                     f"{cells['final_greedy']:.3f} | {cells['gain']:+.3f} | {cells['sft_pass8']:.3f} -> "
                     f"{cells['final_pass8']:.3f} | | {cells['sft_seconds']:.0f} | {cells['grpo_seconds']:.0f} "
                     f"({cells['grpo_train_seconds']:.0f}) |")
    return "\n".join(lines)


def acceptance(rows: list[dict]) -> list[tuple[str, bool]]:
    return [
        (f"SFT held-out greedy in [{BAND[0]}, {BAND[1]}] for every seed",
         all(BAND[0] <= r["sft_greedy"] <= BAND[1] for r in rows)),
        (f"GRPO adds at least {GAIN:.0%} held-out greedy for every seed", all(r["gain"] >= GAIN for r in rows)),
        (f"pass@{K} does not fall for any seed", all(r["final_pass8"] >= r["sft_pass8"] for r in rows)),
        (f"every gate accepted", all(v == "accepted" for r in rows for v in r["gates"].values())),
        (f"GRPO stages under {GRPO_SECONDS / 60:.0f} minutes in all, every seed",
         all(r["grpo_seconds"] < GRPO_SECONDS for r in rows)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--root", default="/tmp/posttrain-seed-sweep", help="one workspace per seed under it")
    parser.add_argument("--config", default=str(REPO / "configs" / "pipeline.yaml"))
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--tracking-uri", help="the MLflow store every seed logs to (default: sqlite:///<root>/mlflow.db)")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = args.tracking_uri or f"sqlite:///{root / 'mlflow.db'}"
    config = read_config_dict(Path(args.config))
    rows = []
    for seed in args.seeds:
        started = time.monotonic()
        ws = run_seed(root, config, seed, uri)
        rows.append(summarise(ws, seed, args.resamples, uri))
        print(f"seed {seed}: done in {time.monotonic() - started:.0f} s ({ws})", flush=True)
    text = table(rows)
    checks = acceptance(rows)
    text += "\n\n" + "\n".join(f"- [{'x' if ok else ' '}] {name}" for name, ok in checks)
    text += f"\n\nMLflow store: {uri}; retrain runs: " + ", ".join(f"seed {r['seed']} {r['run_id']}" for r in rows)
    print(text)
    (root / "seed_sweep.md").write_text(text + "\n")
    (root / "seed_sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
