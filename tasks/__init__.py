"""Prefect tasks: each wraps one side effect. Retries and timeouts live here."""
