"""What the reward audit costs: `posttrain check` with each GRPO stage's audit against the
same check with `audit: off`, in turn (A B A B ...), the wall-time ratio pair by pair; and the
audit alone, in this process, per stage.

    .venv/bin/python bench/audit_overhead.py [--config configs/pipeline.yaml] [--pairs 5]

`posttrain run` runs the same check before any stage, and each GRPO stage audits itself again
(its MLflow metric `compute.audit_seconds`), so the check's difference plus the in-process
seconds bound what the audit adds to a run. Goal (issue 29): under 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain import preflight, workspace  # noqa: E402
from posttrain.config import load_config  # noqa: E402
from posttrain.scoring.audit import audit_stages  # noqa: E402


def check_seconds(config: Path) -> float:
    started = time.perf_counter()
    subprocess.run([workspace.tool_path("posttrain"), "check", "--config", str(config)], check=True,
                   capture_output=True, cwd=REPO)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "pipeline.yaml"))
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    config = load_config(args.config)
    with tempfile.TemporaryDirectory() as scratch:
        off = Path(scratch) / "audit-off.yaml"
        off.write_text(yaml.safe_dump({"extends": str(Path(args.config).resolve()),
                                       "grpo": {name: {"audit": "off"} for name in config.grpo}}))
        check_seconds(Path(args.config))  # warm-up: imports and caches
        pairs = [(check_seconds(Path(args.config)), check_seconds(off)) for _ in range(args.pairs)]
    env, rows = preflight.environment(Path(args.config), config)
    started = time.perf_counter()
    reports = audit_stages(args.config, config, env, rows["train"])
    alone = time.perf_counter() - started
    on, without = [a for a, _ in pairs], [b for _, b in pairs]
    ratios = [a / b for a, b in pairs]
    print(f"posttrain check, audit on:  median {statistics.median(on):.2f} s (min {min(on):.2f}, max {max(on):.2f})")
    print(f"posttrain check, audit off: median {statistics.median(without):.2f} s "
          f"(min {min(without):.2f}, max {max(without):.2f})")
    print(f"ratio on/off, pair by pair: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); difference of medians "
          f"{statistics.median(on) - statistics.median(without):+.2f} s")
    print(f"the audit alone, in process: {alone:.3f} s for {sum(r.exploits for r in reports.values()):,} exploits "
          f"over {len(reports)} stage(s)")


if __name__ == "__main__":
    main()
