"""A warm host for stage processes: the heavy libraries imported once per run, each stage a fork.

Every stage process (`python -m posttrain stage X`, the command dvc.yaml gives DVC) would
spend seconds importing torch, transformers, TRL (which imports vLLM) and MLflow before its
work starts: 5-14 s a stage on a small machine. The flow starts one host per run
(`hosting`): a process that imports them and waits on a Unix socket. The stage command
DVC starts connects to it (`run_in_host`, from posttrain/__main__.py) and hands over its
arguments, folder, environment and stdin/stdout/stderr; the host forks, and the fork runs
the stage exactly as the command would have, the client passing on its exit code.

What the stage runs is what DVC hashed: the fork drops every `posttrain` module the host
had imported and imports them again from the workspace. The host only serves a stage
whose interpreter, `sys.path` and environment are the host's, apart from variables the
libraries do not read when imported (`MAY_DIFFER`); anything else, and a host that does not
answer, and the stage runs in its own process as it always did (plain `dvc repro`). The
fork ends when its client ends (kill -9 included: as a stage ends with its dvc process),
and when the host ends; the host ends with the flow that started it.

Other local users: the socket is an abstract one (Linux), a name with no file, gone with
the last process that holds it, so a killed run leaves nothing in /tmp. Such a name has no
file permissions: each end checks that the other is this user (SO_PEERCRED) before it
reads or sends anything (a request carries the environment and the terminal). The host
reads each request as it comes, at most `MAX_REQUEST` bytes and within `REQUEST_WAIT`: a
client that connects and sends nothing, or too much, holds up no other.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

ENV_VAR = "POSTTRAIN_STAGE_HOST"  # the host's socket, set by the flow for the stages it runs
OFF = "off"  # POSTTRAIN_STAGE_HOST=off: no host, every stage in its own process (bench/stage_host.py's other arm)
ABSTRACT = "@"  # how ENV_VAR writes an abstract socket's leading NUL (no variable holds a NUL)
MAX_REQUEST = 1 << 20  # bytes: argv, folder, environment and sys.path are a few KiB; more is refused
REQUEST_WAIT = 30.0  # seconds a connected client has to send its request before it is dropped
UCRED = struct.Struct("3i")  # struct ucred, what SO_PEERCRED gives: pid, uid, gid
# what the host imports, in this order: TRL's configs (for `posttrain run`'s check of the
# trl: blocks), then what the stages import at start-up and their heaviest libraries
PRELOAD = (("trl", "GRPOConfig"), ("transformers", "AutoModelForCausalLM"), ("trl", "SFTTrainer"), ("trl", "GRPOTrainer"),
           ("datasets", "Dataset"), ("mlflow", "start_run"), ("mlflow.store.tracking.sqlalchemy_store", "SqlAlchemyStore"),
           ("deepspeed", "init_distributed"), ("git", "Repo"), ("dvc_data.hashfile.hash", "file_md5"),
           ("peft", "LoraConfig"), ("pydantic", "BaseModel"), ("yaml", "safe_load"), ("matplotlib.pyplot", "figure"),
           ("scipy.stats", "norm"))
# set per stage by the flow and DVC, read lazily: a stage may differ from the host in these
# PS1/PS2: a venv's `activate` exports the prompt, and the non-interactive shell DVC runs a stage in unsets it
MAY_DIFFER = ("DVC_", "MLFLOW_", "PREFECT_", "POSTTRAIN_", "PWD", "OLDPWD", "SHLVL", "_", "PS1", "PS2",
              "PYTHONPATH")  # PYTHONPATH: what it changes is compared (the posttrain package, search_path)
HEADER = struct.Struct("!I")
HOSTS: dict[str, set[str]] = {}  # the hosts this process runs, by folder: their sockets
# before the imports, which may add to sys.path and set variables (as they would in the stage itself)
STARTED_WITH = {"path": list(sys.path), "env": dict(os.environ), "package": os.path.dirname(os.path.abspath(__file__))}


COMMANDS = ("stage", "check", "memory")  # the posttrain commands a host runs


def run_in_host(argv: list[str], *, stdio: tuple[int, int, int] = (0, 1, 2), quiet: bool = False,
                cwd: str | None = None) -> int | None:
    """`posttrain stage ...` (or `check`, `memory`) run by the host this environment names, in
    folder `cwd` (default: this process's): its exit code, or None when no host runs it
    (none named or answering, or it declined: run it in this process; `quiet`: without
    saying so). `stdio`: the command's stdin, stdout and stderr (file descriptors)."""
    path = os.environ.get(ENV_VAR)
    if not path or path == OFF or not argv or argv[0] not in COMMANDS:
        return None
    from posttrain.runtime.lifetime import die_with_run

    die_with_run()  # a stage's client ends with dvc and the flow; the stage ends with it
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    replies = client.makefile("r")
    try:
        answer = hand_over(client, path, argv, stdio, cwd or os.getcwd()) or replies.readline().split()
    except OSError:
        answer = []
    if not answer or answer[0] != "started":  # declined, or the host died before it forked
        reason = " ".join(answer[1:]) or "no answer"
        if not quiet:
            print(f"posttrain: the stage host did not take `posttrain {argv[0]}` ({reason}); running it in this process",
                  file=sys.stderr, flush=True)
        client.close()
        return None
    child = int(answer[1])
    with passed_on(child):
        ended = replies.readline().split()
    client.close()
    if not ended:
        print("posttrain: the stage host ended before the command did", file=sys.stderr, flush=True)
        return 1
    return int(ended[1])


def hand_over(client: socket.socket, path: str, argv: list[str], stdio: tuple[int, int, int], cwd: str) -> list[str]:
    """Connect `client` to the host at `path` and send it the command, to run in `cwd`:
    nothing when sent (its answer follows), or the reason it was not."""
    client.connect(address(path))
    if peer_uid(client) != os.getuid():  # a name another user bound: it gets neither our environment nor stdio
        return ["declined", "its socket is another user's"]
    request = json.dumps({"argv": sys.argv[:1] + argv, "cwd": cwd, "env": dict(os.environ),
                          "path": sys.path, "executable": sys.executable,
                          "package": STARTED_WITH["package"]}).encode()
    socket.send_fds(client, [HEADER.pack(len(request)) + request], list(stdio))
    return []


def address(name: str) -> str:
    """The socket ENV_VAR names: `@NAME`, an abstract one (Linux); else a file's path."""
    return "\0" + name[len(ABSTRACT):] if name.startswith(ABSTRACT) else name


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of `conn` (as it connected or listened)."""
    return UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))[1]


@contextlib.contextmanager
def passed_on(child: int):
    """While a fork runs this process's command: Ctrl-C reaches the fork itself (it is in
    the terminal's process group), a SIGTERM is passed on to it. Signals are the main
    thread's: another thread (a check run meanwhile) changes nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(
        signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])


def run_json(argv: list[str], cwd: str | None = None):
    """`argv`, a command that prints one JSON line, run by the host in `cwd` (default: this
    process's folder), quietly: (exit code, the line's value), or None when no host ran it
    or it printed no JSON (run it here)."""
    import threading

    read, write = os.pipe()
    printed: list[bytes] = []
    with os.fdopen(read, "rb") as out:
        reader = threading.Thread(target=lambda: printed.append(out.read()), daemon=True)
        reader.start()  # read as it prints: a pipe holds 64 KiB
        try:
            with open(os.devnull, "w") as devnull:
                code = run_in_host(argv, stdio=(0, write, devnull.fileno()), quiet=True, cwd=cwd)
        finally:
            os.close(write)
        reader.join()
    try:
        return None if code is None else (code, json.loads(printed[0].strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return None


def refusal(request: dict) -> str | None:
    """Why the host cannot run this request as the command would run itself, or None. It
    runs the commands posttrain sends it (COMMANDS), never another: a same-user client
    that asks for `posttrain run` or `model fetch` is declined."""
    argv = request.get("argv")
    if not isinstance(argv, list) or len(argv) < 2 or argv[1] not in COMMANDS:
        shown = " ".join(map(str, argv[1:3]))[:60] if isinstance(argv, list) else type(argv).__name__
        return f"`posttrain {shown}` is not a command a host runs (only {', '.join(COMMANDS)})"
    if request.get("executable") != sys.executable:
        return f"interpreter {request.get('executable')} is not the host's {sys.executable}"
    if request.get("package") != STARTED_WITH["package"]:
        return f"its posttrain is {request.get('package')}, the host's {STARTED_WITH['package']}"
    env, ours = request.get("env", {}), STARTED_WITH["env"]
    if search_path(request.get("path", []), env) != search_path(STARTED_WITH["path"], ours):
        return "its sys.path differs from the host's"
    env, ours = comparable(env), comparable(ours)
    # a variable the host's imports set may come set as they set it (by the same imports in the flow)
    differ = sorted(k for k in set(env) | set(ours) if env.get(k) != ours.get(k) and not k.startswith(MAY_DIFFER)
                    and not (k not in ours and env.get(k) == os.environ.get(k)))
    if differ:
        return f"environment variable {differ[0]} differs from the host's"
    return None


def comparable(env: dict[str, str]) -> dict[str, str]:
    """`env` as the host compares it: PATH without the interpreter's own folder (the flow
    puts the venv's first for its stages, `posttrain run` may not have it)."""
    here = os.path.dirname(sys.executable)
    return {**env, "PATH": os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != here)}


def search_path(path: list[str], env: dict[str, str]) -> list[str]:
    """Where the libraries come from: sys.path without its first entry (the script's folder,
    or the current one) and PYTHONPATH's (a workspace's own posttrain: compared apart)."""
    extra = set(filter(None, env.get("PYTHONPATH", "").split(os.pathsep)))
    return [entry for entry in path[1:] if entry not in extra]


def serve(listener: socket.socket) -> int | None:
    """Serve requests on `listener` until ended, importing `PRELOAD` one by one meanwhile
    (a request that comes first gets a fork that imports the rest itself). Returns only in
    a fork: the command's exit code (the caller ends the process with it)."""
    import importlib
    import selectors

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the flow's to handle: the host ends with it
    pending = list(PRELOAD)
    with selectors.DefaultSelector() as selector:
        host = Host(listener, selector)
        selector.register(listener, selectors.EVENT_READ, host.accept)
        while True:
            for key, _ in selector.select(timeout=0 if pending else host.next_deadline()):
                code = key.data(key.fileobj)  # the handler registered with it
                if code is not None:
                    return code  # the fork: the command's exit code
            host.drop_silent()
            if pending:
                module, name = pending.pop(0)
                getattr(importlib.import_module(module), name)


@dataclass
class Incoming:
    """A request being read: the bytes and descriptors so far, and when its client is dropped."""

    deadline: float
    data: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)


class Host:
    """The host's connections: requests still coming in, read as their bytes arrive (no
    client holds up another), and the forks running, each with its client's connection.
    Each handler returns None, except in a fork: the command's exit code."""

    def __init__(self, listener: socket.socket, selector):
        self.listener, self.selector = listener, selector
        self.incoming: dict[socket.socket, Incoming] = {}
        self.forks: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)

    def accept(self, listener: socket.socket) -> None:
        import selectors

        try:
            conn, _ = listener.accept()
        except OSError:  # the client left already
            return None
        user = peer_uid(conn)
        if user != os.getuid():  # another local user: it reads nothing, not even a refusal
            return self.drop(conn, f"refused a connection from user {user}")
        conn.setblocking(False)
        self.incoming[conn] = Incoming(time.monotonic() + REQUEST_WAIT)
        self.selector.register(conn, selectors.EVENT_READ, self.read)

    def read(self, conn: socket.socket) -> int | None:
        got = self.incoming[conn]
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        except BlockingIOError:
            return None
        except OSError as err:
            return self.drop(conn, f"a bad request: {err}")
        got.data += data
        got.fds += fds
        if not data:
            return self.drop(conn, "a client left before its request was complete")
        if len(got.data) < HEADER.size:
            return None
        size = HEADER.unpack_from(got.data)[0]
        if size > MAX_REQUEST:
            return self.decline(conn, f"its request is {size} bytes, more than the {MAX_REQUEST} a host reads")
        if len(got.data) < HEADER.size + size:
            return None
        try:
            request = json.loads(got.data[HEADER.size:HEADER.size + size])
        except ValueError as err:
            return self.drop(conn, f"a bad request: {err}")
        if not isinstance(request, dict):
            return self.drop(conn, "a bad request: not a JSON object")
        fds, got.fds = got.fds, []
        self.forget(conn)
        return self.start(conn, request, fds)

    def start(self, conn: socket.socket, request: dict, fds: list[int]) -> int | None:
        """Fork for `request`: in the fork, run it; here, watch the fork's end."""
        import selectors

        problem = refusal(request) if len(fds) == 3 else "it did not pass its stdin, stdout and stderr"
        pid = None if problem else os.fork()
        if pid == 0:
            self.close_inherited()
            conn.setblocking(True)
            return run_forked_command(request, fds, conn)
        for fd in fds:
            os.close(fd)
        if problem:
            return self.decline(conn, problem)
        with contextlib.suppress(OSError):
            conn.sendall(f"started {pid}\n".encode())
        pidfd = os.pidfd_open(pid)
        self.forks[pidfd] = (pid, conn)
        self.selector.register(pidfd, selectors.EVENT_READ, self.ended)
        return None

    def ended(self, pidfd: int) -> None:
        """A fork ended: its client gets the exit code."""
        pid, conn = self.forks.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with contextlib.suppress(OSError), conn:
            conn.sendall(f"exit {code if code >= 0 else 128 - code}\n".encode())

    def next_deadline(self) -> float | None:
        """Seconds until the next silent client is dropped (None: no client is awaited)."""
        deadlines = [got.deadline for got in self.incoming.values()]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def drop_silent(self) -> None:
        for conn in [c for c, got in self.incoming.items() if got.deadline <= time.monotonic()]:
            self.drop(conn, f"a client sent no complete request in {REQUEST_WAIT:.0f} s")

    def decline(self, conn: socket.socket, problem: str) -> None:
        """Tell the client why not (it runs the command itself), and forget it."""
        with contextlib.suppress(OSError):
            conn.sendall(f"declined {problem}\n".encode())
        self.drop(conn)

    def drop(self, conn: socket.socket, why: str | None = None) -> None:
        """Close `conn`, saying `why` in the host's log."""
        if why:
            print(f"stage host: {why}", file=sys.stderr, flush=True)
        self.forget(conn)
        conn.close()

    def forget(self, conn: socket.socket) -> None:
        """Stop reading `conn`'s request, closing the descriptors it passed."""
        got = self.incoming.pop(conn, None)
        if got is not None:
            self.selector.unregister(conn)
            for fd in got.fds:
                os.close(fd)

    def close_inherited(self) -> None:
        """In a fork: close what the host holds (its socket, its other clients, their forks).
        The selector first, unchanged: its interest list is the host's as well."""
        self.selector.close()
        self.listener.close()
        for conn, got in self.incoming.items():
            conn.close()
            for fd in got.fds:
                os.close(fd)
        for pidfd, (_, conn) in self.forks.items():
            os.close(pidfd)
            conn.close()


def run_forked_command(request: dict, fds: list[int], conn: socket.socket) -> int:
    """In the fork: become the client's process (stdio, folder, environment, arguments),
    watch the client, and run the command with the workspace's posttrain."""
    import threading

    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    set_by_imports = {k: v for k, v in os.environ.items() if STARTED_WITH["env"].get(k) != v}
    os.environ.clear()
    os.environ.update(request["env"], **set_by_imports)
    os.environ.pop(ENV_VAR, None)  # a fork asks no host: what it runs runs in it
    sys.argv = request["argv"]
    for name in [m for m in sys.modules if m == "posttrain" or m.startswith("posttrain.")]:
        del sys.modules[name]  # the stage runs the workspace's code, as DVC hashed it

    def watch():  # the client ended (killed with dvc or the flow): so does its stage
        with contextlib.suppress(OSError):
            while conn.recv(1024):
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="posttrain-stage-client", daemon=True).start()
    if sys.argv[1:2] == ["stage"]:  # as posttrain/__main__.py routes it: a stage without the CLI
        from posttrain.stage_entry import main as run_stage

        return run_stage(sys.argv[2:])
    else:
        from posttrain.cli import main

        return main(sys.argv[1:])


@contextlib.contextmanager
def hosting(workdir: str, env: dict[str, str]):
    """A host for the stages run in `workdir` while the block runs: its socket is named in
    this process's environment (ENV_VAR), which the stage processes inherit. `env`: the
    stages' environment without their own variables. A host this process started already
    (for the same folder) is kept. Nothing is written anywhere, in `workdir` or /tmp (a
    refused or killed run leaves nothing); a host that ended by itself leaves its last
    lines on stderr."""
    import secrets
    import subprocess
    import tempfile

    from posttrain.runtime import lifetime

    if os.environ.get(ENV_VAR) == OFF or not (hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")):
        yield None  # turned off, or not Linux >= 5.3 with Python >= 3.9
        return
    folder_key = os.path.realpath(workdir)  # now: the caller may change folder inside the block
    if os.environ.get(ENV_VAR) in HOSTS.get(folder_key, ()):
        yield os.environ[ENV_VAR]
        return
    name = f"{ABSTRACT}posttrain-host-{os.getpid()}-{secrets.token_hex(16)}"  # unguessable: no one binds it first
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, tempfile.TemporaryFile("w+", errors="replace") as log:
        listener.bind(address(name))  # bound here: a stage that connects before the host is up waits for it
        listener.listen(16)
        host = subprocess.Popen([sys.executable, "-m", "posttrain.runtime.stagehost", str(listener.fileno())],
                                cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                pass_fds=[listener.fileno()], preexec_fn=lifetime.die_with_this_thread())
        listener.close()  # the host's alone: the name goes with the host
        with named(name, folder_key):
            try:
                yield name
            finally:
                if host.poll() is not None:  # it ended by itself: the stages ran in their own processes
                    log.seek(0)
                    print(f"posttrain: the stage host ended (exit {host.returncode}); its last lines:\n"
                          f"{log.read()[-2000:]}", file=sys.stderr, flush=True)
                host.kill()
                host.wait()


@contextlib.contextmanager
def named(name: str, folder_key: str):
    """ENV_VAR names the host `name` for the block, which runs the stages of `folder_key`."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = name
    HOSTS.setdefault(folder_key, set()).add(name)
    try:
        yield
    finally:
        HOSTS[folder_key].discard(name)
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


if __name__ == "__main__":
    from posttrain.runtime.lifetime import exit_now

    exit_now(serve(socket.socket(fileno=int(sys.argv[1]))))  # returns in a fork, once its stage has run
