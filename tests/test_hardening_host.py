"""Issue 25, other local users: the stage host and Prefect's temporary server as another
user, a hostile or silent client, and a kill -9 meet them; and the tests' own homes.

Real processes throughout: a host (`stagehost.hosting`, as the flow starts it), raw
clients on its socket, real `posttrain stage` commands it serves, another user's
processes (root runs them as `nobody`), Prefect's temporary server as `posttrain run`
starts it (flows/ephemeral_api.py). What a case must end in is counted (an answer line,
bytes, processes, files), never timed; `timeout=` values are hang guards only.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, closing, suppress
from pathlib import Path

import psutil
import pytest

from conftest import HOMES, SMALL, TEST_HOME, make_workspace
from posttrain.runtime import stagehost
from test_stagehost import hosted_env, posttrain

pytestmark = pytest.mark.slow  # a host imports torch, transformers and TRL; a Prefect server starts
HANG_GUARD = 300  # seconds: only ends a hang; a correct answer is a line, not a time
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # for another user: the venv's interpreter may sit in a private home
as_nobody = pytest.mark.skipif(os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                               reason="runs a process as another user: needs root and /usr/bin/python3")
BOGUS = ["stage", "prepare", "--bogus", "x"]  # a stage command that ends at once, exit 2, in one line


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    ws = make_workspace(tmp_path_factory.mktemp("host") / "ws", SMALL)
    with stagehost.hosting(str(ws), hosted_env(ws)) as name:
        yield ws, name


CONNECT_ATTEMPTS = 3000


def assert_served(ws: Path, name: str) -> None:
    """A real stage command runs in the host (not declined, not in its own process)."""
    done = posttrain(BOGUS, ws, hosted_env(ws, **{stagehost.ENV_VAR: name}))
    assert done.returncode == 2 and "did not take" not in done.stderr, done.stderr
    assert done.stderr.startswith("posttrain: error: posttrain stage prepare: unknown flag --bogus"), done.stderr


def client(name: str) -> socket.socket:
    """A connection as a stage command opens it: its connect waits while the host's listen
    backlog is full (with a timeout set, Python's connect would fail at once with EAGAIN
    instead; so it is retried, a bounded number of times)."""
    for attempt in range(CONNECT_ATTEMPTS):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(HANG_GUARD)
        try:
            conn.connect(stagehost.address(name))
            return conn
        except BlockingIOError:  # the backlog is full: the host has not accepted the others yet
            conn.close()
            time.sleep(0.01)
    raise AssertionError(f"the host accepted no connection in {CONNECT_ATTEMPTS} attempts")


def request_bytes(ws: Path, name: str) -> bytes:
    """A request as `posttrain stage prepare --bogus x` sends it, header included."""
    body = json.dumps({"argv": ["posttrain", *BOGUS], "cwd": str(ws), "env": hosted_env(ws, **{stagehost.ENV_VAR: name}),
                       "path": sys.path, "executable": sys.executable,
                       "package": stagehost.STARTED_WITH["package"]}).encode()
    return stagehost.HEADER.pack(len(body)) + body


def answer(conn: socket.socket) -> str:
    """The host's first line to `conn` ('' when it closed without one)."""
    with conn.makefile("r") as replies:
        return replies.readline().strip()


def with_argv(full: bytes, argv) -> bytes:
    """The whole request `full`, asking for `argv` instead."""
    body = json.loads(full[stagehost.HEADER.size:])
    body = json.dumps({**body, "argv": argv}).encode()
    return stagehost.HEADER.pack(len(body)) + body


STDIO = [0, 1, 2]
# what a client may send, and the host's answer ('' = closed without one); each case is
# followed by a real command the host must still serve
HOSTILE_REQUESTS = [
    # declares one byte over the cap and sends no body: answered at once, nothing read
    (lambda full: stagehost.HEADER.pack(stagehost.MAX_REQUEST + 1), STDIO,
     f"declined its request is {stagehost.MAX_REQUEST + 1} bytes, more than the {stagehost.MAX_REQUEST} a host reads"),
    # declares 4 GiB: refused from the header alone
    (lambda full: stagehost.HEADER.pack(2 ** 32 - 1), STDIO,
     f"declined its request is {2 ** 32 - 1} bytes, more than the {stagehost.MAX_REQUEST} a host reads"),
    # a body that is not JSON
    (lambda full: stagehost.HEADER.pack(9) + b"not json!", STDIO, ""),
    # JSON, but an array
    (lambda full: stagehost.HEADER.pack(6) + b"[1, 2]", STDIO, ""),
    # a whole request without its stdin, stdout and stderr
    (lambda full: full, [], "declined it did not pass its stdin, stdout and stderr"),
    # a whole request with one descriptor
    (lambda full: full, [1], "declined it did not pass its stdin, stdout and stderr"),
    # a posttrain command the flow never sends a host: only stage, check and memory run there
    (lambda full: with_argv(full, ["posttrain", "run", "--config", "x.yaml"]), STDIO,
     "declined `posttrain run --config` is not a command a host runs (only stage, check, memory)"),
    (lambda full: with_argv(full, ["posttrain", "model", "fetch"]), STDIO,
     "declined `posttrain model fetch` is not a command a host runs (only stage, check, memory)"),
    # no command at all, or not a list
    (lambda full: with_argv(full, ["posttrain"]), STDIO,
     "declined `posttrain ` is not a command a host runs (only stage, check, memory)"),
    (lambda full: with_argv(full, "stage prepare"), STDIO,
     "declined `posttrain str` is not a command a host runs (only stage, check, memory)"),
]


@pytest.mark.parametrize("payload,fds,expected", HOSTILE_REQUESTS)
def test_a_hostile_request_is_answered_and_the_host_serves_on(payload, fds, expected, hosted):
    ws, name = hosted
    with closing(client(name)) as conn:
        socket.send_fds(conn, [payload(request_bytes(ws, name))], fds)
        assert answer(conn) == expected
    assert_served(ws, name)


# clients that connect and then stall; each holds its connection while a real command runs
STALLED = [
    (1, b""),                              # connects, sends nothing
    (1, b"\0\0"),                          # half a header
    (1, "half"),                           # the header and half the request, with its descriptors
    (20, b""),                             # more silent clients than the listen backlog (16)
]


@pytest.mark.parametrize("count,sent", STALLED)
def test_stalled_clients_hold_up_no_other(count, sent, hosted):
    ws, name = hosted
    with ExitStack() as stack:
        for _ in range(count):
            conn = stack.enter_context(closing(client(name)))
            whole = request_bytes(ws, name)
            if sent == "half":
                socket.send_fds(conn, [whole[:len(whole) // 2]], STDIO)
            elif sent:
                conn.sendall(sent)
        assert_served(ws, name)  # while they all wait


ANOTHER_USER_CONNECTS = """import socket, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.settimeout(300)
conn.connect("\\0" + sys.argv[1][1:])
try:
    conn.sendall(sys.stdin.buffer.read())
    got = conn.recv(1 << 16)
except (BrokenPipeError, ConnectionResetError):  # closed on it, what it sent unread
    got = b""
print(repr(got))
"""


@as_nobody
@pytest.mark.parametrize("sends", [
    b"",           # connects only
    "request",     # a whole request (without descriptors: they would be the other user's)
])
def test_another_user_reaching_the_host_gets_nothing(sends, hosted):
    ws, name = hosted
    done = subprocess.run([SYSTEM_PYTHON, "-c", ANOTHER_USER_CONNECTS, name], user=NOBODY, group=NOBODY, cwd="/",
                          input=request_bytes(ws, name) if sends == "request" else sends, capture_output=True,
                          timeout=HANG_GUARD)
    assert done.stdout.decode().strip() == "b''", done.stderr  # closed at once: not even a refusal
    assert_served(ws, name)


IMPOSTOR = """import socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind("\\0" + sys.argv[1][1:])
listener.listen(1)
print("ready", flush=True)
conn, _ = listener.accept()
conn.settimeout(300)
got, fds = b"", []
while True:
    data, more, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    got, fds = got + data, fds + more
    if not data:
        break
print(len(got), len(fds), flush=True)
"""


@as_nobody
def test_a_socket_another_user_bound_gets_neither_environment_nor_terminal(hosted):
    """Another user binds the name a stage is told (say, after its host ended): the stage
    sends it nothing and runs in its own process."""
    ws, _ = hosted
    name = f"@posttrain-host-impostor-{secrets.token_hex(8)}"
    with subprocess.Popen([SYSTEM_PYTHON, "-c", IMPOSTOR, name], user=NOBODY, group=NOBODY, cwd="/",
                          stdout=subprocess.PIPE, text=True) as impostor:
        try:
            assert impostor.stdout.readline().strip() == "ready"
            done = posttrain(BOGUS, ws, hosted_env(ws, **{stagehost.ENV_VAR: name}))
            received = impostor.communicate(timeout=HANG_GUARD)[0].split()
        finally:
            impostor.kill()
    first, second = done.stderr.splitlines()
    assert first == ("posttrain: the stage host did not take `posttrain stage` (its socket is another user's); "
                     "running it in this process")
    assert second.startswith("posttrain: error: posttrain stage prepare: unknown flag --bogus") and done.returncode == 2
    assert received == ["0", "0"]  # bytes, descriptors


HOLDER = """import os, sys
from posttrain.runtime import stagehost
with stagehost.hosting(sys.argv[1], dict(os.environ)) as name:
    print(name, flush=True)
    sys.stdin.readline()
"""


def abstract_names() -> str:
    with open("/proc/net/unix") as table:
        return table.read()


@pytest.mark.parametrize("how,serve_first", [
    ("SIGKILL", False),   # kill -9 while the host imports
    ("SIGKILL", True),    # kill -9 after it served a stage
    ("SIGTERM", True),    # killed by a plain kill: Python runs no `finally` either
    ("ends", True),       # the run ends normally
])
def test_a_host_leaves_nothing_behind_however_its_run_ends(how, serve_first, tmp_path):
    ws = make_workspace(tmp_path / "ws", SMALL)
    tmp = tmp_path / "tmp"  # the run's TMPDIR, where the host's folder was made (torch adds its own)
    tmp.mkdir()
    env = hosted_env(ws, TMPDIR=str(tmp))
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(ws)], cwd=ws, env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            name = holder.stdout.readline().strip()
            host = next(p for p in psutil.Process(holder.pid).children() if "posttrain.runtime.stagehost" in p.cmdline())
            assert name.startswith("@") and name[1:] in abstract_names()
            if serve_first:
                done = posttrain(BOGUS, ws, {**env, stagehost.ENV_VAR: name})
                assert done.returncode == 2 and "did not take" not in done.stderr, done.stderr
            if how == "ends":
                holder.stdin.write("\n")
                holder.stdin.flush()
            else:
                holder.send_signal(getattr(signal, how))
            holder.wait(timeout=HANG_GUARD)
            _, alive = psutil.wait_procs([host], timeout=HANG_GUARD)
        finally:
            holder.kill()
    assert not alive
    assert [p.name for p in tmp.iterdir() if p.name.startswith("posttrain-host-")] == []
    assert name[1:] not in abstract_names()


AUTH_OWNER = """import sys
from flows import ephemeral_api
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.server.api import server

ephemeral_api.start_now()  # as `posttrain run` starts it
run = flow(name="owned")(lambda: 1)(return_state=True).state_details.flow_run_id
print(server.SubprocessASGIServer().api_url, run, flush=True)
for _ in sys.stdin:  # each line: the run's state, read with this process's own client
    with get_client(sync_client=True) as client:
        print(client.read_flow_run(run).state.type.value, flush=True)
"""


@pytest.fixture(scope="module")
def owned_server(tmp_path_factory):
    """A process that started Prefect's temporary server as a run does, with one flow run."""
    env = {**os.environ, "PREFECT_API_URL": "", "PREFECT_API_AUTH_STRING": "", "PREFECT_SERVER_API_AUTH_STRING": ""}
    env = {k: v for k, v in env.items() if v != ""}
    owner = subprocess.Popen([sys.executable, "-c", AUTH_OWNER], cwd=tmp_path_factory.mktemp("owner"), env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        api, run = owner.stdout.readline().split()

        def state() -> str:
            owner.stdin.write("?\n")
            owner.stdin.flush()
            return owner.stdout.readline().strip()

        yield api, run, state
    finally:
        owner.kill()
        owner.wait()


def basic(credentials: str) -> str:
    return "Basic " + base64.b64encode(credentials.encode()).decode()


@pytest.mark.parametrize("method,path,body,authorization,status", [
    ("POST", "/flow_runs/filter", {}, None, 401),                      # read the runs, no password
    ("GET", "/flow_runs/{run}", None, None, 401),                      # read the run
    ("POST", "/flow_runs/{run}/set_state", {"state": {"type": "CANCELLED"}}, None, 401),  # cancel it
    ("POST", "/flow_runs/{run}/set_state", {"state": {"type": "CANCELLED"}, "force": True},
     basic("admin:admin"), 401),                                       # cancel it, with a guessed password
    ("DELETE", "/flow_runs/{run}", None, "Bearer anything", 401),      # delete it, with a token
    ("GET", "/health", None, None, 200),                               # the health probe stays open (Prefect's choice)
])
def test_another_user_cannot_use_a_runs_temporary_prefect_server(method, path, body, authorization, status,
                                                                  owned_server):
    api, run, state = owned_server
    request = urllib.request.Request(api + path.format(run=run), method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": authorization} if authorization else {})})
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD) as response:
            got = response.status
    except urllib.error.HTTPError as err:
        got = err.code
    assert got == status
    assert state() == "COMPLETED"  # the owner still reads its run, unchanged


def libraries_homes() -> dict[str, str]:
    """Where the libraries of a process the tests start would write, as they resolve it."""
    code = """import json, datasets.config, huggingface_hub.constants, matplotlib, platformdirs, prefect.settings as s
print(json.dumps({"prefect": str(s.get_current_settings().home), "prefect database":
    s.get_current_settings().server.database.connection_url.get_secret_value(),
    "hf": huggingface_hub.constants.HF_HOME, "datasets": str(datasets.config.HF_DATASETS_CACHE),
    "matplotlib": matplotlib.get_configdir(), "matplotlib cache": matplotlib.get_cachedir(),
    # DVC's config and telemetry id, MLflow's telemetry id (XDG_CONFIG_HOME), vLLM's caches (XDG_CACHE_HOME)
    "configs": platformdirs.user_config_dir("dvc", "iterative"), "caches": platformdirs.user_cache_dir()}))"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_tests_keep_every_library_home_in_a_temporary_folder():
    assert all(os.environ[name].startswith(str(TEST_HOME)) for name in HOMES)
    for what, where in libraries_homes().items():
        assert not where or str(TEST_HOME) in where, f"{what}: {where}"


def flows_in(database: Path) -> set[str]:
    """The flow names a Prefect database holds (read only: it may be the user's own)."""
    if not database.is_file():
        return set()
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        return {name for (name,) in db.execute("SELECT name FROM flow")}


def test_a_flow_run_of_the_tests_lands_in_the_temporary_home_not_the_users():
    """By what the run wrote, not by the user's files (the user may run Prefect meanwhile)."""
    name = f"posttrain-test-home-{secrets.token_hex(6)}"
    done = subprocess.run([sys.executable, "-c", f"from prefect import flow; flow(name={name!r})(lambda: 1)()"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr
    assert name in flows_in(TEST_HOME / "prefect" / "prefect.db")
    assert name not in flows_in(Path.home() / ".prefect" / "prefect.db")


def test_off_starts_no_host_and_asks_none(tmp_path, monkeypatch):
    """POSTTRAIN_STAGE_HOST=off (bench/stage_host.py's other arm): the run starts no host
    process and each stage runs in its own, saying nothing about it."""
    monkeypatch.setenv(stagehost.ENV_VAR, stagehost.OFF)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with stagehost.hosting(str(tmp_path), dict(os.environ)) as name:
        assert name is None and {p.pid for p in psutil.Process().children(recursive=True)} == before
        assert os.environ[stagehost.ENV_VAR] == stagehost.OFF
    assert stagehost.run_in_host(["stage", "prepare", "--bogus", "x"]) is None
