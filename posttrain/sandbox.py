"""Running model-written SQL safely: read-only, one statement, a time limit, bounded rows.

Model output is never trusted. A query runs on a connection that
- opens the database file read-only (`mode=ro`), so nothing can be written to it;
- has an authorizer that allows reading and nothing else: INSERT, UPDATE, DELETE,
  CREATE, DROP, ALTER, ATTACH, DETACH, PRAGMA, transactions are all refused;
- is interrupted when it runs past `timeout_s` (a progress handler), so a query that
  would run forever (a recursive CTE without a bound, a huge cross join) ends;
- returns at most `max_rows` rows and refuses more than one statement.
Errors of any kind come back as `QueryError`; callers score them as wrong.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

# Authorizer action codes that only read. Everything else is denied.
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}


class QueryError(Exception):
    """The query was refused, failed, timed out or returned too much."""


def _authorize(action, arg1, arg2, db_name, trigger):
    if action not in _ALLOWED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def run_query(db_path: str | Path, sql: str, *, timeout_s: float = 1.0, max_rows: int = 1000) -> list[tuple]:
    """The rows `sql` returns on the database at `db_path`, under the sandbox above."""
    uri = f"{Path(db_path).resolve().as_uri()}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False)
    except sqlite3.Error as err:
        raise QueryError(f"cannot open {db_path}: {err}") from None
    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)      # no giant strings or blobs
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)            # no other databases
        conn.set_authorizer(_authorize)
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
        cursor = conn.execute(sql)  # execute() itself refuses a second statement
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
    finally:
        conn.close()
