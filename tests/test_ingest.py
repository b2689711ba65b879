"""New data: row checks, all-or-nothing versioning in a real git + DVC workspace."""

import json
import subprocess

import pytest

from conftest import sh
from posttrain import ingest
from posttrain.envs import get_env
from posttrain.errors import UserError
from posttrain.stages.prepare import add_rows

ENV = get_env("arithmetic")
HELDOUT = {"1+1="}


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "2+3=", "answer": "5"}, None),                                   # completion defaults to answer
    ({"prompt": "2+3=", "answer": "5", "completion": "5"}, None),                # explicit completion
    ({"prompt": "7*6=", "answer": "42"}, None),                                  # any op the env knows
    (["2+3=", "5"], "not a JSON object"),                                        # a list
    ({"prompt": "2+3="}, "`answer` must be a non-empty string"),                 # answer missing
    ({"prompt": "", "answer": "5"}, "`prompt` must be a non-empty string"),       # empty prompt
    ({"prompt": "2+3=", "answer": 5}, "`answer` must be a non-empty string"),    # a number, not text
    ({"prompt": "2+3=", "answer": "5", "completion": "= 5"}, "does not parse"),  # breaks the format contract
    ({"prompt": "2+3=", "answer": "6"}, "answer '6' is wrong: 2+3=5"),           # false fact
    ({"prompt": "two plus three", "answer": "5"}, "is not of the form"),         # not an arithmetic prompt
    ({"prompt": "1+1=", "answer": "2"}, "held-out split"),                       # would leak held-out truth
    ({"prompt": "01+1=", "answer": "2"}, "is not of the form"),                  # not canonical: dodges held-out
    ({"prompt": "1+1=\n", "answer": "2"}, "is not of the form"),                 # trailing newline, likewise
])
def test_check_row(row, problem):
    found = ingest.check_row(ENV, row, HELDOUT)
    assert found is None if problem is None else problem in found


def test_bad_rows_are_named_by_file_and_line(tmp_path):
    (tmp_path / "incoming").mkdir()
    (tmp_path / "incoming" / "a.jsonl").write_text('{"prompt": "2+3=", "answer": "5"}\n\n{"prompt": "2+3=", "answer": "9"}\n')
    (tmp_path / "incoming" / "b.jsonl").write_text("{not json\n")
    with pytest.raises(UserError) as err:
        ingest.validate(tmp_path, ENV, HELDOUT)
    text = str(err.value)
    assert "2 bad row(s), nothing versioned" in text
    assert "a.jsonl:3: answer '9' is wrong" in text and "b.jsonl:1: not JSON" in text
    assert "\n" not in text


def test_prepare_appends_new_prompts_only():
    splits = {"train": [{"prompt": "1+2=", "answer": "3"}], "heldout": [{"prompt": "1+1=", "answer": "2"}]}
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1+1=", "answer": "2"},
            {"prompt": "9+9=", "answer": "18"}, {"prompt": "9+9=", "answer": "18"}]
    assert add_rows(splits, rows) == 1
    assert [r["prompt"] for r in splits["train"]] == ["1+2=", "9+9="]


def _commits(ws):
    return subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=ws, capture_output=True, text=True).stdout.strip()


def test_a_good_batch_becomes_a_dvc_version_and_a_bad_one_nothing(small_workspace):
    ws = small_workspace
    incoming = ws / "incoming"
    incoming.mkdir()
    before = _commits(ws)
    (incoming / "bad.jsonl").write_text(json.dumps({"prompt": "12+2=", "answer": "15"}) + "\n")
    (incoming / "good.jsonl").write_text(json.dumps({"prompt": "12+3=", "answer": "15"}) + "\n")
    with pytest.raises(UserError, match="bad.jsonl:1"):
        ingest.version_incoming(ws, ENV, HELDOUT)
    assert _commits(ws) == before and not list((ws / "datasets").glob("*.jsonl*"))
    assert sorted(p.name for p in incoming.iterdir()) == ["bad.jsonl", "good.jsonl"]

    (incoming / "bad.jsonl").unlink()
    (ws / "notes.txt").write_text("the user's own staged work\n")
    sh("git", "add", "notes.txt", cwd=ws)
    added = ingest.version_incoming(ws, ENV, HELDOUT, dvc=str(sh("which", "dvc", cwd=ws).stdout.strip()))
    assert "notes.txt" not in sh("git", "show", "--stat", "HEAD", cwd=ws).stdout     # not swept into the data commit
    assert "A  notes.txt" in sh("git", "status", "--short", cwd=ws).stdout          # still staged, as it was
    sh("git", "reset", "-q", "notes.txt", cwd=ws)
    (ws / "notes.txt").unlink()
    assert len(added) == 1 and added[0].endswith("-good.jsonl")
    assert int(_commits(ws)) == int(before) + 1 and not list(incoming.iterdir())
    assert (ws / (added[0] + ".dvc")).is_file()
    tracked = sh("git", "ls-files", "datasets", cwd=ws).stdout.split()
    assert added[0] + ".dvc" in tracked and added[0] not in tracked       # DVC holds the data, git its hash
    assert "nothing to commit" in sh("git", "status", cwd=ws).stdout
    assert ingest.extra_rows(ws / "datasets") == [{"answer": "15", "completion": "15", "prompt": "12+3="}]

    (ws / added[0]).unlink()
    with pytest.raises(UserError, match="dvc pull datasets"):
        ingest.extra_rows(ws / "datasets")


def test_cli_refuses_bad_incoming_data_before_any_compute(small_workspace):
    (small_workspace / "incoming").mkdir()
    (small_workspace / "incoming" / "x.jsonl").write_text('{"prompt": "12+3=", "answer": "16"}\n')
    done = sh("posttrain", "run", "--workdir", small_workspace, cwd=small_workspace, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "x.jsonl:1: answer '16' is wrong" in done.stderr and "Traceback" not in done.stderr
    assert not (small_workspace / "data").exists() and not (small_workspace / "mlflow.db").exists()


def test_versioned_batches_are_not_pipeline_stages(small_workspace):
    from tasks.dvc_stages import stage_order

    (small_workspace / "incoming").mkdir()
    (small_workspace / "incoming" / "b.jsonl").write_text(json.dumps({"prompt": "12+3=", "answer": "15"}) + "\n")
    ingest.version_incoming(small_workspace, ENV, HELDOUT, dvc=str(sh("which", "dvc", cwd=small_workspace).stdout.strip()))
    names = [s["name"] for s in stage_order.fn(str(small_workspace))]
    assert names == ["prepare", "sft", "grpo@dense", "serving", "evaluate"]


def test_pending_lists_batches_and_skips_hidden_copies_in_progress(tmp_path):
    (tmp_path / "incoming").mkdir()
    for name in ("b.jsonl", "a.jsonl", ".a.jsonl.Xy12Zq", ".gitkeep"):  # rsync's temporary, a marker
        (tmp_path / "incoming" / name).write_text("{}\n")
    assert [p.name for p in ingest.pending(tmp_path)] == ["a.jsonl", "b.jsonl"]
    (tmp_path / "incoming" / "c.json").write_text("{}\n")
    (tmp_path / "incoming" / "d").mkdir()
    with pytest.raises(UserError, match=r"c.json: is a .json file.*nothing versioned \(nor read: d\)"):
        ingest.pending(tmp_path)


def test_a_fifo_swapped_in_after_the_listing_is_not_opened(tmp_path):
    import os
    import signal

    os.mkfifo(tmp_path / "x.jsonl")
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("read_batch blocked opening a FIFO"))
    signal.alarm(10)
    try:
        found = ingest.read_batch(tmp_path / "x.jsonl", ENV, HELDOUT)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert found == ([], [f"{tmp_path / 'x.jsonl'}: not a regular file"])


def test_lines_after_a_too_long_line_keep_their_numbers(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "' + "9" * (ingest.MAX_LINE_BYTES + 10) + '"}\n{"prompt": "2+3=", "answer": "5"}\n'
                    '{"prompt": "2+3=", "answer": "6"}\n')
    rows, errors = ingest.read_batch(path, ENV, HELDOUT)
    assert [r["prompt"] for r in rows] == ["2+3="]
    assert [e.split(": ", 1)[0] for e in errors] == [f"{path}:1", f"{path}:3"] and "longer than 1 MiB" in errors[0]


def test_a_long_reason_is_cut_to_one_short_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"prompt": "2+3=", "answer": "5", "completion": "x\n" * 50_000}) + "\n")
    [error] = ingest.read_batch(path, ENV, HELDOUT)[1]
    assert len(error) < len(str(path)) + 300 and "\n" not in error and "chars)..." in error


def test_100k_lines_are_validated_once_each(tmp_path):
    """Validation is one pass: each row is checked once by the environment (1,000,000 lines took
    about 4 s where issue 12 measured it), whatever the file's size."""
    env = get_env("arithmetic", operand_max=999)
    (tmp_path / "incoming").mkdir()
    with open(tmp_path / "incoming" / "big.jsonl", "w") as fh:
        fh.writelines(json.dumps({"prompt": f"{i % 1000}+{i // 1000}=", "answer": str(i % 1000 + i // 1000)}) + "\n"
                      for i in range(100_000))
    calls = []
    own = env.check_row
    env.check_row = lambda row: calls.append(1) or own(row)
    batches = ingest.validate(tmp_path, env, set())
    assert len(batches[tmp_path / "incoming" / "big.jsonl"]) == 100_000 and len(calls) == 100_000
