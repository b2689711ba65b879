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
- `math`: HF's `math-verify`, the verifier open-r1 uses (`\\boxed{}`, fractions, LaTeX);
- `choice`: one letter of `choices` (`B`, `(B)`, `B.` all read as `B`);
- `regex`: the reference answer is a regular expression the answer must match whole (at
  most REGEX_TIMEOUT_S per match: model output cannot stall training by backtracking).
Other columns of the files are kept and reach reward functions as keyword arguments.
`answer_pattern` (a regex with one group, e.g. `<answer>(.*?)</answer>`) first cuts the
answer out of the completion: the format contract the `unparseable` guardrail holds the
model to; `format_pattern` (the whole completion) is what the `format` reward checks.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from pathlib import Path
from typing import Literal

import regex
from pydantic import Field, field_validator

from posttrain.envs.base import EnvOptions
from posttrain.errors import OptionError, invalid
from posttrain.plugins import CUSTOM_DIR

VERIFIERS = ("exact", "numeric", "math", "choice", "regex")
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_CHOICE = re.compile(r"\(?([A-Za-z])\)?[.:]?")
MAX_ANSWER_CHARS = 10_000  # of a completion a verifier reads
REGEX_TIMEOUT_S = 1.0      # per match of a reference regex against model output


class DatasetOptions(EnvOptions):
    """`data.options` of the dataset environment."""
    train: str = Field(..., min_length=1, description="Training rows: a .jsonl or .parquet file in custom/.")
    heldout: str = Field(..., min_length=1, description="Held-out rows (evaluation, the gate), same format.")
    verifier: Literal[VERIFIERS] = Field(..., description=f"How a completion is judged: one of {', '.join(VERIFIERS)}.")
    prompt_field: str = Field("prompt", min_length=1, description="Column holding the prompt.")
    answer_field: str = Field("answer", min_length=1, description="Column holding the reference answer.")
    completion_field: str = Field("completion", min_length=1, description="Column holding the SFT target; "
                                  "a file without it trains on the answer itself.")
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
        try:
            groups = re.compile(pattern).groups
        except re.error as err:
            raise invalid(f"is not a regular expression ({err})", "escape special characters, e.g. \\( \\)") from None
        if info.field_name == "answer_pattern" and groups != 1:
            raise invalid(f"has {groups} groups", "use exactly one (...) group around the answer")
        return pattern


class DatasetEnv:
    name = "dataset"
    Options = DatasetOptions

    def __init__(self, **options):
        self.options = DatasetOptions(**options)
        self.verifier = self.options.verifier
        self.system = self.options.system  # the system prompt of conversational prompts (data.chat)
        self._pattern = re.compile(self.options.answer_pattern, re.DOTALL) if self.options.answer_pattern else None
        self._format = re.compile(self.options.format_pattern, re.DOTALL) if self.options.format_pattern else None

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
        option = split
        path = Path(getattr(self.options, split))
        if path.is_absolute() or ".." in path.parts or not path.parts or path.parts[0] != CUSTOM_DIR:
            raise OptionError(option, f"{str(path)[:200]!r} is not inside the workspace's {CUSTOM_DIR}/ folder",
                              f"put the file in {CUSTOM_DIR}/ (a DVC dependency of every stage) and give its path "
                              f"from the workspace, e.g. {CUSTOM_DIR}/{path.name[:80]}")
        if not path.is_file():
            raise OptionError(option, f"{str(path)[:200]} not found (from {Path.cwd()})",
                              "give the path of an existing .jsonl or .parquet file, from the workspace")
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise OptionError(option, f"{path} is neither JSON lines nor Parquet", "use a .jsonl or .parquet file")
        stat = path.stat()
        table = _load(kind, str(path.resolve()), stat.st_mtime_ns, stat.st_size, option)
        columns = set(table.column_names)
        for field in ("prompt_field", "answer_field"):
            wanted = getattr(self.options, field)
            if wanted not in columns:
                raise OptionError(field, f"{path} has no field {wanted!r} (it has {sorted(columns)[:12]})",
                                  f"set data.options.{field} to the column that holds it")
        if not len(table):
            raise OptionError(option, f"{path} has no rows", "give a file with at least one row")
        completion = self.options.completion_field if self.options.completion_field in columns else None
        mapped = {self.options.prompt_field, self.options.answer_field, completion}
        rows = []
        for i, row in enumerate(table):
            prompt, answer = row[self.options.prompt_field], row[self.options.answer_field]
            if not isinstance(prompt, str) or not prompt.strip() or answer is None or not str(answer).strip():
                raise OptionError(option, f"{path} row {i + 1}: {self.options.prompt_field!r} and "
                                  f"{self.options.answer_field!r} must be non-empty", "fix or drop the row")
            target = row[completion] if completion and row[completion] is not None else str(answer)
            extra = {k: v for k, v in row.items() if k not in mapped and k not in ("prompt", "completion", "answer",
                                                                                   "messages")}
            # the file's other columns reach reward functions by name (posttrain.chat.reward_columns)
            rows.append({**extra, "prompt": prompt, "completion": str(target), "answer": str(answer).strip()})
        return rows

    def check_row(self, row: dict) -> str | None:
        """An incoming row's answer must be one this verifier can compare against."""
        answer = row["answer"].strip()
        if self.verifier == "numeric" and not _finite(answer):
            return f"answer {answer[:80]!r} is not a number (numeric verifier)"
        if self.verifier == "choice" and (len(answer) != 1 or answer.upper() not in self.options.choices):
            return f"answer {answer[:80]!r} is not one of {self.options.choices} (choice verifier)"
        return None

    # --- judging a completion ----------------------------------------------------------
    def extract(self, completion: str) -> str | None:
        """The answer part of a completion: `answer_pattern`'s group (None when it does
        not match), else the whole completion, stripped."""
        completion = completion[:MAX_ANSWER_CHARS]
        if self._pattern is None:
            return completion.strip()
        match = self._pattern.search(completion)
        return match.group(1).strip() if match else None

    def format_ok(self, completion: str) -> bool:
        """The `format` reward: `format_pattern` matches the whole completion; without
        one, `answer_pattern` finds the answer."""
        if self._format is not None:
            return self._format.fullmatch(completion[:MAX_ANSWER_CHARS].strip()) is not None
        return self.parse(completion) is not None

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
            parsed = _math_parse(text)
            return str(parsed[1] if len(parsed) > 1 else parsed[0]) if parsed else None
        return text

    def verify(self, completion: str, answer: str) -> bool:
        if self.verifier == "math":
            text = self.extract(completion)
            return bool(text) and _math_verify(answer, text)
        parsed = self.parse(completion)
        if parsed is None:
            return False
        if self.verifier == "numeric":
            return _finite(answer) and math.isclose(float(parsed), float(answer.strip().replace(",", "")),
                                                    rel_tol=self.options.tolerance, abs_tol=self.options.tolerance)
        if self.verifier == "choice":
            return parsed == answer.strip().upper()
        if self.verifier == "regex":  # the `regex` module: a time limit on backtracking over model output
            try:
                return regex.fullmatch(answer, parsed, timeout=REGEX_TIMEOUT_S) is not None
            except (regex.error, TimeoutError):
                return False
        return parsed == answer.strip()


def _finite(text: str) -> bool:
    """A plain number (commas as thousands separators allowed) that is finite as a float."""
    text = text.strip().replace(",", "")
    return bool(_NUMBER.fullmatch(text)) and math.isfinite(float(text))


@functools.lru_cache(maxsize=8)
def _load(kind: str, path: str, mtime_ns: int, size: int, option: str):
    """The file as a `datasets` table; read once per process while it is unchanged (the
    config check and the stage both build the environment)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train", keep_in_memory=True)
    except Exception as err:  # the library's own reason, as one line
        raise OptionError(option, f"{path} cannot be read as {kind}: {type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]}", "fix the file (one JSON object per line)") from None


def _timeouts() -> dict:
    """math-verify bounds its work with SIGALRM, which only the main thread may set."""
    on_main = threading.current_thread() is threading.main_thread()
    return {} if on_main else {"parsing_timeout": None}


def _math_parse(text: str) -> list:
    from math_verify import parse

    return parse(text, **_timeouts())


@functools.lru_cache(maxsize=65536)
def _math_gold(answer: str) -> tuple:
    """A reference answer parsed once: every sample of a prompt is verified against it."""
    return tuple(_math_parse(answer if "$" in answer or "\\" in answer else f"${answer}$"))


def _math_verify(answer: str, text: str) -> bool:
    from math_verify import verify

    gold = list(_math_gold(answer))
    guess = _math_parse(text)
    if not gold or not guess:
        return False
    options = {} if threading.current_thread() is threading.main_thread() else {"timeout_seconds": None}
    return bool(verify(gold, guess, **options))
