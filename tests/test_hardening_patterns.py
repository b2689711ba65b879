"""The `dataset` environment against hostile patterns, answers and files (issue 25).

- A user pattern (`answer_pattern`, `format_pattern`, a `regex` reference answer) runs
  with the `regex` module's per-match time limit: over it, the completion scores as
  unparseable and is counted, never a hang; `posttrain check` refuses a pattern that runs
  past it on an SFT target, and one whose counted repeats would take minutes to compile.
- math-verify runs in a worker process killed at its limit, on any thread; text nested too
  deeply is not sent; a reference answer too large or deep is refused at check.
- A data file that is not UTF-8 JSON lines of objects, or not Parquet, is refused in one
  line naming the file and line; reading one leaves no cache in the user's home.
- A GRPO stage whose completions make its answer_pattern backtrack finishes, and its
  metrics count the timed-out matches.

Hang guards: SIGALRM / `timeout=` far above what a case needs (the product's own limits
end the work); the assertions count work (matches run, rows read), not seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading

import pytest
import yaml

from conftest import REPO, SMALL, make_workspace, sh
from flows.lock import lock
from hardening import assert_nothing_left, assert_refused, cli, cli_process, state
from posttrain.envs import get_env
from posttrain.errors import OptionError, UserError

HANG_GUARD_S = 300
OPTIONS = {"train": "custom/train.jsonl", "heldout": "custom/heldout.jsonl", "verifier": "exact"}
# digits match at once; anything else tries 3^n ways of reading itself before failing
BACKTRACKS = r"^(?:(\d+)$|(?:.|.|.)*(?!))"
NESTED = "$" + "\\frac{1}{" * 60 + "2" + "}" * 60 + "$"      # 60 deep: past MAX_LATEX_DEPTH
TOWER = "$9^{9^{9^{9}}}$"                                    # sympy would compute 370 million digits


def sums(start: int, count: int) -> list[dict]:
    return [{"prompt": f"{i // 10}+{i % 10}+{start}=", "answer": str(i // 10 + i % 10 + start),
             "completion": str(i // 10 + i % 10 + start)} for i in range(count)]


def write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """custom/train.jsonl (60 rows) and custom/heldout.jsonl (20), the current folder."""
    write_jsonl(tmp_path / "custom" / "train.jsonl", sums(0, 60))
    write_jsonl(tmp_path / "custom" / "heldout.jsonl", sums(100, 20))
    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def variant(project, **options):
    """configs/v.yaml: the shipped pipeline on the dataset environment with `options`."""
    path = project / "configs" / "v.yaml"
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "sft": {"stop_when": None},
                                    "data": {"env": "dataset", "options": {**OPTIONS, **options}}}))
    return path


@contextlib.contextmanager
def hang_guard():
    def hung(signum, frame):
        raise TimeoutError("no time limit ended the work")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_GUARD_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def assert_check_and_run_refuse(project, path, *needles):
    """`check` and `run` each refuse in one line naming the config and the needles, and
    leave the project as it was."""
    before = state(project)
    for command in (["check"], ["run", "--workdir", project / "ws"]):
        with hang_guard():
            done = cli(*command, "--config", path, cwd=project)
        assert_refused(done, str(path), *needles)
    assert_nothing_left(project, before)


# --- user patterns at the check ------------------------------------------------------------
# (options, the SFT target and answer of line 3 of the training file, what the line names)
PATTERN_CASES = [
    ({"answer_pattern": r"^(a|aa)+$"}, "a" * 40 + "b", "42",
     ["data.options.answer_pattern", "custom/train.jsonl line 3", "0.1 s time limit", "(a+)+"]),  # overlapping
    ({"answer_pattern": r"^(.*?,){11}P"}, "1," * 30, "42",
     ["data.options.answer_pattern", "line 3", "time limit"]),                     # counted lazy groups: polynomial
    ({"format_pattern": r"^([a-z]|[a-z0-9])+$"}, "a" * 40 + "-", "42",
     ["data.options.format_pattern", "line 3", "time limit"]),                     # the format reward's pattern
    ({"verifier": "regex"}, "a" * 40 + "b", r"^(a|aa)+$",
     ["data.options.answer_field", "line 3", "reference regex '^(a|aa)+$'"]),     # a reference regex of the data
    ({"answer_pattern": "a{4294967294}(x)"}, None, None,
     ["data.options.answer_pattern", "repeats up to 4294967294 times", "under 1000"]),  # regex would never compile it
    ({"answer_pattern": "(a{1000}){1000}"}, None, None,
     ["data.options.answer_pattern", "1000000 in all"]),                           # nested counts multiply
    ({"verifier": "regex"}, "aaa", "a{99999999}",
     ["data.options.answer_field", "line 3", "repeats up to 99999999 times"]),   # a reference that never compiles
    ({"answer_pattern": "(" * 499 + "a"}, None, None,
     ["data.options.answer_pattern", "not a regular expression"]),                # recursion in the compiler
    ({"answer_pattern": r"(\p{Nonesuch})"}, None, None,
     ["data.options.answer_pattern", "unknown property"]),                         # the regex module's own syntax error
]


@pytest.mark.parametrize("options, target, answer, needles", PATTERN_CASES)
def test_a_pattern_that_cannot_run_in_time_is_refused_at_check(project, options, target, answer, needles):
    if target is not None:
        rows = sums(0, 60)
        rows[2] = {**rows[2], "completion": target, "answer": answer}
        write_jsonl(project / "custom" / "train.jsonl", rows)
    assert_check_and_run_refuse(project, variant(project, **options), *needles)


@pytest.mark.parametrize("options, target", [
    ({"answer_pattern": r"^(a|aa)+$"}, "a" * 40 + "b"),            # every target backtracks: the first ends it
    ({"format_pattern": BACKTRACKS}, "not digits, 3^25 ways"),     # the format pattern, likewise
])
def test_the_check_stops_at_the_first_target_over_the_limit(project, options, target):
    """200 hostile targets: one match runs into the limit, then the check refuses."""
    write_jsonl(project / "custom" / "train.jsonl", [{**r, "completion": target} for r in sums(0, 200)])
    env = get_env("dataset", **{**OPTIONS, **options})
    with hang_guard(), pytest.raises(OptionError) as err:
        env.generate(0)
    assert "line 1:" in err.value.problem
    assert sum(env.timeouts.values()) == 1


def test_the_sft_format_contract_stops_at_the_first_target_over_a_limit(project):
    """SFT's own check (rows prepared, incoming batches included) ends at the first target a
    limit cuts: a pattern's, or math-verify's."""
    from posttrain.scoring.evaluation import check_format_contract

    rows = [{"prompt": f"p{i}", "completion": "a" * 40 + "b", "answer": "1"} for i in range(200)]
    env = get_env("dataset", **{**OPTIONS, "answer_pattern": r"^(a|aa)+$"})
    with hang_guard(), pytest.raises(UserError) as err:
        check_format_contract(env, rows, where="data/train.jsonl")
    assert str(err.value).startswith("data.options.answer_pattern: data/train.jsonl row 1:")
    assert sum(env.timeouts.values()) == 1
    math_env = get_env("dataset", **{**OPTIONS, "verifier": "math"})
    rows = [{"prompt": f"p{i}", "completion": NESTED, "answer": "2"} for i in range(200)]
    with hang_guard(), pytest.raises(UserError) as err:
        check_format_contract(math_env, rows, where="data/train.jsonl")
    assert str(err.value).startswith("data/train.jsonl row 1: verifying the SFT target '$\\\\frac{1}")
    assert math_env.timeout_counts() == {"pattern_timeouts": 0, "math_timeouts": 1}


# --- user patterns on model output ----------------------------------------------------------
# (options, completions): every completion backtracks; each channel scores it unparseable
OUTPUT_CASES = [
    ({"answer_pattern": BACKTRACKS}, ["x" * 30, "y" * 50, "#" * 9000]),                     # the answer pattern
    ({"answer_pattern": BACKTRACKS, "format_pattern": r"^([a-z]|[a-z0-9])+$"}, ["a" * 60 + "-"]),  # both
    ({"answer_pattern": r"^(a|aa)+$", "verifier": "numeric"}, ["a" * 45 + "!", "a" * 60 + "?"]),  # another verifier
]


@pytest.mark.parametrize("options, completions", OUTPUT_CASES)
def test_model_output_that_backtracks_scores_unparseable_and_is_counted(project, options, completions):
    from posttrain.scoring.rewards import build_rewards

    env = get_env("dataset", **{**OPTIONS, **options})
    funcs, _ = build_rewards(env, {"correctness": 1.0, "parseable": 1.0, "format": 1.0}, guardrails=["unparseable"])
    answers = ["1"] * len(completions)
    with hang_guard():
        scores = [f(completions, answer=answers) for f in funcs]
    assert scores == [[0.0] * len(completions)] * 3
    # four channels (guardrail included) read each completion: each text runs into the limit once per pattern
    assert env.timeout_counts()["pattern_timeouts"] == len(completions) * (1 + ("format_pattern" in options))


# --- math-verify ----------------------------------------------------------------------------
# (answer, completion): math-verify would run for minutes, or the text is too deep to send
MATH_CASES = [
    ("2", TOWER),                                  # one C-level power: SIGALRM cannot stop it, the kill does
    ("2", NESTED),                                 # 60 deep: not sent
    ("2", "\\boxed{" * 2_000_000),                 # 16 MB: cut at 10,000 characters, still 10,000 deep
    (TOWER, "\\boxed{2}"),                         # the reference itself stalls
]


@pytest.mark.parametrize("on_main_thread", [True, False])   # a Prefect task runs in a worker thread
@pytest.mark.parametrize("answer, completion", MATH_CASES)
def test_math_verify_ends_in_its_limit_on_any_thread(project, answer, completion, on_main_thread):
    env = get_env("dataset", **{**OPTIONS, "verifier": "math"})
    verdicts = []
    judge = lambda: verdicts.append(env.verify(completion, answer))
    if on_main_thread:
        with hang_guard():
            judge()
    else:
        worker = threading.Thread(target=judge, daemon=True)
        worker.start()
        worker.join(HANG_GUARD_S)
        assert not worker.is_alive(), "math-verify hung off the main thread"
    assert verdicts == [False]
    assert env.timeout_counts() == {"pattern_timeouts": 0, "math_timeouts": 1}
    assert env.verify("\\boxed{\\frac{2}{4}}", "1/2")   # the worker, restarted after a kill, still judges


# (what the held-out file's line 2 holds, what the one line names)
MATH_DATA_CASES = [
    ({"answer": "1+" * 10_000 + "1"},
     ["data.options.answer_field", "heldout.jsonl line 2", "over math-verify's 10000"]),         # 20,001 characters
    ({"answer": NESTED}, ["data.options.answer_field", "heldout.jsonl line 2", "over 50 deep"]),
    ({"answer": "\\frac{" * 600_000}, ["data.options.heldout", "heldout.jsonl line 2", "longer than 1 MiB"]),  # 3.6 MB
]


@pytest.mark.parametrize("row, needles", MATH_DATA_CASES)
def test_a_math_answer_too_large_or_deep_is_refused_at_check(project, row, needles):
    rows = sums(100, 20)
    rows[1] = {**rows[1], **row}
    write_jsonl(project / "custom" / "heldout.jsonl", rows)
    assert_check_and_run_refuse(project, variant(project, verifier="math"), *needles)


# --- data files -------------------------------------------------------------------------------
def text(data: str | bytes):
    def make(custom):
        (custom / "train.jsonl").write_bytes(data if isinstance(data, bytes) else data.encode())
        return "custom/train.jsonl"
    return make


def parquet_of(data: bytes):
    def make(custom):
        (custom / "train.parquet").write_bytes(data)
        return "custom/train.parquet"
    return make


def link_to(target: str, name: str):
    def make(custom):
        (custom.parent / "notes.md").write_text("# notes\nnot JSON\n")
        (custom.parent / "rows.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
        (custom / name).unlink(missing_ok=True)
        (custom / name).symlink_to(custom.parent / target)
        return f"custom/{name}"
    return make


GOOD = "".join(json.dumps(r) + "\n" for r in sums(0, 5))
FILE_CASES = [
    (text(GOOD.encode() + b'{"prompt": "caf\xe9", "answer": "1"}\n'),
     ["line 6", "not UTF-8", "save the file as UTF-8"]),                            # Latin-1
    (text(GOOD + "\n[1, 2]\n"), ["line 7", "a JSON array, not a JSON object"]),     # an array row (after a blank line)
    (text(GOOD + '"just text"\n'), ["line 6", "a string, not a JSON object"]),     # a string row
    (text("prompt,answer\n1+1=,2\n"), ["line 1", "not JSON"]),                     # a CSV file
    (text(GOOD + '{"prompt": "1+1=", "answ'), ["line 6", "not JSON"]),             # cut off mid-row
    (text(bytes(range(255, -1, -1)) * 8), ["line 1", "not UTF-8"]),                # binary
    (text("\n\n"), ["has no rows"]),                                               # blank lines only
    (parquet_of(os.urandom(4096)), ["train.parquet is not a Parquet file", "magic bytes"]),  # random bytes
    (parquet_of(GOOD.encode()), ["train.parquet is not a Parquet file"]),          # JSON named .parquet
    (link_to("notes.md", "train.jsonl"), ["custom/train.jsonl line 1", "not JSON"]),  # a link to prose
    (link_to("rows.jsonl", "train.parquet"), ["custom/train.parquet is not a Parquet file"]),  # a link to JSON lines
]


@pytest.mark.parametrize("make, needles", FILE_CASES)
def test_a_bad_data_file_is_one_line_naming_file_and_line(project, make, needles):
    train = make(project / "custom")
    assert_check_and_run_refuse(project, variant(project, train=train), "data.options.train", *needles)


def test_reading_the_data_leaves_no_cache_in_the_home(project, tmp_path_factory, monkeypatch):
    """`posttrain check` as a user runs it, with the `datasets` library's cache left at its
    default (~/.cache/huggingface/datasets): nothing lands in the home, nor in the project."""
    home = tmp_path_factory.mktemp("home")
    for name in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    path = variant(project)
    before = state(project)
    done = cli_process("check", "--config", path, cwd=project, env={"HOME": str(home)}, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.relative_to(home) for p in home.rglob("*")) == []
    assert_nothing_left(project, before)


# --- incoming batches for a dataset workspace -----------------------------------------------
@pytest.fixture(scope="module")
def math_workspace(tmp_path_factory):
    project = tmp_path_factory.mktemp("math")
    write_jsonl(project / "custom" / "train.jsonl", sums(0, 60))
    write_jsonl(project / "custom" / "heldout.jsonl", sums(100, 20))
    cwd = os.getcwd()
    os.chdir(project)  # the workspace's custom/ is copied from the current folder
    try:
        ws = make_workspace(project / "ws", {**{k: v for k, v in SMALL.items() if k != "data"},
                                            "data": {"env": "dataset", "options": {**OPTIONS, "verifier": "math"}},
                                            "sft": {"stop_when": None}})
    finally:
        os.chdir(cwd)
    with lock(ws, log=lambda _: None):  # the lock file every run leaves behind
        pass
    return ws


INCOMING_CASES = [
    (b'{"prompt": "q", "answer": "2", "completion": "\\\\boxed{2}"}\n[1]\n', ["x.jsonl:2", "not a JSON object"]),
    (b'{"prompt": "caf\xe9", "answer": "2"}\n', ["x.jsonl:1", "not UTF-8"]),
    (json.dumps({"prompt": "q", "answer": "2", "completion": TOWER}).encode(), ["x.jsonl:1", "does not parse"]),
    (json.dumps({"prompt": "q", "answer": NESTED}).encode(), ["x.jsonl:1", "(dataset parser)"]),
]


@pytest.mark.parametrize("data, needles", INCOMING_CASES)
def test_bad_incoming_rows_for_a_dataset_workspace_are_one_line(math_workspace, data, needles):
    ws = math_workspace
    (ws / "incoming").mkdir(exist_ok=True)
    (ws / "incoming" / "x.jsonl").write_bytes(data)
    before = state(ws)
    try:
        with hang_guard():
            done = cli("run", "--workdir", ws, cwd=ws)
        assert_refused(done, "incoming", *needles)
        assert_nothing_left(ws, before)
    finally:
        (ws / "incoming" / "x.jsonl").unlink()


# --- a GRPO stage on output that backtracks --------------------------------------------------
@pytest.mark.slow
def test_a_grpo_stage_whose_completions_backtrack_finishes_and_counts_them(project):
    """The acceptance case: completions of at least 16 characters (min_new_tokens) that are
    not plain digits make BACKTRACKS try 3^16 ways; each match ends at its limit, the
    stage finishes, and its metrics count the timed-out matches."""
    overrides = {**{k: v for k, v in SMALL.items() if k != "data"},
                 "model": {"tiny": {**SMALL["model"]["tiny"], "max_positions": 64}},
                 "data": {"env": "dataset", "options": {**OPTIONS, "answer_pattern": BACKTRACKS}},
                 "sft": {"trl": {"num_train_epochs": 1, "per_device_train_batch_size": 16, "logging_steps": 2},
                         "stop_when": None},
                 "grpo": {"dense": {"from": "sft", "rewards": {"correctness": 1.0, "format": 0.5},
                                    "guardrails": ["unparseable"], "pass_rate_filter": {"enabled": False},
                                    "audit": "off",  # its long exploits run into the limit too: training's alone here
                                    "trl": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4,
                                            "max_completion_length": 24, "generation_kwargs": {"min_new_tokens": 16},
                                            "logging_steps": 1, "save_steps": 100}}},
                 "evaluate": {**SMALL["evaluate"], "n_samples": 2, "k": [1, 2]},
                 "gate": {"n_samples": 2, "k": 2, "tolerance": 1.0}}
    ws = make_workspace(project / "ws", overrides)
    done = sh("dvc", "repro", "grpo@dense", cwd=ws, timeout=1500)
    metrics = json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())
    assert metrics["steps"] == 2.0
    # 2 steps x 4 completions, each matched once (its verdict is remembered for the other channels);
    # the gate's completions (max_new_tokens 4) are too short to run into the limit
    assert 0 < metrics["pattern_timeouts"] <= 8, metrics
    assert metrics["math_timeouts"] == 0.0
    assert "ran past their time limits" in done.stdout
