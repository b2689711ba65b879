"""User-facing errors: one line that names the file or field and the fix."""

_LINE_BREAKS = str.maketrans({"\n": "\\n", "\r": "\\r", "\x0b": "\\v", "\x0c": "\\f", "\x1c": "\\x1c",
                              "\x1d": "\\x1d", "\x1e": "\\x1e", "\x85": "\\x85", "\u2028": "\\u2028",
                              "\u2029": "\\u2029"})


def one_line(text: str) -> str:
    """`text` with every character Python splits lines at written as its escape: a key or
    value from the input (a YAML key holding a newline) cannot break the error's one line."""
    return str(text).translate(_LINE_BREAKS)


class UserError(Exception):
    """Bad input (config, data, model path, CLI argument).

    The CLI prints `str(err)` on one line to stderr and exits 2, with no traceback.
    Raise it before any compute so nothing is half-written.
    """

    def __init__(self, where: str, problem: str, fix: str):
        self.where, self.problem, self.fix = where, problem, fix
        super().__init__(one_line(f"{where}: {problem}; fix: {fix}"))


class GateFailure(Exception):
    """A gate the pipeline must pass was not met (a serving SLO, say): the CLI prints the
    one-line reason and exits 3, so the stage, DVC and the flow all stop there."""


class PredictionMismatch(GateFailure):
    """vLLM disagrees with the KV estimator: the arithmetic no longer describes the engine.
    A gate like any other (one line, exit 3), not a crash."""


class HarnessMismatch(GateFailure):
    """lm-evaluation-harness and posttrain's evaluator disagree on a model's greedy accuracy
    beyond a prompt on the same prompts: one of them misreads the model (one line, exit 3)."""


class ReplayError(RuntimeError):
    """`posttrain replay` itself failed (a clone, a pull, the rerun), as opposed to metrics
    that differ: the CLI prints the one-line reason and exits 4."""


class TrainingFailed(RuntimeError):
    """A launched training job failed (posttrain.runtime.launch): a rank raised, or was killed. The
    CLI prints the one-line reason and exits 1; the launcher has ended the other ranks."""


class StageFailed(RuntimeError):
    """A pipeline stage the flow ran failed: `str()` is one line (which stage, DVC's exit
    code, the stage's own last word, where its output is); `tail`: its last output lines,
    for the Prefect task run. The CLI prints the line and exits 1."""

    def __init__(self, line: str, tail: str = ""):
        super().__init__(line)
        self.tail = tail


class OptionError(ValueError):
    """An environment option that passed its schema but cannot be used where it points
    (a `db_dir` that cannot be created): the config check reports it as a `UserError` at
    `data.options.<option>`, before anything else is written."""

    def __init__(self, option: str, problem: str, fix: str):
        self.option, self.problem, self.fix = option, problem, fix
        super().__init__(f"{option}: {problem}; fix: {fix}")


def invalid(problem: str, fix: str):
    """A pydantic error that carries its fix: raised in a schema validator, the config
    check prints it as `file: field: problem; fix: fix` (posttrain.yamlfile.schema_error)."""
    from pydantic_core import PydanticCustomError

    return PydanticCustomError("posttrain", "{problem}", {"problem": problem, "fix": fix})
