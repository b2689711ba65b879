"""Hostile `incoming/` contents (issue 12): `posttrain run` refuses each in one line,
before the flow starts, with a good batch beside it left unversioned."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from conftest import SMALL, make_workspace
from hardening import assert_nothing_left, assert_refused, cli, state
from flows.lock import lock
from posttrain.layout import PARAMS_FILE
from posttrain.config import load_config

GOOD = json.dumps({"prompt": "12+3=", "answer": "15"}) + "\n"
DIGITS = "1" * 5000  # past Python's int-string limit (4300 digits)
BIG_NUMBER = f'{{"prompt": "2+3=", "answer": "5", "n": {DIGITS}}}\n'
BIG_PROMPT = json.dumps({"prompt": f"{DIGITS}+1=", "answer": "2"}) + "\n"
BIG_COMPLETION = json.dumps({"prompt": "2+3=", "answer": "5", "completion": DIGITS}) + "\n"
LONG_LINE = '{"prompt": "' + "9" * 2**21 + '"}\n' + GOOD


def write(name: str, text: str | bytes):
    def make(incoming):
        (incoming / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return make


def folder(name: str):
    def make(incoming):
        (incoming / name).mkdir()
        (incoming / name / "rows.jsonl").write_text(GOOD)
    return make


def fifo(incoming):
    os.mkfifo(incoming / "x.jsonl")


def link(target: str):
    def make(incoming):
        (incoming.parent / "outside.jsonl").write_text(GOOD)
        if target == "pipe":
            os.mkfifo(incoming.parent / "pipe")
        (incoming / "x.jsonl").symlink_to(incoming.parent / target)
    return make


def incoming_is_a_file(incoming):
    shutil.rmtree(incoming)
    incoming.write_text(GOOD)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    ws = make_workspace(tmp_path_factory.mktemp("ingest") / "ws", SMALL)
    with lock(ws, log=lambda _: None):  # the lock file every run leaves behind
        pass
    load_config(ws / PARAMS_FILE)  # imports TRL's config classes (seconds): timed here, not in the first case
    return ws


@pytest.fixture
def incoming(ws):
    def clear():
        path = ws / "incoming"
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        for extra in ("outside.jsonl", "pipe"):
            (ws.parent / extra).unlink(missing_ok=True)
    clear()
    (ws / "incoming").mkdir()
    yield ws / "incoming"
    clear()


def _hang(signum, frame):
    raise TimeoutError("posttrain run hung on incoming/")


# each case: what is put in incoming/ (beside a good batch), and what the one error line must name
@pytest.mark.parametrize("make, needles", [
    (write("x.jsonl", BIG_NUMBER), ["x.jsonl:1", "integer string conversion"]),  # json's int()
    (write("x.jsonl", BIG_PROMPT), ["x.jsonl:1", "cannot read this row"]),  # the env's own check's int()
    (write("x.jsonl", BIG_COMPLETION), ["x.jsonl:1", "cannot read this row"]),  # the env parser's int()
    (folder("x.jsonl"), ["x.jsonl", "is a folder", "move its *.jsonl files up"]),  # a folder named *.jsonl
    (fifo, ["x.jsonl", "is a FIFO", "not opened"]),  # opening it would hang the lock holder
    (write("rows.json", GOOD), ["rows.json", "rename it to .jsonl"]),  # valid rows, wrong suffix
    (folder("more"), ["more", "subfolders are not read"]),  # valid rows one level down
    (write("notes.txt", "hi\n"), ["notes.txt", "not a *.jsonl batch"]),  # anything else is said too
    (link("outside.jsonl"), ["x.jsonl", "symbolic link", "copy the file itself"]),  # to a good file
    (link("pipe"), ["x.jsonl", "symbolic link"]),  # never followed to a FIFO
    (link("nowhere"), ["x.jsonl", "symbolic link"]),  # dangling
    (write("x.jsonl", b'{"prompt": "2+3=", "answer": "\xff"}\n'), ["x.jsonl:1", "not UTF-8"]),  # Latin-1
    (write("x.jsonl", bytes(range(256)) * 4), ["x.jsonl:1", "not UTF-8"]),  # binary
    (write("x.jsonl", "prompt,answer\n2+3=,5\n"), ["x.jsonl:1", "not JSON", "x.jsonl:2"]),  # a CSV
    (write("x.jsonl", LONG_LINE), ["x.jsonl:1", "longer than 1 MiB"]),  # 2 MiB row, refused unparsed
    (write("x.jsonl", "[" * 10**5 + "]" * 10**5), ["x.jsonl:1", "nested too deeply"]),  # RecursionError
    (write("a\nb.jsonl", "[]\n"), ["a\\nb.jsonl:1", "not a JSON object"]),  # a name that breaks lines
    (write("x.jsonl", "\n\n"), ["x.jsonl", "empty file"]),  # blank lines only
    (incoming_is_a_file, ["incoming", "is not a folder"]),  # a file where the folder should be
])
def test_bad_incoming_is_refused_before_the_flow(ws, incoming, make, needles):
    if incoming.is_dir():
        (incoming / "good.jsonl").write_text(GOOD)  # a good batch beside it must not be versioned either
    make(incoming)
    before = state(ws)
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(30)
    try:
        done = cli("run", "--workdir", ws, cwd=ws)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert_refused(done, *needles)
    assert_nothing_left(ws, before)


def test_bad_incoming_is_refused_before_trl_is_imported(ws, incoming):
    """Cheap checks first (issue 25: a bad file was refused after 31-51 s, behind the TRL
    config check): the run process refuses the rows without importing TRL or torch, and
    leaves nothing behind. Bounded by what it imports, not by seconds."""
    from hardening import cli_process

    (incoming / "x.jsonl").write_text("prompt,answer\n2+3=,5\n")
    before = state(ws)
    done = cli_process("run", "--workdir", ws, cwd=ws, env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=600)
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    refusal = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and len(refusal) == 1 and "x.jsonl:1" in refusal[0], done.stderr[-2000:]
    assert "posttrain.ingest" in imported and not {"trl", "torch", "transformers"} & imported
    assert_nothing_left(ws, before)
