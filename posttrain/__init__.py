"""posttrain: pipeline-orchestrated LLM post-training (SFT warmup, GRPO stages,
serving-capacity check, evaluation), versioned with DVC and tracked in MLflow.

The library is importable without Prefect; `flows/` and `tasks/` orchestrate it.
"""

__version__ = "0.1.0"
