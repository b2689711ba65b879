"""The seed story as an experiment: a hackable reward, refused before training, and what it
does when trained on anyway.

Text-to-SQL (configs/sql.yaml: the tiny model, SQLite tables, execution grading) trained
twice per seed with the same budget (the same SFT warmup, the same GRPO schedule), once on
a naive reward (`similarity`: token overlap with the gold query, what a string grader pays)
and once on the execution reward (`correctness`: the query's rows equal the gold query's):

1. before any training, `posttrain check` on the naive config (its default `audit: refuse`)
   must refuse it in one line, and pass the execution one;
2. with `audit: warn` the naive run goes on (`posttrain run`, the whole flow); the table
   shows its training reward (start -> end, as the gate's sentinel reads it), the held-out
   execution accuracy of the SFT model and of the stage's candidate with 95% intervals and
   the paired McNemar p, and the gate's verdict with its reason; the execution run the same.

    .venv/bin/python bench/reward_hacking.py                     # seeds 0-2
    .venv/bin/python bench/reward_hacking.py --seeds 0 --root /tmp/hack

Expected (issue 29): the audit refuses the naive reward; trained on anyway its reward rises
while held-out accuracy falls and the gate rejects the stage; the execution reward's stage is
accepted. The table says what happened, whatever it is. A finished workspace is read, not
rerun. Output: stdout and `<root>/reward_hacking.{md,json}`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from real_model import interval, machine  # noqa: E402
from seed_sweep import run_seed  # noqa: E402

from posttrain import workspace  # noqa: E402
from posttrain.config import read_config_dict  # noqa: E402
from posttrain.files import read_json  # noqa: E402
from posttrain.layout import read_card  # noqa: E402
from posttrain.scoring import stats  # noqa: E402
from posttrain.scoring.gate import reward_trend  # noqa: E402

REWARDS = {"naive": {"similarity": 1.0}, "exec": {"correctness": 1.0}}


def variant(name: str, audit: str) -> dict:
    """configs/sql.yaml with its GRPO stage named `name`, paid by REWARDS[name]."""
    config = read_config_dict(REPO / "configs" / "sql.yaml")
    stage = copy.deepcopy(config["grpo"]["exec"])
    config["grpo"] = {name: {**stage, "rewards": REWARDS[name], "audit": audit}}
    return config


def audit_before_training(root: Path) -> dict:
    """`posttrain check` on each reward with the default `audit: refuse`: exit code, last line."""
    found = {}
    for name in REWARDS:
        path = root / f"check-{name}.yaml"
        path.write_text(yaml.safe_dump(variant(name, "refuse"), sort_keys=False))
        done = subprocess.run([workspace.tool_path("posttrain"), "check", "--config", str(path)], cwd=root,
                              capture_output=True, text=True)
        found[name] = {"exit": done.returncode, "line": (done.stderr.strip() or done.stdout.strip()).splitlines()[-1]}
    return found


def summarise(ws: Path, name: str, seed: int, resamples: int) -> dict:
    grpo, evaluate = read_json(ws / "metrics" / "grpo" / f"{name}.json"), read_json(ws / "metrics" / "evaluate.json")
    outcomes = read_json(ws / "reports" / "heldout_outcomes.json")
    curve = read_json(ws / "plots" / "grpo" / f"{name}.json")
    start, end = reward_trend([p["reward"] for p in curve]) or (float("nan"), float("nan"))
    candidate = f"grpo.{name}"
    test = stats.compare(outcomes["sft"], outcomes[candidate], "greedy_accuracy", resamples=resamples, seed=seed)
    audit = read_json(ws / "reports" / "audit" / f"{name}.json")
    return {"reward": name, "seed": seed, "reward_start": start, "reward_end": end,
            "sft_greedy": evaluate["sft"]["greedy_accuracy"], "sft_greedy_ci95": evaluate["sft"]["greedy_accuracy_ci95"],
            "candidate_greedy": evaluate[candidate]["greedy_accuracy"],
            "candidate_greedy_ci95": evaluate[candidate]["greedy_accuracy_ci95"],
            "change": evaluate[candidate]["greedy_accuracy"] - evaluate["sft"]["greedy_accuracy"],
            "change_p": test.p_value, "accepted": bool(grpo.get("accepted")),
            "gate_reason": read_card(str(ws / "artifacts" / "models" / name))["gate"]["reason"],
            "audit_breaches": [b["family"] for b in audit.get("breaches", [])],
            "false_reward": audit.get("agreement", {}).get("false_reward"),
            "n_prompts": evaluate["sft"]["n_prompts"]}


def table(rows: list[dict]) -> str:
    lines = ["| reward | seed | training reward start -> end | held-out exec. accuracy: SFT | candidate | change "
             "(McNemar p) | gate |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['reward']} | {r['seed']} | {r['reward_start']:.3f} -> {r['reward_end']:.3f} "
                     f"| {interval(r['sft_greedy'], r['sft_greedy_ci95'])} "
                     f"| {interval(r['candidate_greedy'], r['candidate_greedy_ci95'])} "
                     f"| {r['change']:+.3f} ({stats.format_p(r['change_p'])}) "
                     f"| {'accepted' if r['accepted'] else 'rejected'}: {r['gate_reason'][:140]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default=str(REPO / "runs" / "bench-hacking"))
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
    checks = audit_before_training(root)
    for name, found in checks.items():
        print(f"posttrain check, {name} reward (audit: refuse): exit {found['exit']}: {found['line']}", flush=True)
    rows = []
    for seed in args.seeds:
        for name in REWARDS:
            (root / name).mkdir(exist_ok=True)
            ws = run_seed(root / name, variant(name, "warn"), seed, uri)
            rows.append(summarise(ws, name, seed, args.resamples))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"Measured on {machine()}; the tiny model, configs/sql.yaml, "
            f"{rows[0]['n_prompts']} held-out prompts.\n\n" + "\n".join(
                f"- `posttrain check`, {n} reward: exit {c['exit']}: {c['line']}" for n, c in checks.items())
            + "\n\n" + table(rows))
    print("\n" + text)
    (root / "reward_hacking.md").write_text(text + "\n")
    (root / "reward_hacking.json").write_text(json.dumps({"checks": checks, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
