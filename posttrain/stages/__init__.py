"""One entry module per pipeline stage, each with `main(config, *, ...) -> dict[str, float]`,
and what each declares before it is imported (importing a stage imports torch and TRL:
seconds), for `posttrain stage NAME` to check its flags and warm its imports by.

The stage order lives in dvc.yaml alone; the stage modules do not know about each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Declared:
    """A stage's declaration. `flags`: its `main`'s keyword-only parameters without a default,
    in order, as `posttrain stage NAME --flag value` takes them (dvc.yaml's `cmd` passes them;
    tests/test_cli.py checks them against the signature). `imports`: (module, name) pairs its
    work imports, imported before it starts: seconds on a small machine (TRL imports vLLM when
    it is installed), which `make bench` counts as the stage process's start-up, not as its
    compute (`compute.<part>_seconds`, posttrain.tracking.mlflow_runs)."""

    flags: tuple[str, ...]
    imports: tuple[tuple[str, str], ...] = ()


STAGES: dict[str, Declared] = {
    "prepare": Declared(("data_dir", "datasets_dir", "model_dir", "metrics_path"),
                        (("transformers", "AutoModelForCausalLM"),)),
    "sft": Declared(("data_dir", "base_dir", "out_dir", "checkpoint_dir", "metrics_path", "curve_path"),
                    (("trl", "SFTTrainer"), ("datasets", "Dataset"))),
    "grpo": Declared(("name", "data_dir", "init_dir", "out_dir", "checkpoint_dir", "metrics_path", "curve_path",
                      "audit_path", "layers_path"), (("trl", "GRPOTrainer"), ("datasets", "Dataset"))),
    "serving": Declared(("data_dir", "models_dir", "gpus_path", "report_path", "metrics_path", "plot_path")),
    "evaluate": Declared(("data_dir", "models_dir", "metrics_path", "outcomes_path", "accuracy_plot",
                          "pass_at_k_plot", "pass_at_k_png"), (("transformers", "AutoModelForCausalLM"),)),
}
