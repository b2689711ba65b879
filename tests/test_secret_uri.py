"""A password inside MLFLOW_TRACKING_URI (an MLflow server over http, then PostgreSQL
directly) reaches no file a run writes: the workspace (its record of the last finished run
included), the MLflow server's artifacts and log, Prefect's database, nor a row of the
MLflow store itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import SMALL, make_workspace, sh
from servers import POSTGRES, mlflow_server, postgres_database

pytestmark = pytest.mark.slow

PASSWORD = "pw-3e9d1c7a55f0"


def store_rows_holding(database: str, needle: str) -> list[str]:
    """Every table of the MLflow store in `database` whose rows hold `needle`."""
    import psycopg2

    with psycopg2.connect(f"postgresql://{POSTGRES}/{database}") as conn, conn.cursor() as cur:
        cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")
        tables = [name for (name,) in cur.fetchall()]
        found = []
        for table in tables:
            cur.execute(f'SELECT * FROM "{table}"')
            if any(needle in str(row) for row in cur.fetchall()):
                found.append(table)
    return found


def test_a_password_in_the_tracking_uri_reaches_no_file(tmp_path):
    from prefect.settings import PREFECT_HOME

    ws = make_workspace(tmp_path / "ws", SMALL)
    with postgres_database() as served, postgres_database() as direct:
        with mlflow_server(tmp_path, served) as url:
            http = url.replace("http://", f"http://user:{PASSWORD}@")
            sh("posttrain", "run", "--workdir", ws, cwd=ws, env={"MLFLOW_TRACKING_URI": http})
        # another store, the stages all up to date: the run records them there
        postgres = f"postgresql+psycopg2://postgres:{PASSWORD}@127.0.0.1:5432/{direct}"
        second = sh("posttrain", "run", "--workdir", ws, cwd=ws, env={"MLFLOW_TRACKING_URI": postgres})
        assert "MLflow run:" in second.stdout and PASSWORD not in second.stdout + second.stderr
        assert store_rows_holding(served, PASSWORD) == [] and store_rows_holding(direct, PASSWORD) == []
        assert store_rows_holding(direct, "evaluate") != []       # the needle search reads the rows
    files = [p for p in [*ws.rglob("*"), *tmp_path.glob("mlflow-*/**/*"), tmp_path / "mlflow-server.log",
                         *Path(PREFECT_HOME.value()).glob("*.db*")] if p.is_file()]
    assert (ws / ".dvc" / "tmp" / "posttrain-finished.json") in files
    assert [str(p) for p in files if PASSWORD.encode() in p.read_bytes()] == []
