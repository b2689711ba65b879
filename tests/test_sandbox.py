"""The SQL sandbox against hostile statements (issue 12): each one is refused or stopped
within the time limit, through `run_query` and through the environment's verifier,
memory stays bounded, nothing is ever written, and normal queries answer as before."""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.envs import get_env
from posttrain.sandbox import _WORKER, QueryError, run_query

TIMEOUT_S = 1.0
POLLS = 100                       # looks at a process that should end, 50 ms apart
COUNT_EMP = "SELECT COUNT(*) FROM emp"
PRINTF_1E9 = "length(printf('%.*c', 1000000000, 'x'))"  # one C loop of 1e9 steps, no opcode boundary
FOREVER = "(WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT MAX(i) FROM r)"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = get_env("sql", db_dir=str(tmp_path_factory.mktemp("db")), timeout_s=TIMEOUT_S)
    assert run_query(env.db_path, COUNT_EMP) == [(30,)]  # the worker starts here, outside any timing
    return env


@pytest.mark.parametrize("sql,error", [
    ("SELECT " + ", ".join([PRINTF_1E9] * 4), "timed out"),                 # 23 s before: killed at the deadline
    (f"SELECT {FOREVER}", "timed out"),                                      # a recursive CTE with no end
    ("SELECT COUNT(*) FROM emp a, emp b, emp c, emp d, emp e, emp f", "timed out"),  # 729e6-row cross join
    ("SELECT instr(hex(zeroblob(499999)) || '1', hex(zeroblob(150000)) || '1')", "timed out"),  # O(n*m) search
    ("SELECT 1 WHERE 1 IN (" + ",".join(["1"] * 2_000_000) + ")", "longer than"),  # 4 MB of SQL, never parsed
    ("SELECT length(zeroblob(1000000000))", "too big"),                      # a 1 GB blob
    ("SELECT length(randomblob(1000000000))", "too big"),
    ("SELECT length(replace(hex(zeroblob(500000)), '0', '0123456789'))", "too big"),  # 10x growth
    ("SELECT length(group_concat(hex(zeroblob(1000)))) FROM emp a, emp b", "too big"),  # 900 x 2 kB
    ("SELECT randomblob(900000) FROM emp", "result larger"),                 # 27 MB of rows to send back
    ("SELECT 'a' LIKE '" + "%a" * 600 + "b'", "pattern too complex"),
    ("SELECT " + "(" * 200 + "1" + ")" * 200, "stack overflow"),             # nesting beyond the parser
    ("SELECT 1" + " UNION ALL SELECT 1" * 30, "too many terms"),
    ("SELECT char(" + ",".join(["65"] * 100) + ")", "too many arguments"),
    ("SELECT ?99999", "variable number"),
])
def test_hostile_statement_ends_within_the_time_limit(env, sql, error):
    """Each hostile statement is refused; one that runs on is stopped at the time limit (SQLite's
    progress handler, or the worker killed at the deadline inside one long opcode), which says so:
    the limit is what bounds it, not a clock in the test."""
    with pytest.raises(QueryError, match=error if error != "timed out" else f"timed out after {TIMEOUT_S}s"):
        run_query(env.db_path, sql, timeout_s=TIMEOUT_S)
    assert run_query(env.db_path, COUNT_EMP) == [(30,)]  # the next query is answered as before
    assert env.verify(sql, COUNT_EMP) is False           # how GRPO scores a completion


@pytest.mark.parametrize("sql", [
    "DROP TABLE emp",
    "INSERT INTO emp VALUES ('zz', 'it', 30, 50)",
    "REPLACE INTO emp VALUES ('ann', 'it', 1, 1)",
    "UPDATE emp SET salary = 0",
    "DELETE FROM emp",
    "WITH x AS (SELECT 1) DELETE FROM emp",
    "CREATE TABLE t (x)",
    "CREATE TEMP TABLE t (x)",                       # would outlive the query on a reused connection
    "ALTER TABLE emp RENAME TO e",
    "ATTACH DATABASE 'other.db' AS other",
    "ATTACH DATABASE ':memory:' AS other",
    "PRAGMA writable_schema = ON",
    "PRAGMA user_version = 7",
    "PRAGMA journal_mode = WAL",
    "PRAGMA hard_heap_limit = 0",                    # would lift the worker's memory bound
    "VACUUM INTO 'copy.db'",                         # writes a new file
    "ANALYZE",                                       # writes sqlite_stat1
    "REINDEX",
    "BEGIN IMMEDIATE",
    "SAVEPOINT a",
    "SELECT 1; DROP TABLE emp",
    "SELECT load_extension('x')",
    "SELECT * FROM pragma_table_info('emp')",
])
def test_sandbox_refuses_anything_but_reading(env, sql, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a relative file name would land
    before = env.db_path.read_bytes(), sorted(env.db_path.parent.iterdir())
    with pytest.raises(QueryError):
        run_query(env.db_path, sql)
    assert not env.verify(sql, COUNT_EMP)
    assert (env.db_path.read_bytes(), sorted(env.db_path.parent.iterdir())) == before
    assert not list(tmp_path.iterdir())


def test_sandbox_opens_read_only(env):
    # even past the authorizer, the connection itself cannot write
    conn = sqlite3.connect(f"{env.db_path.resolve().as_uri()}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("DELETE FROM emp")
    conn.close()


def test_sandbox_bounds_the_rows(env):
    with pytest.raises(QueryError, match="more than 10 rows"):
        run_query(env.db_path, "SELECT a.name FROM emp a, emp b", max_rows=10)


def test_memory_stays_bounded(env):
    # 2,000 distinct 900 kB blobs would hold 1.8 GB: SQLite's heap limit in the worker ends it
    sql = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 2000) "
           "SELECT COUNT(DISTINCT randomblob(900000)) FROM r")
    with pytest.raises(QueryError, match="out of memory"):
        run_query(env.db_path, sql, timeout_s=30)


def test_normal_queries_answer_as_a_plain_connection_does(env):
    splits = env.generate(seed=0)
    golds = [r["answer"] for r in splits["train"] + splits["heldout"]]
    with sqlite3.connect(env.db_path) as plain:
        assert [run_query(env.db_path, g) for g in golds] == [plain.execute(g).fetchall() for g in golds]
    plain.close()


def test_scoring_reuses_one_worker(env):
    """GRPO scores thousands of completions a step: one worker process answers them all (no
    process start per completion; 0.3-0.5 ms a call where docs/hardening.md measured it)."""
    gold = "SELECT name FROM emp WHERE dept='sales' AND salary>50"
    assert env.verify(f" {gold}", gold)
    worker = _WORKER._proc.pid
    assert all(env.verify(f" {gold}", gold) for _ in range(1000))
    assert _WORKER._proc.pid == worker


def test_a_forked_child_runs_queries_of_its_own(env):
    pid = os.fork()
    if pid == 0:  # the parent's worker is not the child's to use
        code = 1
        try:
            code = 0 if run_query(env.db_path, COUNT_EMP) == [(30,)] else 1
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert run_query(env.db_path, COUNT_EMP) == [(30,)]


def test_the_worker_ends_with_its_caller(env):
    script = (f"from posttrain.sandbox import run_query, _WORKER\n"
              f"run_query({str(env.db_path)!r}, 'SELECT 1')\n"
              f"print(_WORKER._proc.pid, flush=True)\n"
              f"import time; time.sleep(60)\n")
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker = int(caller.stdout.readline())
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    for _ in range(POLLS):  # the worker reads EOF on its pipe and exits: a bounded number of looks
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()  # a zombie has ended
    except FileNotFoundError:
        return False
