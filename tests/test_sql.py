"""The text-to-SQL environment: execution grading, the sandbox, and reward hacking."""

import sqlite3
import time

import pytest

from posttrain.envs import get_env
from posttrain.gate import decide
from posttrain.rewards import build_rewards
from posttrain.sandbox import QueryError, run_query


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return get_env("sql", db_dir=str(tmp_path_factory.mktemp("db")))


def test_every_gold_query_runs_and_verifies(env):
    splits = env.generate(seed=0)
    rows = splits["train"] + splits["heldout"]
    assert len(splits["heldout"]) == 150 and len(rows) > 800
    assert len({r["prompt"] for r in rows}) == len(rows)  # no question in both splits
    assert all(env.verify(r["completion"], r["answer"]) for r in rows)


@pytest.mark.parametrize("completion,correct", [
    (" SELECT COUNT(*) FROM emp WHERE dept='sales'", True),
    (" select count(name) from emp where dept = 'sales';", True),       # other text, same rows
    (" SELECT COUNT(*) FROM emp", False),                                # runs, wrong rows
    (" SELECT COUNT(*) FROM emp WHERE dept=sales", False),               # error -> 0
    (" COUNT sales", False),                                             # not a query
])
def test_execution_match(env, completion, correct):
    assert env.verify(completion, "SELECT COUNT(*) FROM emp WHERE dept='sales'") is correct


def test_rows_compare_as_multisets_unless_the_gold_query_orders(env):
    gold = "SELECT name FROM emp WHERE dept='sales'"
    assert env.verify(f"{gold} ORDER BY name DESC", gold)                 # any order is fine
    ordered = "SELECT name FROM emp WHERE dept='sales' ORDER BY age"
    assert env.verify(ordered, ordered)
    assert not env.verify("SELECT name FROM emp WHERE dept='sales' ORDER BY age DESC", ordered)
    assert not env.verify("SELECT name FROM emp WHERE dept='sales' UNION ALL "
                          "SELECT name FROM emp WHERE dept='sales'", gold)  # duplicates count


@pytest.mark.parametrize("query", [
    "DROP TABLE emp",
    "INSERT INTO emp VALUES ('zz', 'it', 30, 50)",
    "UPDATE emp SET salary = 0",
    "DELETE FROM emp",
    "CREATE TABLE t (x)",
    "ATTACH DATABASE ':memory:' AS other",
    "PRAGMA user_version = 7",
    "PRAGMA journal_mode = WAL",
    "SELECT 1; DROP TABLE emp",
    "SELECT load_extension('x')",
])
def test_sandbox_refuses_anything_but_reading(env, query):
    before = env.db_path.read_bytes()
    with pytest.raises(QueryError):
        run_query(env.db_path, query)
    assert env.db_path.read_bytes() == before
    assert not env.verify(query, "SELECT COUNT(*) FROM emp")


def test_sandbox_opens_read_only(env):
    # even past the authorizer, the connection itself cannot write
    conn = sqlite3.connect(f"{env.db_path.resolve().as_uri()}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("DELETE FROM emp")
    conn.close()


def test_sandbox_stops_a_query_that_would_run_forever(env):
    forever = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT MAX(i) FROM r"
    start = time.monotonic()
    with pytest.raises(QueryError, match="timed out"):
        run_query(env.db_path, forever, timeout_s=0.5)
    assert time.monotonic() - start < 3
    assert not env.verify(forever, "SELECT COUNT(*) FROM emp")  # scored 0, not an exception


def test_sandbox_bounds_the_rows(env):
    with pytest.raises(QueryError, match="more than 10 rows"):
        run_query(env.db_path, "SELECT a.name FROM emp a, emp b", max_rows=10)


def hacked(gold: str) -> str:
    """What a policy trained on string similarity drifts to: near-copies with the
    comparison flipped or the department misspelt, which return the wrong rows."""
    return " " + gold.replace(">", "<").replace("='", "='x")


def test_similarity_reward_is_hacked_and_the_sentinel_catches_it(env):
    """A simulated policy: before the stage it answers correctly; after training on
    `similarity` it writes near-copies of the gold queries that return other rows. The
    similarity reward still rates them highly, and the gate's reward-hacking sentinel
    fires; the execution reward would have fallen, so it stays quiet."""
    rows = env.generate(seed=0)["heldout"]
    answers = [r["answer"] for r in rows]
    before = [r["completion"] for r in rows[:60]] + [" SELECT 1"] * (len(rows) - 60)   # 40% right
    after = [hacked(a) for a in answers]
    (similarity,), _ = build_rewards(env, ["similarity"])
    (execution,), _ = build_rewards(env, ["correctness"])

    def mean(fn, completions):
        return sum(fn(completions, answer=answers)) / len(rows)

    accuracy = {name: sum(env.verify(c, a) for c, a in zip(outs, answers)) / len(rows)
                for name, outs in (("before", before), ("after", after))}
    assert mean(similarity, after) > mean(similarity, before) > 0.5   # the proxy rose
    assert accuracy["after"] < 0.2 < accuracy["before"]              # the truth fell

    def gate(reward):
        return decide({"greedy_accuracy": accuracy["before"], "pass_at_k": {"8": 0.5}},
                      {"greedy_accuracy": accuracy["after"], "pass_at_k": {"8": 0.5}},
                      k=8, tolerance=0.02, reward=reward)

    hacked_run = gate((mean(similarity, before), mean(similarity, after)))
    assert not hacked_run.accepted and "reward hacking: training reward rose" in hacked_run.reason
    honest_run = gate((mean(execution, before), mean(execution, after)))
    assert "reward hacking" not in honest_run.reason   # execution reward fell with the truth
