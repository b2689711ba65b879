"""Hostile CLI calls (issue 12): `posttrain kv` numbers and model shapes, `compare --out`,
dead or failing servers, and passwords in URIs. Each is refused in one line, in seconds,
with nothing left behind and no password in the output.

In the table, `{dead}` is a loopback port nothing listens on, `{busy}` one that answers
503 to everything (a proxy whose backend is down), `{tmp}` the test's folder (also its cwd).
A case with an environment runs as a process, as a user starts it; the others in-process.
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import threading
from pathlib import Path

import pytest

from hardening import assert_nothing_left, assert_refused, cli, cli_process, state

REPO = Path(__file__).resolve().parents[1]
PASSWORD = "S3cret-PW-9"
RUN_A, RUN_B = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"
MODEL = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
MODELS = {  # config.json files the kv cases read
    "ok.json": MODEL,
    "zero_heads.json": {**MODEL, "num_attention_heads": 0},
    "no_heads.json": {k: v for k, v in MODEL.items() if k != "num_attention_heads"},
    "negative_heads.json": {**MODEL, "num_attention_heads": -4},
    "odd_kv.json": {**MODEL, "num_key_value_heads": 3},
    "nan_layers.json": {**MODEL, "num_hidden_layers": float("nan")},
    "gqa_12_4.json": {**MODEL, "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 768},
    "list.json": [1, 2],
}
SECRET = f"http://user:{PASSWORD}@127.0.0.1"
NO_SERVERS = {"MLFLOW_TRACKING_URI": "", "PREFECT_API_URL": ""}

CASES = [
    (["kv", "ok.json", "--kv-memory-gib", "nan"], None, ["--kv-memory-gib", "nan"]),                # NaN size
    (["kv", "ok.json", "--kv-memory-gib", "inf"], None, ["--kv-memory-gib", "inf"]),                # infinite size
    (["kv", "ok.json", "--kv-memory-gib", "1e300"], None, ["--kv-memory-gib"]),                     # size past float range in bytes
    (["kv", "ok.json", "--gpu-memory-utilization", "nan"], None, ["--gpu-memory-utilization"]),     # NaN fraction
    (["kv", "ok.json", "--gpu-memory-utilization", "0"], None, ["--gpu-memory-utilization"]),       # 0: no memory at all
    (["kv", "ok.json", "--gpu-memory-utilization", "1.5"], None, ["--gpu-memory-utilization"]),     # above 1
    (["kv", "ok.json", "--context", "99999999999999999999"], None, ["--context"]),                  # beyond any model
    (["kv", "zero_heads.json"], None, ["zero_heads.json", "num_attention_heads"]),                   # 0 heads (was ZeroDivisionError)
    (["kv", "no_heads.json"], None, ["no_heads.json", "num_attention_heads"]),                       # heads missing
    (["kv", "negative_heads.json"], None, ["negative_heads.json", "num_attention_heads"]),           # negative heads
    (["kv", "odd_kv.json"], None, ["odd_kv.json", "num_key_value_heads"]),                           # 3 KV heads for 4 heads
    (["kv", "nan_layers.json"], None, ["nan_layers.json", "num_hidden_layers"]),                     # NaN in the JSON
    (["kv", "list.json"], None, ["list.json", "not a JSON object"]),                                 # not an object
    (["kv", "ok.json", "--tp", "3"], None, ["--tp 3", "[1, 2, 4]"]),                                 # 3 does not divide 4 heads
    (["kv", "gqa_12_4.json", "--tp", "6"], None, ["--tp 6", "[1, 2, 4, 12]"]),                       # divides 12 heads, not 4 KV heads
    (["compare", RUN_A, RUN_B, "--out", "/proc/compare.png"], None, ["--out", "cannot write"]),      # unwritable folder
    (["compare", RUN_A, RUN_B, "--out", "/proc/new/compare.png"], None, ["--out", "cannot write"]),  # missing folder in an unwritable one
    (["compare", RUN_A, RUN_B, "--out", "{tmp}/ok.json/compare.png"], None, ["--out", "not a folder"]),  # a file in the way
    (["compare", RUN_A, RUN_B, "--out", "{tmp}/configs"], None, ["--out", "not an image"]),          # no image suffix
    (["compare", RUN_A, RUN_B, "--out", "{tmp}/plots.png"], None, ["--out", "is a folder"]),         # a folder
    (["compare", RUN_A, RUN_B, "--out", "{tmp}/plot.png"], None, ["no MLflow store"]),               # writable: the next check speaks
    (["run", "--config", "configs/pipeline.yaml"], {"MLFLOW_TRACKING_URI": SECRET + ":{dead}"},
     ["MLFLOW_TRACKING_URI", "user:***@", "refused"]),                                               # dead MLflow, password in URI
    (["run", "--config", "configs/pipeline.yaml"], {"PREFECT_API_URL": "http://127.0.0.1:{dead}/api"},
     ["PREFECT_API_URL", "prefect server start"]),                                                   # dead Prefect API
    (["run", "--config", "configs/pipeline.yaml"], {"MLFLOW_TRACKING_URI": "postgresql://u:" + PASSWORD
                                                    + "@127.0.0.1:{dead}/mlflow"}, ["postgresql://u:***@"]),  # dead database
    (["run", "--config", "configs/pipeline.yaml"], {"MLFLOW_TRACKING_URI": SECRET + ":{busy}"}, ["HTTP 503"]),  # proxy, backend down
    (["compare", RUN_A, RUN_B], {"MLFLOW_TRACKING_URI": SECRET + ":{dead}"}, ["compare", "user:***@"]),  # not "no such run"
    (["compare", RUN_A, RUN_B, "--tracking-uri", "https://127.0.0.1:{dead}"], {}, ["--tracking-uri"]),  # dead, named by flag
    (["replay", RUN_A], {"MLFLOW_TRACKING_URI": SECRET + ":{dead}"}, ["replay", "user:***@"]),        # not "no such run"
    (["serve", "--workdir", "ws"], {"PREFECT_API_URL": "http://127.0.0.1:{dead}/api"}, ["serve", "PREFECT_API_URL"]),  # dead API
]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answering(status: int):
    """A loopback HTTP server answering `status` to every request, in a thread."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the name http.server calls)
            self.send_response(status)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def ports():
    busy, lost = answering(503), answering(404)
    yield {"dead": closed_port(), "busy": busy.server_address[1], "lost": lost.server_address[1]}
    busy.shutdown()
    lost.shutdown()


@pytest.fixture
def here(tmp_path):
    """A folder with model configs, a copy of configs/ and a workspace `ws`."""
    for name, config in MODELS.items():
        (tmp_path / name).write_text(json.dumps(config))
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "plots.png").mkdir()
    (tmp_path / "ws" / "configs").mkdir(parents=True)
    (tmp_path / "ws" / "dvc.yaml").write_text("stages: {}\n")
    shutil.copy(REPO / "configs" / "pipeline.yaml", tmp_path / "ws" / "configs")
    return tmp_path


@pytest.mark.parametrize("args,env,needles", CASES)
def test_refused_in_one_line(args, env, needles, here, ports):
    fill = {**ports, "tmp": here}
    args = [a.format(**fill) for a in args]
    before = state(here)
    if env is None:
        done = cli(*args, cwd=here, env=NO_SERVERS)
    else:
        done = cli_process(*args, cwd=here, env={**NO_SERVERS, **{k: v.format(**fill) for k, v in env.items()}})
    assert_refused(done, *needles, secrets=(PASSWORD,))
    assert "no such run" not in done.stderr
    assert_nothing_left(here, before)


@pytest.mark.parametrize("text,expected", [
    ("at http://u:pw@h:5/api failed", "at http://u:***@h:5/api failed"),               # URI password
    ("postgresql+psycopg2://u:p@ss@h/db", "postgresql+psycopg2://u:***@h/db"),          # '@' inside the password
    ("http://h:5000/api and user@example.com", "http://h:5000/api and user@example.com"),  # no userinfo: unchanged
    ("token tok-123456 sent", "token *** sent"),                                        # MLFLOW_TRACKING_TOKEN's value
    ("decoded p@ss:word here", "decoded *** here"),                                     # the env URI's password, decoded
])
def test_redact_text(text, expected, monkeypatch):
    from posttrain.redact import redact_text

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-123456")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://u:p%40ss%3Aword@h:5000")
    assert redact_text(text) == expected


def test_every_refusal_is_redacted(monkeypatch):
    """A library error quoting a URI whole still prints without its password."""
    import posttrain.cli
    from posttrain.errors import UserError

    def fails(args):
        raise UserError("store", f"failed at {SECRET}:5000/api", "retry")

    monkeypatch.setattr(posttrain.cli, "dispatch", fails)
    done = cli("check", "--config", "x.yaml")
    assert_refused(done, "user:***@127.0.0.1:5000", secrets=(PASSWORD,))


def test_a_failing_store_is_not_no_such_run(ports):
    """A server that answers but is not MLflow (404 to everything): the store failed, the
    run may well exist; the message carries no password."""
    from mlflow import MlflowClient

    from posttrain.tracking.compare import get_run
    from posttrain.errors import UserError

    with pytest.raises(UserError, match="tracking store failed") as err:
        get_run(MlflowClient(f"{SECRET}:{ports['lost']}"), RUN_A, "posttrain replay", "fix")
    assert PASSWORD not in str(err.value) and "no such run" not in str(err.value)


@pytest.mark.parametrize("port,problem", [
    ("dead", "refused"),      # nothing listens
    ("busy", "HTTP 503"),     # a proxy whose backend is down: MLflow would retry for minutes
    ("lost", None),           # answers: a server is there (its routes are its business)
])
def test_http_probe(port, problem, ports):
    from posttrain.probe import http_problem

    found = http_problem(f"http://user:{PASSWORD}@127.0.0.1:{ports[port]}/health", timeout=2)
    assert (found is None) if problem is None else (problem in found.lower() or problem in found)
