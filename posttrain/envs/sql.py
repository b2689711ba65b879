"""Text-to-SQL with execution grading: `count sales over age 40 =` -> `SELECT COUNT(*) ...`.

A small SQLite database (one `emp` table: name, dept, age, salary) is generated from
`db_seed`, and questions come from templates filled with its departments and with
thresholds, each with a gold query. Nothing is downloaded.

A completion is correct when it runs and returns the gold query's rows: compared as
multisets, and in order only when the gold query orders (ages and salaries are unique,
so an ordering has one right answer). Queries run in `posttrain.sandbox`: read-only,
one statement, a time limit; errors and timeouts are simply wrong.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sqlite3
import tempfile
from collections import Counter
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator

from posttrain.envs.base import EnvOptions, Exploit
from posttrain.errors import OptionError, invalid
from posttrain.sandbox import QueryError, run_query

DEPTS = ["sales", "ops", "hr", "it", "legal", "ads"]
NAMES = ["ann", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "jo", "kai", "lu", "max", "ned", "oli",
         "pam", "quin", "rex", "sam", "tia", "uma", "vic", "wes", "xia", "yan", "zed", "abe", "bo", "cat", "dan",
         "eli", "fin", "gia", "hui", "ida", "jay"]
SCHEMA = "CREATE TABLE emp (name TEXT PRIMARY KEY, dept TEXT NOT NULL, age INTEGER NOT NULL, salary INTEGER NOT NULL)"
DB_VERSION = 2  # bump when build_database changes: the cached file is keyed by it
AGES = range(21, 65)
SALARIES = range(30, 100)  # thousands

# (question, gold query); {d} a department, {n} a threshold of the kind the template names
TEMPLATES = [
    ("count {d}", "SELECT COUNT(*) FROM emp WHERE dept='{d}'", None),
    ("names in {d}", "SELECT name FROM emp WHERE dept='{d}'", None),
    ("max salary in {d}", "SELECT MAX(salary) FROM emp WHERE dept='{d}'", None),
    ("min age in {d}", "SELECT MIN(age) FROM emp WHERE dept='{d}'", None),
    ("{d} by age", "SELECT name FROM emp WHERE dept='{d}' ORDER BY age", None),
    ("names over age {n}", "SELECT name FROM emp WHERE age>{n}", AGES),
    ("count over age {n}", "SELECT COUNT(*) FROM emp WHERE age>{n}", AGES),
    ("names paid over {n}", "SELECT name FROM emp WHERE salary>{n}", SALARIES),
    ("count {d} over age {n}", "SELECT COUNT(*) FROM emp WHERE dept='{d}' AND age>{n}", AGES),
    ("{d} paid over {n}", "SELECT name FROM emp WHERE dept='{d}' AND salary>{n}", SALARIES),
]
_ORDERED = re.compile(r"\border\s+by\b", re.IGNORECASE)
_FENCE = re.compile(r"^\s*```[a-zA-Z]*\n(.*?)\n?```\s*$", re.DOTALL)


def build_database(path: Path, *, employees: int, seed: int) -> None:
    """Write the database to `path` atomically (a reader never sees it half-built)."""
    rng = random.Random(seed)
    names = rng.sample(NAMES, employees)
    ages, salaries = rng.sample(list(AGES), employees), rng.sample(list(SALARIES), employees)
    depts = DEPTS[:employees] + [rng.choice(DEPTS) for _ in range(employees - len(DEPTS))]  # every dept staffed
    rows = list(zip(names, depts, ages, salaries))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    with sqlite3.connect(tmp) as conn:
        conn.execute(SCHEMA)
        conn.executemany("INSERT INTO emp VALUES (?, ?, ?, ?)", rows)
    conn.close()
    os.replace(tmp, path)


def questions() -> list[tuple[str, str]]:
    """(question, gold query) for every template, department and threshold."""
    return [(question.format(d=dept, n=n), gold.format(d=dept, n=n))
            for question, gold, values in TEMPLATES
            for dept in (DEPTS if "{d}" in question else [None])
            for n in (values if values is not None else [None])]


class SQLOptions(EnvOptions):
    """`data.options` of the SQL environment."""
    employees: int = Field(30, ge=1, le=len(NAMES), description="Rows of the `emp` table.")
    db_seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the generated table.")
    heldout_size: int = Field(150, ge=0, description="Questions held out for evaluation; the rest train.")
    timeout_s: float = Field(1.0, gt=0, le=60, description="Time limit of one query in the sandbox (seconds).")
    db_dir: str | None = Field(None, min_length=1, description="Folder of the database file; null = the "
                                                                "system's temporary folder.")
    prompt_format: str = Field("{question} =", max_length=2000, description="The prompt; names {question} (and "
                               "may name {schema}, the table's CREATE statement), e.g. `{schema}\\n\\n{question}`.")
    system: str | None = Field(None, max_length=20_000, description="System prompt of conversational prompts "
                               "(data.chat); may name {schema}. null: the model template's own default.")

    @field_validator("prompt_format")
    @classmethod
    def _names_the_question(cls, fmt):
        try:
            fmt.format(question="q", schema=SCHEMA)
        except (ValueError, KeyError, IndexError, AttributeError):
            raise invalid("may name only {question} and {schema}", "write literal braces as {{ }}") from None
        if "{question}" not in fmt:
            raise invalid("does not name {question}", "e.g. `{question} =` or `Question: {question}`")
        return fmt

    @field_validator("heldout_size")
    @classmethod
    def _rows_left_to_train(cls, heldout_size):
        rows = len(questions())
        if heldout_size >= rows:
            raise invalid(f"{heldout_size} leaves none of the {rows} questions to train on", f"use at most {rows - 1}")
        return heldout_size


class SQLEnv:
    name = "sql"
    Options = SQLOptions

    def __init__(self, employees: int = 30, db_seed: int = 0, heldout_size: int = 150,
                 timeout_s: float = 1.0, db_dir: str | None = None, prompt_format: str = "{question} =",
                 system: str | None = None):
        self.employees, self.db_seed, self.heldout_size, self.timeout_s = employees, db_seed, heldout_size, timeout_s
        self.prompt_format = prompt_format
        self.system = system.replace("{schema}", SCHEMA) if system else None  # the chat's system turn
        digest = hashlib.sha256(f"{DB_VERSION}|{SCHEMA}|{employees}|{db_seed}|{NAMES}|{DEPTS}".encode()).hexdigest()[:12]
        self.db_path = Path(db_dir or tempfile.gettempdir()) / f"posttrain-sql-{digest}.db"
        if not self.db_path.is_file():
            try:
                build_database(self.db_path, employees=employees, seed=db_seed)
            except (OSError, sqlite3.Error) as err:
                raise OptionError("db_dir", f"cannot write the database there ({getattr(err, 'strerror', None) or err})",
                                  "use a writable folder, or null for the system's temporary folder") from None

    def generate(self, seed: int) -> dict[str, list[dict]]:
        """Every template filled with every department and threshold, split train / heldout."""
        rows = [self.row(question, gold) for question, gold in questions()]
        random.Random(seed).shuffle(rows)
        return {"train": rows[self.heldout_size:], "heldout": rows[:self.heldout_size]}

    def row(self, question: str, gold: str) -> dict:
        return {"prompt": self.prompt_format.format(question=question, schema=SCHEMA), "completion": f" {gold}",
                "answer": gold}

    def parse(self, completion: str) -> str | None:
        """The query in the completion: it must start with SELECT, alone or in one Markdown code
        block (instruct models fence their SQL); a trailing `;` is dropped."""
        fenced = _FENCE.search(completion)
        query = (fenced.group(1) if fenced else completion).strip().rstrip(";").strip()
        return query if query[:6].upper() == "SELECT" else None

    def execute(self, query: str) -> list[tuple] | None:
        """The rows `query` returns in the sandbox, or None when it fails or times out."""
        try:
            return run_query(self.db_path, query, timeout_s=self.timeout_s)
        except QueryError:
            return None

    def verify(self, completion: str, answer: str) -> bool:
        query = self.parse(completion)
        if query is None:
            return False
        got, want = self.execute(query), _gold_rows(self, answer)
        if got is None or want is None:
            return False
        return got == want if _ORDERED.search(answer) else Counter(got) == Counter(want)


    def exploits(self, row: dict) -> list:
        """The SQL families of the reward audit (posttrain.scoring.audit): queries built
        from the gold one that return other rows, and writes; those the execution finds
        right for this row are dropped (a tautology on a query that already reads every row)."""
        gold = row["answer"].strip().rstrip(";")
        wrong = {"SELECT *": "SELECT * FROM emp",
                 "tautology": re.sub(r"\bWHERE\b", "WHERE 1=1 OR", gold, count=1, flags=re.IGNORECASE),
                 "doubled union": f"SELECT * FROM ({gold}) UNION ALL SELECT * FROM ({gold})",
                 "LIMIT drops rows": f"SELECT * FROM ({gold}) LIMIT 1",
                 "flipped comparison": _FLIP.sub(lambda m: _FLIPPED[m.group(0)], gold, count=1),
                 "changed literal": _LITERAL.sub(lambda m: str(int(m.group(0)) + 7), gold, count=1),
                 "write": "DELETE FROM emp", "drop": "DROP TABLE emp", "attach": "ATTACH DATABASE 'x.db' AS x"}
        found = [Exploit(family, query) for family, query in wrong.items()
                 if query != gold and not self.verify(query, gold)]
        return found + [Exploit("reordered rows", f"SELECT * FROM ({gold}) ORDER BY 1 DESC", "variant")]


_FLIP = re.compile(r">=|<=|>|<")  # near misses a string grader pays: `age>35` and `age<35` are 83% alike
_FLIPPED = {">=": "<", "<=": ">", ">": "<", "<": ">"}
_LITERAL = re.compile(r"(?<![\w.])\d+(?![\w.])")


@lru_cache(maxsize=4096)
def _gold_rows(env: SQLEnv, gold: str) -> list[tuple] | None:
    return env.execute(gold)
