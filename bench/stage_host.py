"""Does the warm stage host pay for its complexity? (issue 43, item 6)

The default pipeline (configs/pipeline.yaml), run whole with `posttrain run` in two workspaces
side by side: **host**, as shipped (one process imports torch, transformers, TRL and MLflow
once; each stage is a fork of it: posttrain/runtime/stagehost.py), and **no host**
(`POSTTRAIN_STAGE_HOST=off`: every stage and the run's config check in its own process, as a
plain `dvc repro` runs them). Each round gives both workspaces a new seed, so every stage
reruns with the same work on both sides, and runs them in turn, the order alternating by
round. It prints each run's wall seconds, the ratio host / no host per round and the median
of the rounds: the figure that says whether the host stays the default.

    .venv/bin/python bench/stage_host.py [--rounds 3] [--root runs/bench-stage-host]
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

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from real_model import commit, machine  # noqa: E402
POSTTRAIN = Path(sys.executable).parent / "posttrain"
ARMS = {"host": {}, "no host": {"POSTTRAIN_STAGE_HOST": "off"}}


def run(root: Path, arm: str, seed: int) -> float:
    """`posttrain run` of the default config with `seed` in the arm's workspace: wall seconds."""
    config = root / f"{arm.replace(' ', '_')}-seed{seed}.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "seed": seed}))
    env = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_STAGE_HOST"} | ARMS[arm]
    start = time.perf_counter()
    with open(root / f"{arm.replace(' ', '_')}.log", "a") as log:
        done = subprocess.run([str(POSTTRAIN), "run", "--config", str(config), "--workdir",
                               str(root / arm.replace(" ", "_"))], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{arm}, seed {seed}: posttrain run exited {done.returncode} (its output: {log.name})")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", default=str(REPO / "runs" / "bench-stage-host"))
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    for arm in ARMS:  # round 0, not counted: creates each workspace and its data
        print(f"warm-up: {arm} {run(root, arm, 100):.1f} s", flush=True)
    rounds = []
    for i in range(args.rounds):
        order = list(ARMS) if i % 2 == 0 else list(reversed(ARMS))
        seconds = {arm: run(root, arm, 101 + i) for arm in order}
        ratio = seconds["host"] / seconds["no host"]
        rounds.append({"seed": 101 + i, **seconds, "ratio": ratio})
        print(f"round {i + 1}: host {seconds['host']:.1f} s, no host {seconds['no host']:.1f} s, "
              f"ratio host/no host {ratio:.3f}", flush=True)
    median = statistics.median(r["ratio"] for r in rounds)
    print(f"ratio host/no host: median {median:.3f} over {len(rounds)} rounds "
          f"(min {min(r['ratio'] for r in rounds):.3f}, max {max(r['ratio'] for r in rounds):.3f}); "
          f"the host saves {(1 - median):.1%} of a default run's wall time")
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": rounds, "median_ratio": median, "commit": commit(),
                                              "machine": machine()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
