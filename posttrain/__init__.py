"""posttrain: pipeline-orchestrated LLM post-training (SFT warmup, GRPO stages,
serving-capacity check, evaluation), versioned with DVC and tracked in MLflow.

The library is importable without Prefect; `flows/` and `tasks/` orchestrate it.
"""

__version__ = "0.1.0"

import logging as _logging

# bitsandbytes (8-bit optimizers; peft imports it whenever it is installed) warns at import, on
# CPUs with AVX512-BF16, that it could not fetch an optional 4-bit matmul kernel from the Hub:
# nothing posttrain uses, and a Hub download posttrain never wants. Kept off stderr, where a
# refused command prints its one line.
_bnb_cpu = _logging.getLogger("bitsandbytes.backends.cpu.ops")
_bnb_cpu.addHandler(_logging.NullHandler())
_bnb_cpu.propagate = False
