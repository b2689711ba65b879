"""User-facing errors: one line that names the file or field and the fix."""


class UserError(Exception):
    """Bad input (config, data, model path, CLI argument).

    The CLI prints `str(err)` on one line to stderr and exits 2, with no traceback.
    Raise it before any compute so nothing is half-written.
    """

    def __init__(self, where: str, problem: str, fix: str):
        self.where, self.problem, self.fix = where, problem, fix
        super().__init__(f"{where}: {problem}; fix: {fix}")


class GateFailure(Exception):
    """A gate the pipeline must pass was not met (a serving SLO, say): the CLI prints the
    one-line reason and exits 3, so the stage, DVC and the flow all stop there."""


class PredictionMismatch(GateFailure):
    """vLLM disagrees with the KV estimator: the arithmetic no longer describes the engine.
    A gate like any other (one line, exit 3), not a crash."""


class ReplayError(RuntimeError):
    """`posttrain replay` itself failed (a clone, a pull, the rerun), as opposed to metrics
    that differ: the CLI prints the one-line reason and exits 4."""
