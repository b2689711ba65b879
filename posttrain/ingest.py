"""New training data: files dropped into `incoming/`, validated, versioned with DVC.

A batch is a JSON-lines file `incoming/<name>.jsonl`, one object per line:

    {"prompt": "37+48=", "answer": "85"}                   # completion defaults to the answer
    {"prompt": "12+30=", "answer": "42", "completion": "42"}

Every row of every pending file is checked (`check_row`) before anything is written:
an object with a non-empty `prompt` and `answer`, a `completion` the environment's
parser reads as the answer, a prompt the environment itself can answer (its
`check_row`, when it has one) and not one of the held-out prompts. A bad row anywhere
means nothing is versioned, and the error names each file and line.

Accepted batches become `datasets/<name>.jsonl`, each tracked by DVC (`dvc add`), and
the `.dvc` files are committed to git: one commit per run that brought data, so any
later run's git commit names its exact data. The prepare stage (which depends on
`datasets/`) appends them to the training split.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from posttrain.errors import UserError
from posttrain.workspace import commit, run_checked

INCOMING = "incoming"
DATASETS = "datasets"
SHOWN_ERRORS = 5


def check_row(env, row, heldout: set[str]) -> str | None:
    """Why `row` can't be training data for `env`, or None when it can."""
    if not isinstance(row, dict):
        return "not a JSON object"
    for key in ("prompt", "answer"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            return f"`{key}` must be a non-empty string"
    if "completion" in row and not isinstance(row["completion"], str):
        return "`completion` must be a string"
    completion = row.get("completion", row["answer"])
    if not env.verify(completion, row["answer"]):
        return f"completion {completion!r} does not parse as the answer {row['answer']!r} ({env.name} parser)"
    if row["prompt"] in heldout:
        return "prompt is in the held-out split (held-out truth must stay unseen in training)"
    own_check = getattr(env, "check_row", None)
    return own_check(row) if own_check else None


def read_batch(path: Path, env, heldout: set[str]) -> tuple[list[dict], list[str]]:
    """(rows, errors) of one incoming file; each error reads `file:line: reason`."""
    rows, errors = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        return [], [f"{path}: not UTF-8 text (byte {err.start})"]
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            errors.append(f"{path}:{number}: not JSON ({err.msg})")
            continue
        problem = check_row(env, row, heldout)
        if problem:
            errors.append(f"{path}:{number}: {problem}")
        else:
            rows.append({"prompt": row["prompt"], "answer": row["answer"],
                         "completion": row.get("completion", row["answer"])})
    if not rows and not errors:
        errors.append(f"{path}: empty file")
    return rows, errors


def pending(workdir: str | Path) -> list[Path]:
    return sorted((Path(workdir) / INCOMING).glob("*.jsonl"))


def validate(workdir: str | Path, env, heldout: set[str]) -> dict[Path, list[dict]]:
    """Every pending batch's rows; UserError naming the bad rows if any row is bad."""
    batches, errors = {}, []
    for path in pending(workdir):
        batches[path], bad = read_batch(path, env, heldout)
        errors += bad
    if errors:
        shown = "; ".join(errors[:SHOWN_ERRORS]) + (f"; and {len(errors) - SHOWN_ERRORS} more"
                                                     if len(errors) > SHOWN_ERRORS else "")
        raise UserError(f"{Path(workdir) / INCOMING}", f"{len(errors)} bad row(s), nothing versioned: {shown}",
                        "fix or remove those rows; the next run versions the folder again")
    return batches


def env_and_heldout(config):
    """The config's environment and its held-out prompts (which new data must not hold)."""
    from posttrain.envs import get_env

    env = get_env(config.data.env, **config.data.options)
    return env, {row["prompt"] for row in env.generate(config.seed)["heldout"]}


def check_pending(workdir: str | Path, config) -> int:
    """Validate what waits in `incoming/` (UserError on a bad row); how many files wait."""
    if not pending(workdir):
        return 0
    return len(validate(workdir, *env_and_heldout(config)))


def version_incoming(workdir: str | Path, env, heldout: set[str], dvc: str = "dvc") -> list[str]:
    """Validate and version all pending batches; returns the new `datasets/` files.

    All or nothing: on any failure the written files are removed, git is left as it
    was, and the incoming files stay where they are.
    """
    workdir = Path(workdir)
    batches = validate(workdir, env, heldout)
    if not batches:
        return []
    if not (workdir / ".git").exists():
        raise UserError(str(workdir / INCOMING), "new data is versioned in git + DVC, but the workspace is not a "
                        "git repository", "run `git init && dvc init` there (or use `posttrain run --config`)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    written = []
    try:
        for source, rows in batches.items():
            dest = workdir / DATASETS / f"{stamp}-{source.stem}.jsonl"
            dest.parent.mkdir(exist_ok=True)
            dest.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
            written.append(dest)
        names = [str(p.relative_to(workdir)) for p in written]
        run_checked([dvc, "add", "--quiet", *names], workdir)
        paths = [*(n + ".dvc" for n in names), f"{DATASETS}/.gitignore"]
        run_checked(["git", "add", *paths], workdir)
        rows = sum(len(r) for r in batches.values())
        message = f"data: {rows} rows from {', '.join(p.name for p in batches)} (posttrain ingest)"
        # only these paths: whatever else the user has staged stays out of the data commit
        commit(workdir, message, paths)
    except BaseException:
        _undo(workdir, written)
        raise
    for source in batches:
        os.remove(source)
    return names


def _undo(workdir: Path, written: list[Path]) -> None:
    def git(*args):
        subprocess.run(["git", *args], cwd=workdir, capture_output=True)
    for path in written:
        for leftover in (path, path.with_name(path.name + ".dvc")):
            git("rm", "-q", "--cached", "--ignore-unmatch", str(leftover))
            leftover.unlink(missing_ok=True)
    ignore = f"{DATASETS}/.gitignore"
    git("reset", "-q", "--", ignore)
    in_head = subprocess.run(["git", "cat-file", "-e", f"HEAD:{ignore}"], cwd=workdir, capture_output=True)
    if in_head.returncode == 0:
        git("checkout", "-q", "--", ignore)
    else:
        (workdir / ignore).unlink(missing_ok=True)


def extra_rows(datasets_dir: str | Path) -> list[dict]:
    """The versioned batches' rows, oldest batch first (what prepare appends to train)."""
    from posttrain.io import read_jsonl

    datasets_dir = Path(datasets_dir)
    versioned = [datasets_dir / p.name[:-4] for p in sorted(datasets_dir.glob("*.jsonl.dvc"))]
    missing = [p for p in versioned if not p.is_file()]
    if missing:
        raise UserError(str(missing[0]), "versioned data is not in the workspace",
                        f"run `dvc pull {DATASETS}` to fetch it from the DVC remote")
    # only files with a .dvc record: a file put here by hand (or half-written) is not data
    return [row for path in versioned for row in read_jsonl(path)]


__all__ = ["INCOMING", "DATASETS", "check_row", "read_batch", "validate", "version_incoming", "extra_rows"]
