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
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys

ENV_VAR = "POSTTRAIN_STAGE_HOST"  # the host's socket, set by the flow for the stages it runs
# what the host imports before it serves: what the stages import at start-up and their
# heaviest libraries (posttrain.cli imports the same before a stage runs without a host)
PRELOAD = (("transformers", "AutoModelForCausalLM"), ("trl", "SFTTrainer"), ("trl", "GRPOTrainer"),
           ("datasets", "Dataset"), ("mlflow", "start_run"), ("peft", "LoraConfig"), ("pydantic", "BaseModel"),
           ("yaml", "safe_load"), ("matplotlib.pyplot", "figure"), ("scipy.stats", "norm"))
# set per stage by the flow and DVC, read lazily: a stage may differ from the host in these
MAY_DIFFER = ("DVC_", "MLFLOW_", "PREFECT_", "POSTTRAIN_", "PWD", "OLDPWD", "SHLVL", "_")
HEADER = struct.Struct("!I")
# before the imports, which may add to sys.path and set variables (as they would in the stage itself)
STARTED_WITH = {"path": list(sys.path), "env": dict(os.environ)}


def run_in_host(argv: list[str]) -> int | None:
    """`posttrain stage ...` run by the host this environment names: its exit code, or
    None when no host serves it (none named or answering, or it declined: run it here)."""
    path = os.environ.get(ENV_VAR)
    if not path or not argv or argv[0] != "stage":
        return None
    from posttrain.lifetime import die_with_run

    die_with_run()  # this client ends with dvc and the flow; its stage ends with it
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(path)
        request = json.dumps({"argv": sys.argv[:1] + argv, "cwd": os.getcwd(), "env": dict(os.environ),
                              "path": sys.path, "executable": sys.executable}).encode()
        socket.send_fds(client, [HEADER.pack(len(request)) + request], [0, 1, 2])
        replies = client.makefile("r")
        answer = replies.readline().split()
    except OSError:
        answer = []
    if not answer or answer[0] != "started":  # declined, or the host died before it forked
        reason = " ".join(answer[1:]) or "no answer"
        print(f"posttrain: the stage host did not take this stage ({reason}); running it in this process",
              file=sys.stderr, flush=True)
        client.close()
        return None
    child = int(answer[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the stage itself (the terminal's process group)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    ended = replies.readline().split()
    if not ended:
        print("posttrain: the stage host ended before the stage did", file=sys.stderr, flush=True)
        return 1
    return int(ended[1])


def refusal(request: dict) -> str | None:
    """Why the host cannot run this request as the command would run itself, or None."""
    if request.get("executable") != sys.executable:
        return f"interpreter {request.get('executable')} is not the host's {sys.executable}"
    if request.get("path") != STARTED_WITH["path"]:
        return "its sys.path differs from the host's"
    env, ours = request.get("env", {}), STARTED_WITH["env"]
    differ = sorted(k for k in set(env) | set(ours) if env.get(k) != ours.get(k) and not k.startswith(MAY_DIFFER))
    if differ:
        return f"environment variable {differ[0]} differs from the host's"
    return None


def serve(listener: socket.socket) -> int | None:
    """Import `PRELOAD`, then serve stage requests on `listener` until ended. Returns only
    in a fork: the stage's exit code (the interpreter ends it as it would any process)."""
    import importlib
    import selectors

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the flow's to handle: the host ends with it
    for module, name in PRELOAD:  # clients that connect meanwhile wait in the listen queue
        getattr(importlib.import_module(module), name)
    host = os.getpid()
    forks: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    pid = take(conn, [listener, selector, *(c for _, c in forks.values())], list(forks))
                    if os.getpid() != host:
                        return pid  # the fork: the stage's exit code
                    if pid is not None:
                        pidfd = os.pidfd_open(pid)
                        forks[pidfd] = (pid, conn)
                        selector.register(pidfd, selectors.EVENT_READ)
                else:  # a fork ended: its client gets the exit code
                    pid, conn = forks.pop(key.fd)
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                    with contextlib.suppress(OSError), conn:
                        conn.sendall(f"exit {code if code >= 0 else 128 - code}\n".encode())


def take(conn: socket.socket, inherited: list, inherited_fds: list[int]) -> int | None:
    """Read one request from `conn` and fork for it: the fork's pid in the host (None when
    refused); in the fork, the stage's exit code once it has run."""
    try:
        conn.settimeout(30)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        size = HEADER.unpack_from(data)[0]
        while len(data) < HEADER.size + size:
            more = conn.recv(1 << 20)
            if not more:
                raise OSError("the client left")
            data += more
        request = json.loads(data[HEADER.size:HEADER.size + size])
        conn.settimeout(None)
    except (OSError, ValueError, struct.error) as err:
        conn.close()
        return print(f"stage host: a bad request: {err}", file=sys.stderr, flush=True)
    problem = refusal(request) if len(fds) == 3 else "it did not pass its stdin, stdout and stderr"
    pid = None if problem else os.fork()
    if pid == 0:
        for thing in inherited:  # the host's socket and the other stages' connections
            thing.close()
        for fd in inherited_fds:
            os.close(fd)
        return run_stage(request, fds, conn)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):
        conn.sendall(f"declined {problem}\n".encode() if problem else f"started {pid}\n".encode())
    if problem:
        conn.close()
    return pid


def run_stage(request: dict, fds: list[int], conn: socket.socket) -> int:
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
    sys.argv = request["argv"]
    for name in [m for m in sys.modules if m == "posttrain" or m.startswith("posttrain.")]:
        del sys.modules[name]  # the stage runs the workspace's code, as DVC hashed it

    def watch():  # the client ended (killed with dvc or the flow): so does its stage
        with contextlib.suppress(OSError):
            while conn.recv(1024):
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="posttrain-stage-client", daemon=True).start()
    from posttrain.cli import main

    return main(sys.argv[1:])


@contextlib.contextmanager
def hosting(workdir: str, env: dict[str, str], log_path):
    """A host for the stages run in `workdir` while the block runs: its socket is named in
    this process's environment (ENV_VAR), which the stage processes inherit. `env`: the
    stages' environment without their own variables; the host's output goes to `log_path`."""
    import subprocess
    import tempfile

    from posttrain import lifetime

    if not (hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")):  # Linux >= 5.3, Python >= 3.9
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="posttrain-host-") as folder:
        path = os.path.join(folder, "socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)  # bound here: a stage that connects before the host is up waits for it
            listener.listen(16)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "w") as log:
                host = subprocess.Popen([sys.executable, "-m", "posttrain.stagehost", str(listener.fileno())],
                                        cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        pass_fds=[listener.fileno()], preexec_fn=lifetime.die_with_this_thread())
        before = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = path
        try:
            yield path
        finally:
            if before is None:
                os.environ.pop(ENV_VAR, None)
            else:
                os.environ[ENV_VAR] = before
            host.kill()
            host.wait()


if __name__ == "__main__":
    code = serve(socket.socket(fileno=int(sys.argv[1])))
    sys.exit(code)
