"""Secrets out of anything printed or logged: passwords in URIs and the values of the
environment variables that hold credentials.

MLflow, Prefect and database drivers put the URI they were given into their error text,
password and all; every message the CLI prints passes through `redact_text`.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

# `scheme://user:password@`: the password runs to the last `@` before the host's path.
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*):[^\s/]*@")
# Variables whose whole value is a secret.
SECRET_VARIABLES = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                    "PGPASSWORD", "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING",
                    "HF_TOKEN", "DATABRICKS_TOKEN", "AZURE_STORAGE_ACCESS_KEY")
# Variables holding a URI whose password is a secret wherever it appears, even decoded.
URI_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL",
                 "DATABASE_URL")
MASK = "***"
SHORTEST = 4  # a shorter value would mask ordinary words; such a value is no secret anyway


def redact_uri(uri: str) -> str:
    """`uri` without its password (`postgresql://user:secret@host/db` -> `postgresql://user:***@host/db`)."""
    return _USERINFO.sub(rf"\1:{MASK}@", uri)


def known_secrets() -> list[str]:
    """The secret values set in this process's environment, longest first."""
    values = [os.environ.get(name, "") for name in SECRET_VARIABLES]
    for name in URI_VARIABLES:
        try:
            password = urlsplit(os.environ.get(name, "")).password or ""
        except ValueError:  # an unparsable URI: its userinfo is masked by the pattern
            continue
        values += [password, unquote(password)]
    return sorted({v for v in values if len(v) >= SHORTEST}, key=len, reverse=True)


def redact_text(text: str) -> str:
    """`text` with URI passwords and known secret values replaced by `***`."""
    text = redact_uri(text)
    for secret in known_secrets():
        text = text.replace(secret, MASK)
    return text


class RedactingStream:
    """A text stream that masks secrets in what is written to it, and is otherwise the
    stream it wraps (isatty, fileno, encoding: a terminal stays a terminal for rich).

    Libraries print URIs on their own: MLflow writes "View run ... at: <tracking URI>"
    to sys.stdout when a run ends, password and all. Masked per write: a library writes
    a URI in one call."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact_text(text) if isinstance(text, str) else text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard_standard_streams() -> None:
    """sys.stdout and sys.stderr mask secrets from here on, in this process and in the
    logging handlers created after it (call it before the libraries are imported)."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
