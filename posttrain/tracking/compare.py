"""`posttrain compare`: runs side by side, from MLflow.

Each reference is a run id, or a Model Registry alias (`champion`, `challenger`) of the
registered model, which names the run that produced that version. Printed: the params
that differ, and a table of the runs' metrics, each with its 95% interval where it has
one, and the delta of each against the first marked `significant` or `within noise`
(p < alpha or not). Held-out accuracies and pass@k are tested on the runs' per-prompt
outcomes: paired (exact McNemar, paired bootstrap) on the prompts both runs evaluated,
unpaired bootstrap when they share none. Other figures with an interval (the gates')
are tested from the two intervals (a normal approximation, unpaired). The overlay plot (training reward per GRPO stage, held-out pass@k by k) is written as a
PNG and logged as an artifact of a new `compare` run, so the comparison is itself
recorded; the compared runs are never modified.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from posttrain.scoring import stats
from posttrain.errors import UserError
from posttrain.stageid import kind_of

ALIASES = ("champion", "challenger")
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_PASS = re.compile(r"^evaluate\.grpo\.pass_at_k\.(\d+)$")


def resolve(client, ref: str, model_name: str):
    """The MLflow run `ref` names (a run id or an alias); UserError when it names none."""
    from mlflow.exceptions import MlflowException

    if ref in ALIASES:
        try:
            version = client.get_model_version_by_alias(model_name, ref)
        except MlflowException as err:
            if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise store_failure(f"posttrain compare {ref}", err) from None
            raise UserError(f"posttrain compare {ref}", f"no version of registered model {model_name!r} has the "
                            f"alias {ref!r}", "pass a run id, or register and promote a model first") from None
        ref = version.run_id
    return get_run(client, ref, f"posttrain compare {ref}", f"pass a 32-hex run id or one of {ALIASES}",
                   "not a run id or an alias")


def get_run(client, run_id: str, where: str, fix: str, problem: str = "not a run id"):
    """The run `run_id` names; UserError (at `where`) when it is malformed or unknown."""
    from mlflow.exceptions import MlflowException

    if not _RUN_ID.match(run_id):
        raise UserError(where, problem, fix)
    try:
        return client.get_run(run_id)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise store_failure(where, err) from None
        raise UserError(where, "no such run in the tracking store", "check the run id and MLFLOW_TRACKING_URI") from None


def store_failure(where: str, err) -> UserError:
    """The tracking store failed (as opposed to not holding the run): its first line, redacted."""
    from posttrain.redact import redact_text

    first = redact_text(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    return UserError(where, f"the tracking store failed: {first[:300]}",
                     "check that the tracking server is up and MLFLOW_TRACKING_URI / --tracking-uri names it")


def check_out(out: str) -> None:
    """UserError unless the plot can be written at `out` (checked before any other work):
    a known image suffix, not a folder, and the nearest existing folder above it writable
    (missing folders are created when the plot is written)."""
    import tempfile

    path = Path(out).absolute()
    where = f"posttrain compare --out {out}"
    if path.suffix.lower() not in PLOT_FORMATS:
        raise UserError(where, "not an image file name", f"end it with one of {', '.join(PLOT_FORMATS)}")
    if path.is_dir():
        raise UserError(where, "is a folder", "pass a file name, e.g. compare.png")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(where, f"{folder} is a file, not a folder", "pass a path under a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".posttrain-write-check-")
        os.close(fd)
        os.unlink(probe)
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is read-only")
    except OSError as err:
        raise UserError(where, f"cannot write there ({err.strerror or err})",
                        "pass --out in a folder you can write to") from None


def differing_params(runs) -> dict[str, list]:
    keys = sorted({k for r in runs for k in r.data.params})
    table = {k: [r.data.params.get(k, "-") for r in runs] for k in keys}
    return {k: v for k, v in table.items() if len(set(v)) > 1}


def metrics_table(runs, prefixes=("evaluate.", "sft.", "grpo.", "serving.max_concurrency")) -> dict[str, list]:
    """Metric -> each run's value; interval bounds and prompt counts are not rows of their
    own (`interval` puts them beside their metric)."""
    keys = sorted({k for r in runs for k in r.data.metrics
                   if k.startswith(prefixes) and "_ci95" not in k and not k.endswith(".n_prompts")})
    return {k: [r.data.metrics.get(k) for r in runs] for k in keys}


def interval_key(metric: str) -> str:
    """Where a metric's interval is logged: `x.greedy_accuracy` -> `x.greedy_accuracy_ci95`,
    `x.pass_at_k.8` -> `x.pass_at_k_ci95.8` (`.low` / `.high` appended)."""
    head, dot, k = metric.rpartition(".")
    return f"{head}_ci95.{k}" if head.endswith(".pass_at_k") and dot else f"{metric}_ci95"


def interval(run, metric: str) -> list[float] | None:
    key = interval_key(metric)
    low, high = run.data.metrics.get(f"{key}.low"), run.data.metrics.get(f"{key}.high")
    return None if low is None or high is None else [low, high]


def test_delta(metric: str, runs, outcomes: list, first: int, other: int, *, resamples: int,
               seed: int) -> stats.Test | None:
    """The test of `runs[other]` against `runs[first]` on `metric`, None when it has no uncertainty."""
    test = stats.compare_runs(outcomes[first], outcomes[other], metric, resamples=resamples, seed=seed)
    if test is not None:
        return test
    ci_a, ci_b = interval(runs[first], metric), interval(runs[other], metric)
    va, vb = runs[first].data.metrics.get(metric), runs[other].data.metrics.get(metric)
    if ci_a is None or ci_b is None or va is None or vb is None:
        return None
    se = math.hypot(ci_a[1] - ci_a[0], ci_b[1] - ci_b[0]) / (2 * stats.Z95)
    p = 1.0 if se == 0 and va == vb else 0.0 if se == 0 else math.erfc(abs(vb - va) / se / math.sqrt(2))
    return stats.Test(vb - va, p, "normal approximation from the intervals", 0, paired=False)


def verdict(test: stats.Test | None, alpha: float) -> str:
    """`significant (paired, p<0.001, 500 prompts)`, `within noise (...)`, or '' without a test."""
    if test is None:
        return ""
    word = "significant" if test.p_value < alpha else "within noise"
    size = f", {test.n_prompts} prompts" if test.n_prompts else ""
    return f"{word} ({'paired' if test.paired else 'unpaired'}, {stats.format_p(test.p_value)}{size})"


def render(refs: list[str], runs, params: dict, metrics: dict, *, outcomes: list | None = None,
           alpha: float = 0.05, resamples: int = 2000, seed: int = 0) -> str:
    """Plain-text tables: params that differ, then metrics with their 95% intervals and
    deltas against the first run, each marked significant or within noise."""
    outcomes = outcomes or [None] * len(runs)
    names = [f"{ref[:8]}" if ref == r.info.run_id else f"{ref} ({r.info.run_id[:8]})" for ref, r in zip(refs, runs)]
    width = max([len(k) for k in list(params) + list(metrics)] + [6])
    lines = ["params that differ:" if params else "params: identical"]
    for key, values in params.items():
        lines.append(f"  {key:<{width}}  " + "  ".join(f"{str(v):>24}" for v in values))
    header = f"  {'metric':<{width}}  " + "  ".join(f"{n:>24}" for n in names)
    header += "".join(f"  {'d ' + n[:8]:>10}  {'':<40}" for n in names[1:])
    lines += ["", f"metrics [95% interval] (d: run minus the first; significant: p < {alpha}):", header]
    for key, values in metrics.items():
        cells = "  ".join(f"{cell(v, interval(r, key)):>24}" for v, r in zip(values, runs))
        deltas = ""
        for i, v in enumerate(values[1:], start=1):
            if v is None or values[0] is None:
                deltas += f"  {'-':>10}  {'':<40}"
                continue
            mark = verdict(test_delta(key, runs, outcomes, 0, i, resamples=resamples, seed=seed), alpha)
            deltas += f"  {v - values[0]:>+10.4f}  {mark:<40}"
        lines.append(f"  {key:<{width}}  {cells}{deltas}".rstrip())
    return "\n".join(lines)


def stats_settings(run, alpha: float | None, resamples: int | None) -> dict:
    """The significance level and resamples: as given, else as the run was configured
    (its `stats.*` params), else the config's defaults."""
    from posttrain.config import StatsSection

    default = StatsSection()
    params = run.data.params
    return {"alpha": alpha if alpha is not None else float(params.get("stats.alpha", default.alpha)),
            "resamples": resamples if resamples is not None else
            int(params.get("stats.bootstrap_resamples", default.bootstrap_resamples))}


def cell(value, ci) -> str:
    if value is None:
        return "-"
    return f"{value:.4f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.4f}"


def reward_curves(client, run) -> dict[str, list[tuple[int, float]]]:
    """Each GRPO stage's training reward (step, value), from the run's child runs."""
    experiment = run.info.experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    curves = {}
    for child in children:
        name = child.data.tags.get("mlflow.runName", "")
        if kind_of(name) == "grpo":
            history = client.get_metric_history(child.info.run_id, "reward")
            curves[name] = [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
    return curves


def plot(client, refs: list[str], runs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    all_ks: set[int] = set()
    for ref, run in zip(refs, runs):
        for stage, points in reward_curves(client, run).items():
            if points:
                left.plot(*zip(*points), label=f"{ref[:12]} {stage}")
        ks = sorted((int(m.group(1)), v) for key, v in run.data.metrics.items() if (m := _PASS.match(key)))
        if ks:
            right.plot(*zip(*ks), marker="o", label=ref[:12])
            all_ks.update(k for k, _ in ks)
    left.set(xlabel="step", ylabel="training reward", title="GRPO training reward")
    if all_ks:
        right.set_xscale("log")
        right.set_xticks(sorted(all_ks), [str(k) for k in sorted(all_ks)])
        right.minorticks_off()
    right.set(xlabel="k", ylabel="pass@k", ylim=(0, 1.02), title="held-out pass@k (final model)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def compare(refs: list[str], *, out: str, model_name: str, tracking_uri: str | None = None,
            alpha: float | None = None, resamples: int | None = None) -> str:
    """Resolve, print-ready text, the PNG at `out`, and a `compare` run holding it.
    alpha, resamples: None takes the first run's `stats.*` params (else the defaults)."""
    import mlflow
    from mlflow import MlflowClient

    from posttrain.tracking.mlflow_runs import run_outcomes

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient()
    runs = [resolve(client, ref, model_name) for ref in refs]
    outcomes = [run_outcomes(r.info.run_id) for r in runs]
    settings = stats_settings(runs[0], alpha, resamples)
    text = render(refs, runs, differing_params(runs), metrics_table(runs), outcomes=outcomes, **settings)
    plot(client, refs, runs, out)
    with mlflow.start_run(experiment_id=runs[0].info.experiment_id, run_name="compare") as run:
        mlflow.set_tags({"posttrain.tracking.compare": ",".join(r.info.run_id for r in runs)})
        mlflow.log_artifact(out)
        mlflow.log_text(text, "compare.txt")
    return text + f"\n\noverlay plot: {out} (also an artifact of MLflow run {run.info.run_id})"
