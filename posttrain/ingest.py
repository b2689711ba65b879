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

Only regular `*.jsonl` files are batches. Anything else in `incoming/` (a `.json` file, a
subfolder, a link, a FIFO named `*.jsonl`) stops the run with one line naming it and the
fix, before anything is read or versioned: data left there unread would look ingested.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

from posttrain.errors import UserError
from posttrain.files import MAX_LINE_BYTES, first_clause, json_lines
from posttrain.workspace import commit, run_checked

INCOMING = "incoming"
DATASETS = "datasets"
SHOWN_ERRORS = 5
SHOWN_CHARS = 200     # of one reason or name in an error line


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
    try:
        if not env.verify(completion, row["answer"]):
            return f"completion {completion!r} does not parse as the answer {row['answer']!r} ({env.name} parser)"
        if row["prompt"] in heldout:
            return "prompt is in the held-out split (held-out truth must stay unseen in training)"
        own_check = getattr(env, "check_row", None)
        return own_check(row) if own_check else None
    except ValueError as err:  # int() of a 5000-digit string: past Python's int-string limit
        return f"the {env.name} environment cannot read this row ({first_clause(err)})"


def read_batch(path: Path, env, heldout: set[str]) -> tuple[list[dict], list[str]]:
    """(rows, errors) of one incoming file; each error reads `file:line: reason`.

    Opened without following a link or blocking, and read only if it is a regular file:
    a FIFO swapped in after `pending` looked would otherwise hang the run (which holds the
    workspace lock). Lines are read one at a time, each at most posttrain.files.MAX_LINE_BYTES.
    """
    rows, errors = [], []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as err:
        return [], [f"{_shown(path)}: cannot be read ({err.strerror})"]
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return [], [f"{_shown(path)}: not a regular file"]
        for number, row, problem in json_lines(fh):
            problem = problem or check_row(env, row, heldout)
            if problem:
                errors.append(f"{_shown(path)}:{number}: {_shown(problem, SHOWN_CHARS)}")
            else:
                rows.append({"prompt": row["prompt"], "answer": row["answer"],
                             "completion": row.get("completion", row["answer"])})
    if not rows and not errors:
        errors.append(f"{_shown(path)}: empty file")
    return rows, errors


def pending(workdir: str | Path) -> list[Path]:
    """The batches waiting in `incoming/`: its regular `*.jsonl` files, in name order.

    Anything else there is refused (UserError) rather than silently left unread: a `.json`
    file, a subfolder, a link, a FIFO or device named `*.jsonl` (opening a FIFO would hang
    the run). Hidden names (`.x.jsonl.tmp` from rsync, `.gitkeep`) are copies in progress
    or markers, and are skipped.
    """
    folder = Path(workdir) / INCOMING
    if not folder.exists():
        return []
    if not folder.is_dir():
        raise UserError(_shown(folder), "is not a folder, so no batch in it can be read",
                        f"remove it; new data goes in {INCOMING}/<name>.jsonl files")
    try:
        entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as err:
        raise UserError(_shown(folder), f"cannot be listed ({err.strerror})", "make the folder readable") from None
    refused = [(path, *why) for path in entries if (why := _not_a_batch(path))]
    if refused:
        path, problem, fix = refused[0]
        others = ", ".join(_shown(p.name) for p, *_ in refused[1:])
        raise UserError(_shown(path), f"{problem}; nothing versioned" + (f" (nor read: {others})" if others else ""),
                        fix)
    return entries


def _not_a_batch(path: Path) -> tuple[str, str] | None:
    """(problem, fix) when an entry of `incoming/` is not a batch file, else None."""
    try:
        mode = path.lstat().st_mode
    except OSError as err:  # gone since the listing (a `mv` under way), or unreadable
        return f"cannot be examined ({err.strerror})", "retry once it is in place and readable"
    if stat.S_ISDIR(mode):
        return ("is a folder, and subfolders are not read",
                f"move its *.jsonl files up into {INCOMING}/ (and the folder out)")
    if stat.S_ISLNK(mode):
        return "is a symbolic link, and links are not followed", f"copy the file itself into {INCOMING}/"
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        return (f"is {kind}, not a regular file, so it is not opened",
                f"write the rows to a file elsewhere, then `mv` it into {INCOMING}/")
    if path.suffix == ".json":
        return ("is a .json file, and only JSON-lines *.jsonl files are read",
                "rename it to .jsonl if it holds one JSON object per line, else move it out")
    if path.suffix != ".jsonl":
        return ("is not a *.jsonl batch, and nothing else here is read",
                "move it out, or rename it to .jsonl if it holds one JSON object per line")
    return None


def _shown(text, limit: int | None = None) -> str:
    """`text` fit for a one-line error: past `limit` characters the middle cut out, and
    control characters escaped (a file name may hold a newline)."""
    def escaped(part: str) -> str:
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in part)
    text, half = str(text), (limit or 0) // 2
    if limit is None or len(text) <= limit:
        return escaped(text)
    return f"{escaped(text[:half])}...({len(text) - 2 * half} chars)...{escaped(text[-half:])}"


def validate(workdir: str | Path, env, heldout: set[str]) -> dict[Path, list[dict]]:
    """Every pending batch's rows; UserError naming the bad rows if any row is bad."""
    batches, errors = {}, []
    for path in pending(workdir):
        batches[path], bad = read_batch(path, env, heldout)
        errors += bad
    if errors:
        shown = "; ".join(errors[:SHOWN_ERRORS]) + (f"; and {len(errors) - SHOWN_ERRORS} more"
                                                     if len(errors) > SHOWN_ERRORS else "")
        raise UserError(_shown(Path(workdir) / INCOMING), f"{len(errors)} bad row(s), nothing versioned: {shown}",
                        "fix or remove those rows; the next run versions the folder again")
    return batches


def env_and_heldout(config):
    """The config's environment and its held-out prompts (which new data must not hold)."""
    from posttrain.envs import config_env

    env = config_env(config.data)
    return env, heldout_prompts(env.generate(config.seed))


def heldout_prompts(splits: dict[str, list[dict]]) -> set[str]:
    """The held-out prompts of an environment's splits (which new data must not hold)."""
    return {row["prompt"] for row in splits["heldout"]}


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
        run_checked([dvc, "--wait-for-lock", "add", "--quiet", *names], workdir)
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
    from posttrain.files import read_jsonl

    datasets_dir = Path(datasets_dir)
    versioned = [datasets_dir / p.name[:-4] for p in sorted(datasets_dir.glob("*.jsonl.dvc"))]
    missing = [p for p in versioned if not p.is_file()]
    if missing:
        raise UserError(str(missing[0]), "versioned data is not in the workspace",
                        f"run `dvc pull {DATASETS}` to fetch it from the DVC remote")
    # only files with a .dvc record: a file put here by hand (or half-written) is not data
    return [row for path in versioned for row in read_jsonl(path)]


__all__ = ["INCOMING", "DATASETS", "MAX_LINE_BYTES", "check_row", "read_batch", "validate", "version_incoming",
           "extra_rows"]
