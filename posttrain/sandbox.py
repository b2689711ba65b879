"""Running model-written SQL safely: read-only, one statement, a time limit, bounded rows.

Model output is never trusted. A query runs in a worker process (one per calling
process, reused from call to call) on a connection that
- opens the database file read-only (`mode=ro`), so nothing can be written to it;
- has an authorizer that allows reading and nothing else: INSERT, UPDATE, DELETE,
  CREATE, DROP, ALTER, ATTACH, DETACH, PRAGMA, transactions are all refused;
- has SQLite's own limits lowered (`LIMITS`): no string or blob over 1 MB, no SQL text
  over `MAX_SQL_CHARS` (refused before it is sent or parsed), shallow expressions, few
  compound SELECTs, and a heap limit in the worker, so memory stays bounded;
- is interrupted when it runs past `timeout_s` (a progress handler every
  `PROGRESS_OPS` opcodes), so a query that would run forever ends with "timed out";
- returns at most `max_rows` rows and refuses more than one statement.
One SQLite call can still outlast the deadline inside a single opcode (e.g.
`printf('%.*c', 1000000000, 'x')` loops a billion times in C), where no handler runs:
so the worker is killed `KILL_GRACE_S` after the deadline and a fresh one started at
the next call. The time limit therefore holds on wall time whatever the statement does.
Errors of any kind come back as `QueryError`; callers score them as wrong.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

MAX_SQL_CHARS = 100_000      # a real query is a few hundred; a 2,000,000-item IN list is 4 MB
MAX_REPLY_BYTES = 16 << 20   # pickled rows the worker may send back
KILL_GRACE_S = 0.1           # how long past `timeout_s` the worker may run before it is killed
PROGRESS_OPS = 1000          # SQLite opcodes between two deadline checks
WORKER_HEAP_BYTES = 256 << 20     # SQLite's heap in the worker (hard_heap_limit is per process)
WORKER_ADDRESS_BYTES = 1 << 30    # the worker's whole address space (Python objects included)
WORKER_FILE_BYTES = 64 << 20      # largest temporary file a sort may spill to disk
WORKER_START_S = 30.0        # a worker that is not ready by then is an installation problem

# Far above what a query on a small table needs, far below SQLite's defaults.
LIMITS = {
    sqlite3.SQLITE_LIMIT_LENGTH: 1_000_000,          # bytes in one string, blob or row
    sqlite3.SQLITE_LIMIT_SQL_LENGTH: MAX_SQL_CHARS,  # bytes of SQL text
    sqlite3.SQLITE_LIMIT_COLUMN: 200,
    sqlite3.SQLITE_LIMIT_EXPR_DEPTH: 100,
    sqlite3.SQLITE_LIMIT_COMPOUND_SELECT: 20,
    sqlite3.SQLITE_LIMIT_VDBE_OP: 100_000,
    sqlite3.SQLITE_LIMIT_FUNCTION_ARG: 32,
    sqlite3.SQLITE_LIMIT_ATTACHED: 0,                 # no other databases
    sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH: 1_000,
    sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER: 32,
    sqlite3.SQLITE_LIMIT_TRIGGER_DEPTH: 1,
    sqlite3.SQLITE_LIMIT_WORKER_THREADS: 0,
}

# Authorizer action codes that only read. Everything else is denied.
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}


class QueryError(Exception):
    """The query was refused, failed, timed out or returned too much."""


def run_query(db_path: str | Path, sql: str, *, timeout_s: float = 1.0, max_rows: int = 1000) -> list[tuple]:
    """The rows `sql` returns on the database at `db_path`, under the sandbox above."""
    if len(sql) > MAX_SQL_CHARS:
        raise QueryError(f"query longer than {MAX_SQL_CHARS} characters")
    request = (os.path.abspath(db_path), sql, timeout_s, max_rows)
    kind, value = _WORKER.call(request, deadline_s=timeout_s + KILL_GRACE_S, limit_s=timeout_s)
    if kind == "error":
        raise QueryError(value)
    return value


def _authorize(action, arg1, arg2, db_name, trigger):
    if action not in _ALLOWED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _execute(db_path: str, sql: str, timeout_s: float, max_rows: int) -> list[tuple]:
    """`run_query`'s work, done in the worker: the rows, or QueryError."""
    conn = _connection(db_path, timeout_s)
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_OPS)
    cursor = conn.cursor()
    try:
        cursor.execute(sql)  # execute() itself refuses a second statement
        rows = cursor.fetchmany(max_rows + 1)
        if len(rows) > max_rows:
            raise QueryError(f"more than {max_rows} rows")
        return rows
    except sqlite3.OperationalError as err:
        if "interrupted" in str(err):
            raise QueryError(f"timed out after {timeout_s}s") from None
        raise QueryError(str(err)) from None
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as err:
        raise QueryError(str(err)) from None
    except MemoryError:
        raise QueryError("out of memory") from None
    finally:
        cursor.close()  # ends the statement and its read transaction: the connection is reused


_connections: dict[str, tuple[tuple, sqlite3.Connection]] = {}  # in the worker: path -> (file identity, conn)


def _connection(db_path: str, timeout_s: float) -> sqlite3.Connection:
    """The worker's sandboxed connection to `db_path`, reopened when the file changes.

    Reuse is safe because the authorizer lets no statement leave state behind (no
    temp tables, no PRAGMA, no transaction), and it saves opening the file and
    reading its schema on every call (~0.5 ms)."""
    try:
        stat = os.stat(db_path)
    except OSError as err:
        raise QueryError(f"cannot open {db_path}: {err.strerror}") from None
    identity = (stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size, timeout_s)
    cached = _connections.pop(db_path, None)
    if cached and cached[0] == identity:
        _connections[db_path] = cached
        return cached[1]
    if cached:
        cached[1].close()
    while len(_connections) >= 8:
        _connections.pop(next(iter(_connections)))[1].close()
    conn = _open(db_path, timeout_s)
    _connections[db_path] = (identity, conn)
    return conn


def _open(db_path: str, timeout_s: float) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(f"{Path(db_path).as_uri()}?mode=ro", uri=True, timeout=timeout_s,
                               check_same_thread=False)
    except sqlite3.Error as err:
        raise QueryError(f"cannot open {db_path}: {err}") from None
    for limit, value in LIMITS.items():
        conn.setlimit(limit, value)
    conn.execute("PRAGMA temp_store = MEMORY")  # sorts and temp tables stay under the heap limit
    conn.set_authorizer(_authorize)
    return conn


class Worker:
    """The worker process of the calling process: started on first use, killed when a
    request overruns its deadline, started afresh by the next call. Calls are serialised.

    `argv` starts it with the read end of a pipe as its last argument; it sends "ready",
    then answers each pickled request with one pickled reply. posttrain.envs.mathverify
    runs math-verify in one too."""

    def __init__(self, argv: list[str]) -> None:
        self._argv = argv
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    def call(self, request: tuple, *, deadline_s: float, limit_s: float) -> tuple[str, object]:
        """The worker's reply, or ("error", why) when it ran past `deadline_s` (the time
        limit `limit_s` plus a grace) or died."""
        with self._lock:
            conn = self._ready()
            try:
                conn.send(request)
                if conn.poll(deadline_s):
                    return pickle.loads(conn.recv_bytes(MAX_REPLY_BYTES))
                reason = f"timed out after {limit_s}s"
            except (EOFError, OSError) as err:
                reason = f"worker died: {err or type(err).__name__}"
            self._kill()
            return "error", reason

    def _ready(self) -> Connection:
        if self._conn is None or self._proc.poll() is not None:
            self._kill()
            self._start()
        return self._conn

    def _start(self) -> None:
        ours, theirs = Pipe()
        self._proc = subprocess.Popen([*self._argv, str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        theirs.close()
        self._conn = ours
        if not ours.poll(WORKER_START_S) or ours.recv() != "ready":
            self._kill()
            raise RuntimeError(f"the worker ({' '.join(self._argv)}) did not start")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
        self._proc = self._conn = None

    def forget(self) -> None:
        """In a forked child: the worker is the parent's; start another when needed."""
        if self._conn is not None:
            self._conn.close()  # this process's copy only
        self._lock, self._proc, self._conn = threading.Lock(), None, None

    def close(self) -> None:
        with self._lock:
            self._kill()


def _serve(fd: int) -> None:
    """The worker's loop: one request in, one pickled reply out, until the caller goes."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; the worker ends on EOF
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit fails, not the worker
    for limit, value in ((resource.RLIMIT_AS, WORKER_ADDRESS_BYTES), (resource.RLIMIT_FSIZE, WORKER_FILE_BYTES)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass  # not every platform has both; SQLite's heap limit and the deadline still hold
    with sqlite3.connect(":memory:") as conn:
        conn.execute(f"PRAGMA hard_heap_limit = {WORKER_HEAP_BYTES}")
    conn.close()
    serve(fd, _reply)


def _reply(request: tuple) -> tuple:
    try:
        return "rows", _execute(*request)
    except QueryError as err:
        return "error", str(err)


def serve(fd: int, reply) -> None:
    """A worker's loop (`Worker`): "ready", then `reply(request)` for each request, pickled,
    until the caller goes."""
    channel = Connection(fd)
    channel.send("ready")
    while True:
        try:
            request = channel.recv()
        except EOFError:
            return
        channel.send_bytes(_pickled(reply(request)))


def _pickled(reply: tuple) -> bytes:
    try:
        data = pickle.dumps(reply)
    except MemoryError:
        return pickle.dumps(("error", "out of memory"))
    if len(data) > MAX_REPLY_BYTES:
        return pickle.dumps(("error", f"result larger than {MAX_REPLY_BYTES} bytes"))
    return data


# -I -S: stdlib only; neither the environment, the current folder nor site-packages
_WORKER = Worker([sys.executable, "-I", "-S", __file__])
atexit.register(_WORKER.close)
os.register_at_fork(after_in_child=_WORKER.forget)

if __name__ == "__main__":
    _serve(int(sys.argv[1]))
