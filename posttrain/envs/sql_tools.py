"""Text-to-SQL with a query tool: the `sql` task, where the model may look at the data first.

The episode's tool `query(sql)` runs a read-only query in the same sandbox that grades
(posttrain.sandbox: one statement, a time limit, a row cap, an authorizer that
refuses writes and ATTACH) and shows the first rows; the model then replies with its
query, graded by execution against the gold query's rows as in `sql`. Each row's gold
episode runs the gold query once, reads its rows, and answers with it.
"""

from __future__ import annotations

import functools

from pydantic import Field

from posttrain.envs.sql import SQLEnv, SQLOptions
from posttrain.sandbox import QueryError, run_query

SHOWN_ROWS = 20


class SQLEpisode:
    """One episode on the task's database."""

    def __init__(self, db_path: str, timeout_s: float):
        self.db_path, self.timeout_s = db_path, timeout_s

    def reset(self, **row) -> None:
        return None

    def query(self, sql: str) -> str:
        """Run one read-only SQLite query on the table and see its first rows.

        Args:
            sql: One SELECT statement, for example "SELECT * FROM emp LIMIT 3".
        """
        try:
            rows = run_query(self.db_path, sql, timeout_s=self.timeout_s)
        except QueryError as err:
            raise ValueError(str(err)) from None
        shown = "\n".join(", ".join(map(str, r)) for r in rows[:SHOWN_ROWS])
        more = f"\n... (more than {SHOWN_ROWS} rows)" if len(rows) > SHOWN_ROWS else ""
        return (shown + more) if rows else "(no rows)"


class SQLToolsOptions(SQLOptions):
    """`data.options` of the sql_tools environment: sql's, and the episode's turns."""
    system: str | None = Field("You write one SQLite query for the table {schema}. You may run queries with the "
                               "query tool to look at the data. Reply with the final query only.", max_length=20_000,
                               description="System prompt (before the tools' descriptions); may name {schema}.")
    max_turns: int = Field(3, ge=1, le=20, description="Tool-calling rounds an episode may take.")
    prompt_format: str = Field("{question}", max_length=2000, description="The user turn; names {question} (and "
                               "may name {schema}).")


class SQLToolsEnv(SQLEnv):
    name = "sql_tools"
    Options = SQLToolsOptions

    def __init__(self, max_turns: int = 3, system: str | None = SQLToolsOptions().system,
                 prompt_format: str = "{question}", **options):
        super().__init__(system=system, prompt_format=prompt_format, **options)
        self.max_turns = max_turns
        self.episode = functools.partial(SQLEpisode, str(self.db_path), self.timeout_s)

    def row(self, question: str, gold: str) -> dict:
        row = super().row(question, gold)
        call = {"type": "function", "function": {"name": "query", "arguments": {"sql": gold}}}
        result = self.episode().query(gold)
        row["trace"] = [{"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "name": "query", "content": result},
                        {"role": "assistant", "content": gold}]
        return row
