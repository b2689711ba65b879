"""How posttrain's cost grows with the work: GRPO wall time against steps, evaluation wall
time against prompts x samples, three sizes each, and whether each is linear.

Builds a workspace of the default config and trains its SFT warmup once (as
bench/grpo_throughput.py does), then times whole stage processes as `dvc repro` runs
them (`python -m posttrain stage ...`: start, imports, MLflow, the stage's own work):

- `posttrain stage grpo` at `--steps` GRPO steps (default 50, 100, 200);
- `posttrain stage evaluate` on the base, SFT and GRPO models at `--evaluate` held-out
  prompts x samples per prompt (default 100x16, 200x32, 400x64).

For each it fits wall = fixed + marginal x size over the three sizes and prints the
fixed cost, the marginal cost and the largest deviation of a size from the line. Growth
counts as linear when the marginal cost between the first two sizes and between the last
two agree within 15% (`--tolerance`); superlinear when the second is higher (quadratic
attention, swapping, a cache that stops fitting), sublinear when it is lower (batching
amortised over more work).

    .venv/bin/python bench/cost_scaling.py [--steps 50 100 200] [--evaluate 100x16 200x32 400x64] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_throughput import bench_root, run, setup  # noqa: E402  (bench/ is not a package)

from posttrain.config import read_config_dict  # noqa: E402
from posttrain.files import read_json  # noqa: E402


def variant(ws: Path, name: str, change) -> str:
    """A copy of the workspace's config with `change(config)` applied; its path relative to `ws`."""
    config = read_config_dict(ws / "configs" / "pipeline.yaml")
    change(config)
    path = ws / "configs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path.relative_to(ws))


def grpo_walls(root: Path, ws: Path, name: str, sizes: list[int]) -> list[tuple[int, float, float]]:
    """(steps, stage wall seconds, train() seconds) per size; the largest run's model is
    left as the workspace's GRPO output (what evaluate reads)."""
    results = []
    for steps in sizes:
        def change(config, steps=steps):
            config["grpo"][name]["trl"]["max_steps"] = steps
        config = variant(ws, f"steps-{steps}", change)
        out = root / f"grpo-{steps}"
        wall = run([sys.executable, "-m", "posttrain", "stage", "grpo", "--config", config, "--name", name,
                    "--data-dir", "data", "--init-dir", "artifacts/models/sft", "--out-dir", str(out / "model"),
                    "--checkpoint-dir", str(out / "checkpoints"), "--metrics-path", str(out / "metrics.json"),
                    "--curve-path", str(out / "curve.json"), "--audit-path", str(out / "audit.json"),
                "--layers-path", str(out / "layers.json")], ws, root / f"grpo-{steps}.log")
        results.append((steps, wall, read_json(out / "metrics.json")["train_seconds"]))
        print(f"grpo {steps:>5} steps: {wall:7.1f} s wall ({results[-1][2]:.1f} s in train())", flush=True)
    target = ws / "artifacts" / "models" / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(root / f"grpo-{sizes[-1]}" / "model", target)
    return results


def evaluate_walls(root: Path, ws: Path, sizes: list[tuple[int, int]]) -> list[tuple[int, float, float]]:
    """(prompts x samples, stage wall seconds, sampling seconds) per size."""
    import mlflow

    results = []
    for prompts, samples in sizes:
        def change(config, prompts=prompts, samples=samples):
            config["evaluate"].update(max_prompts=prompts, n_samples=samples,
                                      k=[k for k in config["evaluate"]["k"] if k <= samples])
        config = variant(ws, f"evaluate-{prompts}x{samples}", change)
        out = root / f"evaluate-{prompts}x{samples}"
        wall = run([sys.executable, "-m", "posttrain", "stage", "evaluate", "--config", config, "--data-dir", "data",
                    "--models-dir", "artifacts/models", "--metrics-path", str(out / "metrics.json"),
                    "--outcomes-path", str(out / "outcomes.json"), "--accuracy-plot", str(out / "accuracy.json"),
                    "--pass-at-k-plot", str(out / "pass_at_k.json"), "--pass-at-k-png", str(out / "pass_at_k.png")],
                   ws, root / f"evaluate-{prompts}x{samples}.log")
        mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
        last = mlflow.search_runs(search_all_experiments=True, max_results=1, order_by=["start_time DESC"],
                                  filter_string="tags.`posttrain.stage` = 'evaluate'").iloc[0]
        results.append((prompts * samples, wall, float(last["metrics.compute.sampling_seconds"])))
        print(f"evaluate {prompts:>4} prompts x {samples:>3} samples: {wall:7.1f} s wall "
              f"({results[-1][2]:.1f} s sampling)", flush=True)
    return results


def linearity(label: str, unit: str, results: list[tuple[int, float, float]], tolerance: float) -> None:
    """Least-squares line through (size, wall); the two marginal costs; linear or not."""
    xs, ys = [r[0] for r in results], [r[1] for r in results]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    fixed = mean_y - slope * mean_x
    worst = max(abs(y - (fixed + slope * x)) / y for x, y in zip(xs, ys))
    first = (ys[1] - ys[0]) / (xs[1] - xs[0])
    second = (ys[2] - ys[1]) / (xs[2] - xs[1])
    growth = "linear" if abs(second - first) <= tolerance * first else \
        "SUPERLINEAR: each unit costs more at scale" if second > first else "sublinear: each unit costs less at scale"
    print(f"{label}: wall = {fixed:.1f} s + {slope:.4g} s/{unit} x {unit}s (largest deviation from the line "
          f"{worst:.1%}); marginal {first:.4g} then {second:.4g} s/{unit}: {growth} (linear: within {tolerance:.0%})")


def size_pair(text: str) -> tuple[int, int]:
    prompts, _, samples = text.partition("x")
    return int(prompts), int(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs=3, default=[50, 100, 200], help="three GRPO step counts")
    parser.add_argument("--evaluate", type=size_pair, nargs=3, default=[(100, 16), (200, 32), (400, 64)],
                        help="three PROMPTSxSAMPLES sizes of the evaluation")
    parser.add_argument("--tolerance", type=float, default=0.15, help="marginal costs this close count as linear")
    parser.add_argument("--root", help="where the workspace and logs go (default: a new temporary folder)")
    args = parser.parse_args()
    root = bench_root(args.root, "cost-scaling-")
    print(f"cost_scaling in {root} (cpus: {os.cpu_count()})", flush=True)
    ws, name = setup(root, max(args.steps))
    grpo = grpo_walls(root, ws, name, sorted(args.steps))
    evaluation = evaluate_walls(root, ws, sorted(args.evaluate, key=lambda s: s[0] * s[1]))
    linearity("GRPO", "step", grpo, args.tolerance)
    linearity("evaluate", "sample", evaluation, args.tolerance)


if __name__ == "__main__":
    main()
