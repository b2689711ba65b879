"""One short look at each server a command needs, before it does anything.

A dead MLflow server costs minutes of MLflow's own retries and then a traceback (and a
dead Prefect API a traceback after seconds); a command that looks first fails at once,
in one line that names the URL (without its password) and the fix.
"""

from __future__ import annotations

import socket
import ssl
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from posttrain.errors import UserError
from posttrain.redact import redact_uri

TIMEOUT_S = 3.0
# SQL stores MLflow reaches over TCP: a connection (no login) says whether one listens.
DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (for a server or rendezvous started next)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def http_problem(url: str, timeout: float = TIMEOUT_S) -> str | None:
    """Why GET `url` got no usable answer ('connection refused', 'HTTP 503', ...), None when
    it did. Any answer below 500 means a server is there (auth and routes are its business);
    nothing is sent but the request line (no credentials), so the certificate is not checked."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    bare = parts._replace(netloc=f"{host}:{parts.port}" if parts.port else str(host)).geturl()
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(bare, timeout=timeout, context=context) as response:
            status = response.status
    except urllib.error.HTTPError as err:
        status = err.code
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return "no answer within {:g} s".format(timeout) if isinstance(reason, TimeoutError) \
            else str(getattr(reason, "strerror", None) or reason)
    return f"HTTP {status}" if status >= 500 else None


def tcp_problem(host: str, port: int, timeout: float = TIMEOUT_S) -> str | None:
    """Why no TCP connection to host:port opened, None when one did."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as err:
        return err.strerror or str(err)
    return None


def check_tracking(uri: str | None, *, command: str, source: str = "MLFLOW_TRACKING_URI") -> None:
    """UserError when the MLflow tracking server (http, https) or SQL server behind `uri`
    does not answer; local stores (sqlite, file) and None pass. `source` is where the URI
    came from, which the fix names."""
    if not uri:
        return
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError:
        raise UserError(f"posttrain {command}", f"{source} {redact_uri(uri)} is not a valid URI",
                        f"correct {source}") from None
    scheme = parts.scheme.split("+")[0]
    if scheme in ("http", "https"):
        problem = http_problem(uri.rstrip("/") + "/health")
    elif scheme in DATABASE_PORTS and parts.hostname:
        problem = tcp_problem(parts.hostname, port or DATABASE_PORTS[scheme])
    else:
        return
    if problem:
        raise UserError(f"posttrain {command}", f"no MLflow tracking store answers at {redact_uri(uri)} "
                        f"(from {source}): {problem}", f"start the server, or correct {source}")


def profile_api_url() -> str | None:
    """The Prefect API the active Prefect profile names (importing Prefect takes seconds,
    which the commands that need it spend anyway)."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def check_prefect(url: str | None, *, command: str, temporary_ok: bool = True) -> None:
    """UserError when the Prefect API at `url` does not answer. With none configured,
    Prefect starts a temporary server of its own, which is fine where `temporary_ok`."""
    if not url:
        return
    problem = http_problem(url.rstrip("/") + "/health")
    if problem:
        alternative = ", or unset it to run on a temporary local server" if temporary_ok else ""
        raise UserError(f"posttrain {command}", f"no Prefect API answers at {redact_uri(url)} (PREFECT_API_URL): "
                        f"{problem}", f"start it (`prefect server start`), or correct PREFECT_API_URL{alternative}")
