"""Your own data: train and held-out files (JSON lines or Parquet, read with the
`datasets` library) and a verifier chosen by name.

    data:
      env: dataset
      options: {train: custom/train.jsonl, heldout: custom/heldout.jsonl, verifier: math}

Paths are relative to the workspace and must lie in its `custom/` folder, a DVC
dependency of every stage, committed with the workspace: editing a file reruns the
pipeline. Verifiers:
- `exact`: the answer text equals the reference (after `strip`);
- `numeric`: both read as numbers and agree within `tolerance` (absolute or relative);
- `math`: HF's `math-verify`, the verifier open-r1 uses (`\\boxed{}`, fractions, LaTeX), in a
  worker process with a time limit (posttrain.envs.mathverify);
- `choice`: one letter of `choices` (`B`, `(B)`, `B.` all read as `B`);
- `regex`: the reference answer is a regular expression the answer must match whole.
Other columns of the files are kept and reach reward functions as keyword arguments.
`answer_pattern` (a regex with one group, e.g. `<answer>(.*?)</answer>`) first cuts the
answer out of the completion: the format contract the `unparseable` guardrail holds the
model to; `format_pattern` (the whole completion) is what the `format` reward checks.

Model output is never trusted. Every user pattern (`answer_pattern`, `format_pattern`, a
`regex` reference) runs with the `regex` module, at most PATTERN_TIMEOUT_S per match, and
math-verify at most mathverify.MATH_TIMEOUT_S per call: a match over its limit scores the
completion unparseable (or wrong), never a stall, and is counted (`timeout_counts`: the
training stages report `pattern_timeouts` and `math_timeouts`). The check refuses a pattern that
runs past its limit on an SFT target, a counted repeat the `regex` module would take
minutes to compile, and a `math` reference answer over MAX_ANSWER_CHARS or nested deeper
than MAX_LATEX_DEPTH.
"""

from __future__ import annotations

import collections
import functools
import math
import re
import tempfile
from pathlib import Path
from typing import Literal

import regex
from pydantic import Field, field_validator

from posttrain.envs import mathverify
from posttrain.envs.base import EnvOptions
from posttrain.envs.mathverify import MAX_LATEX_DEPTH, MathLimit
from posttrain.errors import OptionError, invalid
from posttrain.files import json_lines
from posttrain.plugins import CUSTOM_DIR, resolve, workspace_root

VERIFIERS = ("exact", "numeric", "math", "choice", "regex")
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_CHOICE = re.compile(r"\(?([A-Za-z])\)?[.:]?")
MAX_ANSWER_CHARS = 10_000  # of a completion a verifier reads; of a `math` reference answer
# A pattern that scans linearly takes microseconds on 10,000 characters; one that
# backtracks exponentially (`^(a|aa)+$`) takes minutes on 40. A GRPO batch may meet a
# few hundred over-limit matches: 0.1 s each keeps a step within a minute.
PATTERN_TIMEOUT_S = 0.1
PATTERN_FIX = "simplify it: no nested or overlapping repeats such as (a+)+ or (a|aa)*, which backtrack exponentially"
# The `regex` module compiles a counted repeat by copying its body (a{1000000} takes 0.7 s
# and 300 MB, a{4294967294} never ends), so counts are bounded before it compiles one.
MAX_REPEAT = 1000
MAX_REPEATS_PRODUCT = 100_000
_COUNTED_REPEAT = re.compile(r"\{(\d*)(?:,(\d*))?\}")
_FLAGS = regex.DOTALL | regex.VERSION0  # VERSION0: the syntax of Python's `re`


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be a user pattern (not a regular expression, or counted repeats
    too large to compile), else None."""
    counts = [max(int(n) if len(n) <= 12 else 10**12 for n in found if n)  # int() of 5000 digits raises
              for found in _COUNTED_REPEAT.findall(pattern) if any(found)]
    if any(n > MAX_REPEAT for n in counts) or math.prod(counts) > MAX_REPEATS_PRODUCT:
        total = f" ({math.prod(counts)} in all)" if len(counts) > 1 else ""
        return (f"repeats up to {max(counts)} times{total}: the regex module copies a counted repeat when it "
                f"compiles it, so this takes minutes; keep counts under {MAX_REPEAT}")
    try:
        regex.compile(pattern, _FLAGS)
    except (regex.error, RecursionError, ValueError, OverflowError) as err:
        return f"is not a regular expression ({err})"
    return None


@functools.lru_cache(maxsize=65536)
def _reference_pattern(answer: str):
    """A `regex` reference answer, checked and compiled once (every completion of a prompt is
    judged against it), or None when it cannot be a pattern (`regex_problem`)."""
    return None if regex_problem(answer) else regex.compile(answer, _FLAGS)


class _OverLimit(Exception):
    """A user pattern or math-verify ran past its limit on a text (counted once per text)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class DatasetOptions(EnvOptions):
    """`data.options` of the dataset environment."""
    train: str = Field(..., min_length=1, description="Training rows: a .jsonl or .parquet file in custom/.")
    heldout: str = Field(..., min_length=1, description="Held-out rows (evaluation, the gate), same format.")
    verifier: Literal[VERIFIERS] = Field(..., description=f"How a completion is judged: one of {', '.join(VERIFIERS)}.")
    prompt_field: str = Field("prompt", min_length=1, description="Column holding the prompt.")
    answer_field: str = Field("answer", min_length=1, description="Column holding the reference answer.")
    completion_field: str = Field("completion", min_length=1, description="Column holding the SFT target; "
                                  "a training file without it runs with `sft: off` only (GRPO from the base model).")
    system: str | None = Field(None, max_length=20_000, description="System prompt (conversational prompts).")
    answer_pattern: str | None = Field(None, max_length=500, description="Regex with one group that cuts the "
                                       "answer out of a completion, e.g. <answer>(.*?)</answer>.")
    format_pattern: str | None = Field(None, max_length=500, description="Regex the whole completion must "
                                       "match for the `format` reward, e.g. <think>.*?</think>\\s*<answer>.*?</answer>.")
    tolerance: float = Field(1e-6, ge=0, description="numeric: absolute or relative tolerance.")
    choices: str = Field("ABCD", min_length=2, max_length=26, pattern=r"^[A-Z]+$",
                         description="choice: the letters an answer may be.")

    @field_validator("answer_pattern", "format_pattern")
    @classmethod
    def _a_regex(cls, pattern, info):
        if pattern is None:
            return pattern
        problem = regex_problem(pattern)
        if problem:
            raise invalid(problem, "escape special characters, e.g. \\( \\), and keep counted repeats small")
        groups = regex.compile(pattern, _FLAGS).groups
        if info.field_name == "answer_pattern" and groups != 1:
            raise invalid(f"has {groups} groups", "use exactly one (...) group around the answer")
        return pattern


class DatasetEnv:
    name = "dataset"
    Options = DatasetOptions

    def __init__(self, **options):
        self.setup(DatasetOptions(**options))

    def setup(self, options: DatasetOptions) -> None:
        """Build from validated options (a subclass passes its own schema's)."""
        self.options = options
        self.verifier = self.options.verifier
        self.system = self.options.system  # the system prompt of conversational prompts (data.chat)
        self._pattern = regex.compile(self.options.answer_pattern, _FLAGS) if self.options.answer_pattern else None
        self._format = regex.compile(self.options.format_pattern, _FLAGS) if self.options.format_pattern else None
        # matches cut by a limit, by what ran (answer_pattern, format_pattern, regex, math); a
        # (what, text) over it once is not run again: the same verdict, counted once
        self.timeouts: collections.Counter = collections.Counter()
        self._over_limit: set = set()

    # --- the splits ------------------------------------------------------------------
    def generate(self, seed: int) -> dict[str, list[dict]]:
        """The rows of both files, as given (their order is the user's; `seed` unused)."""
        splits = {split: self.read(split) for split in ("train", "heldout")}
        leaked = {r["prompt"] for r in splits["heldout"]} & {r["prompt"] for r in splits["train"]}
        if leaked:
            raise OptionError("heldout", f"{len(leaked)} held-out prompts are also in {self.options.train}, "
                              f"e.g. {next(iter(sorted(leaked)))[:80]!r}",
                              "remove them from one of the files (held-out truth must stay unseen in training)")
        return splits

    def read(self, split: str) -> list[dict]:
        """One file's rows; OptionError (naming the file and line) for a row no verifier can
        use, and, in the training file, for an SFT target a user pattern runs too long on."""
        path, kind = self._located(split)  # as the config gives it, from the workspace
        stat = resolve(path).stat()
        table, lines = _load(kind, str(resolve(path).resolve()), stat.st_mtime_ns, stat.st_size, split, str(path))
        lines = lines if lines and len(lines) == len(table) else None  # else rows, as datasets counts them
        columns = set(table.column_names)
        for field in ("prompt_field", "answer_field"):
            wanted = getattr(self.options, field)
            if wanted not in columns:
                raise OptionError(field, f"{path} has no field {wanted!r} (it has {sorted(columns)[:12]})",
                                  f"set data.options.{field} to the column that holds it")
        if not len(table):
            raise OptionError(split, f"{path} has no rows", "give a file with at least one row")
        completion = self.options.completion_field if self.options.completion_field in columns else None
        if split == "train":
            self.sft_targets = completion is not None  # without, SFT would train on the bare answer: check refuses it
        mapped = {self.options.prompt_field, self.options.answer_field, completion}
        rows = []
        for i, row in enumerate(table):
            where = f"{path} line {lines[i]}" if lines else f"{path} row {i + 1}"
            prompt, answer = row[self.options.prompt_field], row[self.options.answer_field]
            if not isinstance(prompt, str) or not prompt.strip() or answer is None or not str(answer).strip():
                raise OptionError(split, f"{where}: {self.options.prompt_field!r} and "
                                  f"{self.options.answer_field!r} must be non-empty", "fix or drop the row")
            target = row[completion] if completion and row[completion] is not None else str(answer)
            self._check_answer(str(answer).strip(), where)
            if split == "train":
                self.check_target(str(target), str(answer).strip(), where)
            extra = {k: v for k, v in row.items() if k not in mapped and k not in ("prompt", "completion", "answer",
                                                                                   "messages")}
            # the file's other columns reach reward functions by name (posttrain.chat.reward_columns)
            rows.append({**extra, "prompt": prompt, "completion": str(target), "answer": str(answer).strip()})
        return rows

    def _located(self, split: str) -> tuple[Path, str]:
        """The split's file (from the workspace) and its `datasets` loader; OptionError
        unless it is a .jsonl, .json or .parquet file in custom/."""
        path = Path(getattr(self.options, split))
        if path.is_absolute() or ".." in path.parts or not path.parts or path.parts[0] != CUSTOM_DIR:
            raise OptionError(split, f"{str(path)[:200]!r} is not inside the workspace's {CUSTOM_DIR}/ folder",
                              f"put the file in {CUSTOM_DIR}/ (a DVC dependency of every stage) and give its path "
                              f"from the workspace, e.g. {CUSTOM_DIR}/{path.name[:80]}")
        if not resolve(path).is_file():
            raise OptionError(split, f"{str(path)[:200]} not found (from {workspace_root()})",
                              "give the path of an existing .jsonl or .parquet file, from the workspace")
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise OptionError(split, f"{path} is neither JSON lines nor Parquet", "use a .jsonl or .parquet file")
        return path, kind

    def _check_answer(self, answer: str, where: str) -> None:
        """OptionError (at answer_field) for a reference answer this verifier cannot judge within its limits."""
        problem = self.answer_problem(answer)
        if problem:
            raise OptionError("answer_field", f"{where}: {problem}", "fix or drop the row")

    def answer_problem(self, answer: str) -> str | None:
        """Why a reference answer cannot be judged against within the verifier's limits."""
        if self.verifier == "math" and len(answer) > MAX_ANSWER_CHARS:
            return f"the answer is {len(answer)} characters, over math-verify's {MAX_ANSWER_CHARS}"
        if self.verifier == "math" and mathverify.nesting_depth(answer) > MAX_LATEX_DEPTH:
            return f"the answer nests brackets over {MAX_LATEX_DEPTH} deep, past what math-verify parses in time"
        problem = regex_problem(answer) if self.verifier == "regex" else None
        return f"the answer {answer[:60]!r} {problem}" if problem else None

    def check_target(self, target: str, answer: str, where: str) -> None:
        """OptionError when a user pattern runs past PATTERN_TIMEOUT_S on this SFT target:
        it would then score model output by the clock, so the check refuses it first."""
        try:
            text = self._answer_part(target)
            if self._format is not None:
                self._bounded("format_pattern", self._format.fullmatch, target[:MAX_ANSWER_CHARS].strip())
            if self.verifier == "regex" and text:
                self._reference_matches(answer, text)
        except _OverLimit as err:
            which = f"the reference regex {answer[:60]!r}" if err.what == "regex" else "the pattern"
            raise OptionError("answer_field" if err.what == "regex" else err.what,
                              f"{where}: {which} ran past its {PATTERN_TIMEOUT_S} s time limit per match on the "
                              f"SFT target {target[:60]!r}", PATTERN_FIX) from None

    def check_row(self, row: dict) -> str | None:
        """An incoming row's answer must be one this verifier can compare against."""
        answer = row["answer"].strip()
        if self.verifier == "numeric" and not _finite(answer):
            return f"answer {answer[:80]!r} is not a number (numeric verifier)"
        if self.verifier == "choice" and (len(answer) != 1 or answer.upper() not in self.options.choices):
            return f"answer {answer[:80]!r} is not one of {self.options.choices} (choice verifier)"
        return self.answer_problem(answer)

    # --- judging a completion ----------------------------------------------------------
    def extract(self, completion: str) -> str | None:
        """The answer part of a completion: `answer_pattern`'s group (None when it does
        not match in time), else the whole completion, stripped."""
        try:
            return self._answer_part(completion)
        except _OverLimit:
            return None

    def _answer_part(self, completion: str) -> str | None:
        completion = completion[:MAX_ANSWER_CHARS]
        if self._pattern is None:
            return completion.strip()
        match = self._bounded("answer_pattern", self._pattern.search, completion)
        return match.group(1).strip() if match else None

    def format_ok(self, completion: str) -> bool:
        """The `format` reward: `format_pattern` matches the whole completion (in time);
        without one, `answer_pattern` finds the answer."""
        if self._format is None:
            return self.parse(completion) is not None
        try:
            return self._bounded("format_pattern", self._format.fullmatch,
                                 completion[:MAX_ANSWER_CHARS].strip()) is not None
        except _OverLimit:
            return False

    def parse(self, completion: str) -> str | None:
        text = self.extract(completion)
        if not text:
            return None
        if self.verifier == "numeric":
            return text.replace(",", "") if _finite(text) else None
        if self.verifier == "choice":
            letter = _CHOICE.fullmatch(text)
            return letter.group(1).upper() if letter and letter.group(1).upper() in self.options.choices else None
        if self.verifier == "math":
            return self._math(None, mathverify.parse, text)
        return text

    def verify(self, completion: str, answer: str) -> bool:
        if self.verifier == "math":
            text = self.extract(completion)
            return bool(text) and self._math(False, mathverify.verify, answer, text)
        parsed = self.parse(completion)
        if parsed is None:
            return False
        if self.verifier == "numeric":
            return _finite(answer) and math.isclose(float(parsed), float(answer.strip().replace(",", "")),
                                                    rel_tol=self.options.tolerance, abs_tol=self.options.tolerance)
        if self.verifier == "choice":
            return parsed == answer.strip().upper()
        if self.verifier == "regex":
            try:
                return self._reference_matches(answer, parsed)
            except _OverLimit:
                return False
        return parsed == answer.strip()

    def _reference_matches(self, answer: str, text: str) -> bool:
        """The `regex` verifier: the reference answer, as a regular expression, matches the
        whole text (a reference that is no regular expression matches nothing)."""
        pattern = _reference_pattern(answer)
        if pattern is None:
            return False
        return self._bounded("regex", pattern.fullmatch, text, key=(answer, text)) is not None

    # --- limits ------------------------------------------------------------------------
    def _bounded(self, what: str, call, *texts: str, key=None):
        """`call(*texts)` within its limit: PATTERN_TIMEOUT_S for a pattern (the `regex`
        module's own `timeout`), MATH_TIMEOUT_S for math-verify; _OverLimit past it, counted
        once per text."""
        key = (what, key if key is not None else texts)
        if key in self._over_limit:
            raise _OverLimit(what)
        try:
            return call(*texts) if what == "math" else call(*texts, timeout=PATTERN_TIMEOUT_S)
        except (TimeoutError, MathLimit):
            self.timeouts[what] += 1
            if len(self._over_limit) >= 4096:  # a bounded memory of hostile texts
                self._over_limit.clear()
            self._over_limit.add(key)
            raise _OverLimit(what) from None

    def _math(self, verdict, call, *texts: str):
        """math-verify's `call(*texts)`, or `verdict` when it runs past its limit (counted)."""
        try:
            return self._bounded("math", call, *texts)
        except _OverLimit:
            return verdict

    def timeout_counts(self) -> dict[str, int]:
        """Matches this environment cut at a limit since it was made, for a stage's metrics:
        `pattern_timeouts` (answer_pattern, format_pattern, a regex reference) and
        `math_timeouts` (math-verify past MATH_TIMEOUT_S, or text nested too deeply)."""
        return {"pattern_timeouts": sum(n for what, n in self.timeouts.items() if what != "math"),
                "math_timeouts": self.timeouts["math"]}


def _finite(text: str) -> bool:
    """A plain number (commas as thousands separators allowed) that is finite as a float."""
    text = text.strip().replace(",", "")
    return bool(_NUMBER.fullmatch(text)) and math.isfinite(float(text))


@functools.lru_cache(maxsize=8)
def _load(kind: str, path: str, mtime_ns: int, size: int, option: str, shown: str):
    """(the file as a `datasets` table, each row's line number or None); read once per
    process while it is unchanged (the config check and the stage both build the
    environment). A file the `datasets` library would refuse with its generic "An error
    occurred while generating the dataset" is looked at first, cheaply, so the error names
    the line and what is wrong with it; the library's cache goes to a temporary folder (in
    the workspace's .dvc/tmp when there is one), never the user's home."""
    lines = _json_lines(path, option, shown) if shown.endswith(".jsonl") else None  # `path`: a link's target
    if lines == []:
        raise OptionError(option, f"{shown} has no rows", "give a file with at least one JSON object per line")
    if kind == "parquet":
        _check_parquet(path, option, shown)
    import datasets

    datasets.disable_progress_bars()
    scratch = resolve(".dvc/tmp") if resolve(".dvc/tmp").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="posttrain-datasets-", dir=scratch) as cache:
        try:
            table = datasets.load_dataset(kind, data_files=path, split="train", keep_in_memory=True, cache_dir=cache)
        except Exception as err:  # the library's own reason (its cause, not its wrapper), as one line
            cause = err.__cause__ or err
            raise OptionError(option, f"{shown} cannot be read as {kind}: {type(cause).__name__}: "
                              f"{' '.join(str(cause).split())[:200]}",
                              "fix the file (one JSON object per line)") from None
    return table, lines


_JSON_KINDS = {list: "a JSON array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


def _json_lines(path: str, option: str, shown: str) -> list[int]:
    """The line number of each row of a JSON-lines file; OptionError at the first line
    that is not one JSON object in UTF-8."""
    lines = []
    with open(path, "rb") as fh:
        for number, row, problem in json_lines(fh):
            if problem is None and not isinstance(row, dict):
                problem = f"{_JSON_KINDS.get(type(row), 'a value')}, not a JSON object"
            if problem:
                fix = "save the file as UTF-8 text" if "UTF-8" in problem else \
                    'make each line one JSON object, e.g. {"prompt": "...", "answer": "..."}'
                raise OptionError(option, f"{shown} line {number}: {problem}", fix)
            lines.append(number)
    return lines


def _check_parquet(path: str, option: str, shown: str) -> None:
    """OptionError unless pyarrow reads the file's Parquet footer."""
    import pyarrow.parquet

    try:
        pyarrow.parquet.read_metadata(path)
    except Exception as err:  # pyarrow's ArrowInvalid / OSError: its own words, one line
        raise OptionError(option, f"{shown} is not a Parquet file: {' '.join(str(err).split())[:200]}",
                          "write it with pandas' to_parquet or datasets' to_parquet, or use a .jsonl file") from None
