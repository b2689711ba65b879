"""GRPO throughput: posttrain's GRPO stage against bare TRL, same model, prompts, rewards
and GRPOConfig, in alternating rounds of one run.

Builds a workspace of the default config (`--steps` GRPO steps, the gate on 64 held-out
prompts so the stage's evaluation stays short), runs its SFT warmup once (`dvc repro
sft`), takes the prompts the stage's pass-rate filter keeps and the `GRPOConfig` options
posttrain builds for the stage, then per round runs, in turn (the order alternates):

- bare:      bench/bare_grpo.py, TRL's GRPOTrainer with plain reward functions, no MLflow;
- posttrain: `python -m posttrain stage grpo` in the workspace, as `dvc repro` runs it
             (MLflow run and per-step logging, guardrails, reward wrappers, gate).

Seconds per step is `trainer.train()`'s wall time over its steps on both sides (what
happens before and after training is `make bench`'s subject). Prints each round, the
min and median s/step of each side, and last `ratio=<posttrain steps/s over bare steps/s>`
from the minima: on a shared machine other tenants only ever add time, so the fastest
round of each side is the one closest to its own cost.

    .venv/bin/python bench/grpo_throughput.py [--steps 100] [--rounds 3] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain import workspace  # noqa: E402
from posttrain.config import read_config_dict  # noqa: E402
from posttrain.files import read_json  # noqa: E402

GATE_PROMPTS = 64


def setup(root: Path, steps: int) -> tuple[Path, str]:
    """A workspace of the default config with its SFT model trained; the GRPO stage's name."""
    config = read_config_dict(REPO / "configs" / "pipeline.yaml")
    name, stage = next(iter(config["grpo"].items()))
    config["grpo"] = {name: {**stage, "trl": {**stage["trl"], "max_steps": steps}}}
    config["gate"] = {**config["gate"], "max_prompts": GATE_PROMPTS}
    ws = root / "workspace"
    workspace.create(ws, config)
    with open(root / "setup.log", "w") as log:
        done = subprocess.run([workspace.tool_path("dvc"), "repro", "sft"], cwd=ws, stdout=log,
                              stderr=subprocess.STDOUT, env=workspace.stage_env(str(ws)))
    if done.returncode:
        raise SystemExit(f"dvc repro sft failed (exit {done.returncode}); see {root / 'setup.log'}")
    return ws, name


def bare_inputs(root: Path, ws: Path, name: str) -> tuple[Path, Path]:
    """The prompts the stage trains on (its pass-rate filter's, same seed) and the
    GRPOConfig options posttrain gives TRL, as files for bench/bare_grpo.py."""
    from posttrain.chat import grpo_rows
    from posttrain.config import load_config
    from posttrain.training.trl_bridge import device_defaults, grpo_trl_options
    from posttrain.envs import get_env
    from posttrain.files import read_jsonl
    from posttrain.stages.grpo import filter_prompts

    config = load_config(ws / "configs" / "pipeline.yaml")
    stage = config.grpo[name]
    env = get_env(config.data.env, **config.data.options)
    kept, _ = filter_prompts(config, stage, env, str(ws / "artifacts" / "models" / stage.from_),
                             read_jsonl(ws / "data" / "train.jsonl"))
    rows, options = root / "bare_rows.jsonl", root / "bare_options.json"
    rows.write_text("".join(json.dumps(r) + "\n" for r in grpo_rows(kept)))
    options.write_text(json.dumps({**device_defaults(), "seed": config.seed, **grpo_trl_options(stage)}))
    return rows, options


def bench_root(given: str | None, prefix: str) -> Path:
    """The folder a bench works in: `--root`, else a new temporary one."""
    root = Path(given or tempfile.mkdtemp(prefix=prefix)).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def run(command: list[str], cwd: Path, log: Path) -> float:
    """Run `command`; its wall seconds. Its output goes to `log`."""
    start = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=workspace.stage_env(str(cwd)))
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def bare(root: Path, ws: Path, name: str, inputs: tuple[Path, Path], i: int) -> dict:
    out = root / f"bare-{i}"
    model = ws / "artifacts" / "models" / read_config_dict(ws / "configs" / "pipeline.yaml")["grpo"][name]["from"]
    wall = run([sys.executable, str(REPO / "bench" / "bare_grpo.py"), "--model", str(model), "--rows", str(inputs[0]),
                "--options", str(inputs[1]), "--output-dir", str(out)], root, root / f"bare-{i}.log")
    result = json.loads((root / f"bare-{i}.log").read_text().strip().splitlines()[-1])
    return {"s_per_step": result["train_seconds"] / result["steps"], "wall": wall}


def posttrain(root: Path, ws: Path, name: str, i: int) -> dict:
    out = root / f"posttrain-{i}"
    model_from = read_config_dict(ws / "configs" / "pipeline.yaml")["grpo"][name]["from"]
    wall = run([sys.executable, "-m", "posttrain", "stage", "grpo", "--config", "configs/pipeline.yaml", "--name", name,
                "--data-dir", "data", "--init-dir", f"artifacts/models/{model_from}", "--out-dir", str(out / "model"),
                "--checkpoint-dir", str(out / "checkpoints"), "--metrics-path", str(out / "metrics.json"),
                "--curve-path", str(out / "curve.json")], ws, root / f"posttrain-{i}.log")
    metrics = read_json(out / "metrics.json")
    return {"s_per_step": metrics["train_seconds"] / metrics["steps"], "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps per run (default 100)")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs, order alternating (default 3)")
    parser.add_argument("--root", help="where the workspace and logs go (default: a new temporary folder)")
    args = parser.parse_args()
    root = bench_root(args.root, "grpo-throughput-")
    print(f"grpo_throughput: {args.steps} steps x {args.rounds} rounds in {root} (cpus: {os.cpu_count()})", flush=True)
    ws, name = setup(root, args.steps)
    inputs = bare_inputs(root, ws, name)
    sides = {"bare": [], "posttrain": []}
    for i in range(args.rounds):
        order = ["bare", "posttrain"] if i % 2 == 0 else ["posttrain", "bare"]
        for side in order:
            result = bare(root, ws, name, inputs, i) if side == "bare" else posttrain(root, ws, name, i)
            sides[side].append(result)
        b, p = sides["bare"][-1], sides["posttrain"][-1]
        print(f"round {i + 1} ({' then '.join(order)}): bare {b['s_per_step']:.4f} s/step (process {b['wall']:.1f} s), "
              f"posttrain {p['s_per_step']:.4f} s/step (process {p['wall']:.1f} s), "
              f"ratio {b['s_per_step'] / p['s_per_step']:.3f}", flush=True)
    for side, results in sides.items():
        per_step = [r["s_per_step"] for r in results]
        print(f"{side:<10} s/step min {min(per_step):.4f} median {statistics.median(per_step):.4f}")
    bare_min = min(r["s_per_step"] for r in sides["bare"])
    posttrain_min = min(r["s_per_step"] for r in sides["posttrain"])
    print(f"ratio={bare_min / posttrain_min:.3f}")


if __name__ == "__main__":
    main()
