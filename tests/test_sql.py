"""The text-to-SQL environment: execution grading and reward hacking (the sandbox
its queries run in: tests/test_sandbox.py)."""

import pytest

from posttrain.envs import get_env
from posttrain.scoring.gate import decide
from posttrain.scoring.rewards import build_rewards


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


@pytest.mark.parametrize("completion,query", [
    ("SELECT 1;", "SELECT 1"),                              # plain, a trailing semicolon dropped
    ("```sql\nSELECT name FROM emp\n```", "SELECT name FROM emp"),  # an instruct model's fenced reply
    ("```\nSELECT 1\n```\n", "SELECT 1"),                   # a fence without a language
    ("Here it is: SELECT 1", None),                         # prose first: not a query
])
def test_parse_reads_a_query_alone_or_fenced(env, completion, query):
    assert env.parse(completion) == query


def test_a_chat_prompt_carries_the_schema():
    from posttrain.envs.sql import SCHEMA, SQLEnv

    env = SQLEnv(prompt_format="Question: {question}", system="Table: {schema}. One query.")
    row = env.generate(0)["heldout"][0]
    assert row["prompt"].startswith("Question: ") and env.system == f"Table: {SCHEMA}. One query."
    assert env.verify(row["completion"], row["answer"])
