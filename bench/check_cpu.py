"""`posttrain check`'s CPU seconds and peak memory, this checkout against an earlier commit
(issue 45, goal 1: <= 2 s of CPU and <= 250 MB for any config, TRL's options included).

Each config is checked `--runs` times by each side, alternating; the figures are the child's
user + system CPU seconds and its peak resident memory (getrusage), medians per side, and
their ratio. The baseline runs the same virtual environment from a `git worktree` of
`--baseline` (default: the commit before the snapshot of TRL's fields). Also measured: a
config with one bad `trl:` value (refused in one line), as users meet it.

    .venv/bin/python bench/check_cpu.py                        # every shipped config, 3 runs a side
    .venv/bin/python bench/check_cpu.py --configs configs/pipeline.yaml --runs 5
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BAD_TRL = "extends: {base}\nsft: {{trl: {{learning_rate: -0.001}}}}\n"


def measure(source: Path, config: Path) -> tuple[float, int]:
    """(CPU seconds, exit code) of one `posttrain check` run from `source`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": str(source)}
    done = subprocess.run([sys.executable, "-m", "posttrain", "check", "--config", str(config)], cwd=source,
                          env=env, capture_output=True, text=True)  # cwd: `-m` puts it first on sys.path
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, done.returncode


def peak(source: Path, config: Path) -> float:
    """Peak resident MB of one run, alone (RUSAGE_CHILDREN keeps the largest child's so far)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], capture_output=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    done = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "posttrain", "check", "--config",
                           str(config)], cwd=source, env={**os.environ, "PYTHONPATH": str(source)},
                          capture_output=True, text=True)
    return float(done.stdout.strip() or "nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=[str(p.relative_to(REPO)) for p in
                        [REPO / "configs/pipeline.yaml", REPO / "configs/sql.yaml",
                         *sorted((REPO / "configs/recipes").glob("smollm2-*.yaml"))]])
    parser.add_argument("--baseline", default="a255666", help="the commit to compare with")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="check-cpu-") as tmp:
        bad = Path(tmp) / "bad-trl.yaml"
        bad.write_text(BAD_TRL.format(base=REPO / "configs/pipeline.yaml"))
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=REPO, check=True,
                       capture_output=True)
        for local in ("models", "custom"):  # what configs name relative to the checkout, untracked
            if (REPO / local).exists() and not (base / local).exists():
                (base / local).symlink_to(REPO / local)
        try:
            rows = []
            for name in [*args.configs, str(bad)]:
                config = Path(name) if Path(name).is_absolute() else REPO / name
                now, then, codes = [], [], set()
                for _ in range(args.runs):
                    for side, out in ((REPO, now), (base, then)):
                        cpu, code = measure(side, config)
                        out.append(cpu)
                        codes.add((side == REPO, code))
                shown = "bad trl: value" if config == bad else name
                rows.append((shown, statistics.median(now), statistics.median(then), peak(REPO, config),
                             peak(base, config), sorted(codes)))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, capture_output=True)
    print(f"| config | CPU s now | CPU s at {args.baseline} | ratio | peak MB now | peak MB then | exit codes |")
    print("|---|---|---|---|---|---|---|")
    for shown, now, then, mb_now, mb_then, codes in rows:
        exits = "/".join(str(c) for _, c in codes)
        print(f"| {shown} | {now:.2f} | {then:.2f} | {now / then:.2f} | {mb_now:.0f} | {mb_then:.0f} | {exits} |")


if __name__ == "__main__":
    main()
