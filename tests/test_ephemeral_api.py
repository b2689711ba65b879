"""The one place posttrain reaches into Prefect's private code (flows/ephemeral_api.py): the
temporary API server's module gets a `subprocess` whose Popen arms the parent-death signal,
so a kill -9 of `posttrain run` takes the server with it (tests/test_crash.py checks that end
to end). These tests fail, naming what moved, when a Prefect upgrade changes what the swap
relies on, instead of the swap silently doing nothing."""

from __future__ import annotations

import inspect
import os
import subprocess
import types


def test_prefect_starts_its_temporary_server_with_the_module_level_subprocess_popen():
    from prefect.server.api import server

    assert isinstance(getattr(server, "subprocess", None), (types.ModuleType, types.SimpleNamespace)), \
        "prefect.server.api.server no longer imports subprocess: flows/ephemeral_api.py's swap does nothing"
    source = inspect.getsource(server.SubprocessASGIServer._run_uvicorn_command)
    assert "subprocess.Popen(" in source, "SubprocessASGIServer no longer starts uvicorn with subprocess.Popen"


def test_the_swap_keeps_subprocess_whole_and_popen_arms_the_parent_death_signal():
    from prefect.server.api import server

    from flows import ephemeral_api

    from prefect.context import refresh_global_settings_context

    saved = server.subprocess
    auth = {name: os.environ.get(name) for name in ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING")}
    try:
        server.subprocess = subprocess
        ephemeral_api.bind_to_process()
        swapped = server.subprocess
        assert swapped.Popen is ephemeral_api._Popen and issubclass(swapped.Popen, subprocess.Popen)
        assert swapped.TimeoutExpired is subprocess.TimeoutExpired and swapped.PIPE == subprocess.PIPE
    finally:  # the auth string bind_to_process sets would reach servers later tests start
        server.subprocess = saved
        for name, value in auth.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
        refresh_global_settings_context()
