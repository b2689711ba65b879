"""GRPO throughput: posttrain's GRPO stage against bare TRL, same model, prompts, rewards
and GRPOConfig, in alternating rounds of one run.

Builds a workspace of the default config (`--warmup` + `--steps` GRPO steps, the gate on
64 held-out prompts so the stage's evaluation stays short), runs its SFT warmup once
(`dvc repro sft`), takes the prompts the stage's pass-rate filter keeps and the
`GRPOConfig` options posttrain builds for the stage, then per round runs, in turn (the
order alternates):

- bare:      bench/bare_grpo.py, TRL's GRPOTrainer with plain reward functions, no MLflow;
- posttrain: `python -m posttrain stage grpo` in the workspace, as `dvc repro` runs it
             (MLflow run and per-step logging, guardrails, reward wrappers, gate).

Only steady-state steps are timed, by the same step clock on both sides (bare_grpo.py's
`install_clock`): from the end of step W to the end of step W+N, over N. The first W
steps run untimed on both sides: they pay one-time costs (the optimizer's state, the
allocator's growth, MLflow's start on the posttrain side) that a short run spreads over
few steps. Both sides run the same model, prompts, seed and options, so the same tokens
a step; each round prints the tokens each trained on by its last logged step, which
says so. What happens before and after training is `make bench`'s subject.

On a machine shared with other work, use `--threads 1`. With torch's default of a
thread a core, a step's two threads wait on each other at every op, and while another
tenant holds a core a step takes 2-8 s instead of 0.3 (measured on 2 cores), in bursts
that land on one side's short timed window and not the other's: rounds of 30 steps read
0.47 to 7.5 so, at a load average of 3. That, not warm-up (the first step costs some
0.15 s more, once), is what made `trainer.train()`'s wall time over 30 steps read 1.6.
With one thread the same rounds read 0.88 to 1.05.

Prints each round (its ratio, each side's steady wall and CPU s/step and its warm-up's
wall s/step), each side's median s/step with its range, the ratio of CPU seconds a step
(with one thread, other tenants take wall time from a step but hardly CPU time), and last
`ratio=<posttrain steps/s over bare steps/s>`: the median of the rounds' wall-time
ratios (a round's pair runs back to back, so a load that comes and goes weighs on
both), with their range as the spread.

    .venv/bin/python bench/grpo_throughput.py [--steps 100] [--warmup 10] [--rounds 3] [--threads N] [--root DIR]
    .venv/bin/python bench/grpo_throughput.py --config configs/recipes/smollm2-arithmetic-zero.yaml --steps 20 --warmup 3

Before the ratio it prints this machine's matmul peak (fp32 and bf16, the runs' threads) and
each side's step split into generation (TRL's profiled generate block), scoring (the rest of
its `_prepare_inputs`: rewards, old log-probabilities) and training (forward, backward,
optimizer), generation and training as GFLOP/s and a share of that peak, from the FLOPs a
step's tokens cost (`step_flops`: an estimate, attention left out).
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
BENCH = Path(__file__).resolve().parent
# The posttrain side: `python -m posttrain ARGS` with the step clock installed first. As
# `-c` code run in the workspace, it imports the workspace's own posttrain/, as dvc would.
CLOCKED = ("import runpy, sys; sys.path.insert(1, sys.argv[1]); from bare_grpo import install_clock; "
           "install_clock(sys.argv[2]); sys.argv = ['posttrain', *sys.argv[3:]]; "
           "runpy.run_module('posttrain', run_name='__main__', alter_sys=True)")


def setup(root: Path, steps: int, config_path: Path) -> tuple[Path, str]:
    """A workspace of `config_path` (default: the default config) with its SFT model
    trained; the GRPO stage's name."""
    config = read_config_dict(config_path)
    if config.get("model", {}).get("path"):  # a real model: named from the checkout
        config["model"]["path"] = str((REPO / config["model"]["path"]).resolve())
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


def bare_inputs(root: Path, ws: Path, name: str) -> tuple[Path, Path, Path]:
    """The prompts the stage trains on (its pass-rate filter's, same seed), the GRPOConfig
    options posttrain gives TRL (`bf16: auto` resolved as the stage resolves it), and the
    stage's reward channels, reader and trainable parameters, as files for bench/bare_grpo.py."""
    from posttrain.chat import grpo_rows
    from posttrain.config import load_config
    from posttrain.training.trainable import parameter_names, selected
    from posttrain.training.trl_bridge import device_defaults, grpo_trl_options, resolve_auto
    from posttrain.envs import get_env
    from posttrain.files import read_jsonl
    from posttrain.stages.grpo import filter_prompts

    config = load_config(ws / "configs" / "pipeline.yaml")
    stage = config.grpo[name]
    env = get_env(config.data.env, **config.data.options)
    kept, _, _ = filter_prompts(config, stage, env, str(ws / "artifacts" / "models" / stage.from_),
                             read_jsonl(ws / "data" / "train.jsonl"))
    rows, options, spec = root / "bare_rows.jsonl", root / "bare_options.json", root / "bare_spec.json"
    rows.write_text("".join(json.dumps(r) + "\n" for r in grpo_rows(kept)))
    options.write_text(json.dumps(resolve_auto({**device_defaults(), "seed": config.seed, **grpo_trl_options(stage)})))
    unknown = set(stage.rewards) - {"correctness", "digits"}
    if unknown:
        raise SystemExit(f"bench/bare_grpo.py has no channel {sorted(unknown)}: a recipe paying correctness and "
                         "digits only")
    trainable = None
    if stage.trainable:
        names, layers = parameter_names(config)
        trainable = selected(names, top_layers=stage.trainable.top_layers, patterns=list(stage.trainable.patterns),
                             num_layers=layers)
    spec.write_text(json.dumps({"channels": list(stage.rewards), "reader": config.data.options.get("answer"),
                                "trainable": trainable}))
    return rows, options, spec


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


def steady(clock: Path, warmup: int, steps: int, wall: float) -> dict:
    """A run's figures from its step clock: steady-state wall and CPU s/step (steps
    warmup+1 .. warmup+steps), the untimed warm-up's wall s/step, the tokens trained on by
    the last logged step (the same on both sides when each step did the same work), the
    timed steps' seconds a step in TRL's profiled generation and in its `_prepare_inputs`
    (generation, rewards, the old policy's log-probabilities), and the tokens a step
    (prompts and completions, over the steps to the last logged one)."""
    times = read_json(clock)
    ends = times["step_ends"]
    if len(ends) != warmup + steps:
        raise SystemExit(f"{clock}: {len(ends)} steps ran, not {warmup} + {steps}; see its log")
    (wall0, cpu0), (wall1, cpu1) = ends[warmup - 1], ends[-1]
    tokens = {int(k): v for k, v in times["num_tokens"].items()}
    parts = times.get("parts", {})

    def block(suffix: str) -> float:  # a block's seconds a timed step (its step key: the steps done before it)
        return sum(seconds for step in range(warmup, warmup + steps)
                   for name, seconds in parts.get(str(step), {}).items() if name.endswith(suffix)) / steps

    return {"s_per_step": (wall1 - wall0) / steps, "cpu_s_per_step": (cpu1 - cpu0) / steps,
            "warmup_s_per_step": (wall0 - times["begin"][0]) / warmup,
            "tokens": tokens[max(tokens)] if tokens else None, "wall": wall,
            "generation_s_per_step": block(".generate"), "inputs_s_per_step": block("._prepare_inputs"),
            "tokens_per_step": tokens[max(tokens)] / max(tokens) if tokens else None}


def bare(root: Path, ws: Path, name: str, inputs: tuple[Path, Path, Path], i: int, counts: tuple[int, int]) -> dict:
    out, clock = root / f"bare-{i}", root / f"bare-{i}.clock.json"
    from posttrain.layout import resolve_model_dir  # a real base model: the workspace holds a pointer to it

    model = resolve_model_dir(ws / "artifacts" / "models" /
                              read_config_dict(ws / "configs" / "pipeline.yaml")["grpo"][name]["from"])
    wall = run([sys.executable, str(BENCH / "bare_grpo.py"), "--model", str(model), "--rows", str(inputs[0]),
                "--options", str(inputs[1]), "--spec", str(inputs[2]), "--output-dir", str(out), "--clock", str(clock)],
               root, root / f"bare-{i}.log")
    return steady(clock, *counts, wall)


def posttrain(root: Path, ws: Path, name: str, i: int, counts: tuple[int, int]) -> dict:
    out, clock = root / f"posttrain-{i}", root / f"posttrain-{i}.clock.json"
    model_from = read_config_dict(ws / "configs" / "pipeline.yaml")["grpo"][name]["from"]
    wall = run([sys.executable, "-c", CLOCKED, str(BENCH), str(clock), "stage", "grpo",
                "--config", "configs/pipeline.yaml", "--name", name, "--data-dir", "data",
                "--init-dir", f"artifacts/models/{model_from}", "--out-dir", str(out / "model"),
                "--checkpoint-dir", str(out / "checkpoints"), "--metrics-path", str(out / "metrics.json"),
                "--curve-path", str(out / "curve.json"), "--audit-path", str(out / "audit.json"),
                "--layers-path", str(out / "layers.json")],
               ws, root / f"posttrain-{i}.log")
    return steady(clock, *counts, wall)


def spread(values: list[float]) -> str:
    """`median [min, max]` of a figure over the rounds."""
    return f"{statistics.median(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


def report_round(i: int, order: list[str], b: dict, p: dict) -> None:
    print(f"round {i + 1} ({' then '.join(order)}, load average {os.getloadavg()[0]:.2f}): "
          f"ratio {b['s_per_step'] / p['s_per_step']:.3f} "
          f"(CPU {b['cpu_s_per_step'] / p['cpu_s_per_step']:.3f}); "
          + "; ".join(f"{side} {r['s_per_step']:.4f} s/step (CPU {r['cpu_s_per_step']:.4f}, warm-up "
                      f"{r['warmup_s_per_step']:.4f} s/step, process {r['wall']:.1f} s, tokens {r['tokens']})"
                      for side, r in (("bare", b), ("posttrain", p))), flush=True)


def matmul_peak(threads: int | None) -> dict[str, float]:
    """This machine's measured matmul GFLOP/s (2048^3, best of 10 after a warm-up), fp32 and
    bf16, at the runs' thread count: the ceiling a step's parts are read against."""
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(10))
        peaks[str(dtype).removeprefix("torch.")] = 2 * 2048 ** 3 / best / 1e9
    return peaks


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def step_flops(ws: Path, name: str, tokens: float) -> tuple[float, float]:
    """(generation, the rest) FLOPs of a step that reads and writes `tokens` tokens: 2 N a
    token to generate (prompt and completion, attention left out: short sequences); one
    forward (2 N) and a backward through the trained layers (2 N_trained for the weights'
    gradients, 2 (N_trained + the output head) for the activations') to train, as TRL's
    GRPO step with beta 0 and one iteration a generation does. N: the model's parameters,
    the tied output head counted once, as the matmul it is."""
    from posttrain.config import load_config
    from posttrain.training.trainable import parameter_sizes, selected

    config = load_config(ws / "configs" / "pipeline.yaml")
    stage = config.grpo[name]
    sizes, layers = parameter_sizes(config)
    total = sum(sizes.values())
    head = max(sizes.values())  # the embedding matrix: the output head's matmul
    names = list(sizes) if not stage.trainable else selected(
        list(sizes), top_layers=stage.trainable.top_layers, patterns=list(stage.trainable.patterns), num_layers=layers)
    trained = sum(sizes[n] for n in names)
    head_grad = 0 if trained == total else head
    return 2 * total * tokens, (2 * total + 2 * (trained + head_grad) + 2 * trained) * tokens


def report_split(ws: Path, name: str, sides: dict, peaks: dict, bf16: bool) -> None:
    """Each side's step split into generation, scoring (the rest of TRL's `_prepare_inputs`:
    rewards, the old policy's log-probabilities) and training (forward, backward, optimizer),
    generation and training also as GFLOP/s and a share of the measured matmul peak in the
    dtype the step computes in."""
    peak = peaks["bfloat16" if bf16 else "float32"]
    for side, results in sides.items():
        step, gen, inputs, tokens = (statistics.median(r[key] for r in results) for key in
                                     ("s_per_step", "generation_s_per_step", "inputs_s_per_step", "tokens_per_step"))
        gen_flops, train_flops = step_flops(ws, name, tokens)
        train = step - inputs
        print(f"{side:<10} step {step:.3f} s, {tokens:.0f} tokens: generation {gen:.3f} s ({gen / step:.0%}; "
              f"{gen_flops / gen / 1e9:.1f} GFLOP/s, {gen_flops / gen / 1e9 / peak:.1%} of peak), scoring "
              f"{inputs - gen:.3f} s ({(inputs - gen) / step:.0%}), training {train:.3f} s ({train / step:.0%}; "
              f"{train_flops / train / 1e9:.1f} GFLOP/s, {train_flops / train / 1e9 / peak:.1%} of peak)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps timed per run (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed GRPO steps before them (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs, order alternating (default 3)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of both sides' runs (default: torch's own, a "
                        "thread a core); 1 on a shared machine, where two threads that wait on each other at every "
                        "op while other tenants hold a core make a step 10-30 times slower, in bursts")
    parser.add_argument("--root", help="where the workspace and logs go (default: a new temporary folder)")
    parser.add_argument("--config", default=str(REPO / "configs" / "pipeline.yaml"),
                        help="the pipeline whose first GRPO stage is timed (e.g. a SmolLM2 recipe after `make smollm2`); "
                             "its channels: correctness and digits")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    counts = (args.warmup, args.steps)
    root = bench_root(args.root, "grpo-throughput-")
    print(f"grpo_throughput: {args.warmup} warm-up + {args.steps} timed steps x {args.rounds} rounds in {root} "
          f"(cpus: {os.cpu_count()}, threads: {args.threads or 'torch default'}, "
          f"load average {os.getloadavg()[0]:.2f})", flush=True)
    ws, name = setup(root, sum(counts), Path(args.config).resolve())
    inputs = bare_inputs(root, ws, name)
    peaks = matmul_peak(args.threads)
    print("matmul peak, 2048^3: " + ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in peaks.items()), flush=True)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the runs' environment (workspace.stage_env), not setup's
    sides = {"bare": [], "posttrain": []}
    for i in range(args.rounds):
        order = ["bare", "posttrain"] if i % 2 == 0 else ["posttrain", "bare"]
        for side in order:
            result = bare(root, ws, name, inputs, i, counts) if side == "bare" else posttrain(root, ws, name, i, counts)
            sides[side].append(result)
        report_round(i, order, sides["bare"][-1], sides["posttrain"][-1])
    for side, results in sides.items():
        print(f"{side:<10} s/step median [min, max] {spread([r['s_per_step'] for r in results])}, "
              f"CPU {spread([r['cpu_s_per_step'] for r in results])}")
    pairs = list(zip(sides["bare"], sides["posttrain"]))
    cpu = [b["cpu_s_per_step"] / p["cpu_s_per_step"] for b, p in pairs]
    print(f"load average {os.getloadavg()[0]:.2f}; CPU-time ratio over rounds median [min, max] {spread(cpu)}")
    report_split(ws, name, sides, peaks, bool(json.loads(inputs[1].read_text()).get("bf16")))
    ratios = [b["s_per_step"] / p["s_per_step"] for b, p in pairs]
    print(f"ratio={statistics.median(ratios):.3f} over rounds median [min, max] {spread(ratios)}")


if __name__ == "__main__":
    main()
