"""The training-memory plan (posttrain/capacity/memory.py) against what no one here wrote: published
parameter counts, DeepSpeed's own ZeRO estimators, accelerate's model sizes; and
`posttrain memory` as a user runs it."""

from __future__ import annotations

import json

import pytest

from hardening import assert_refused, cli
from posttrain.capacity.memory import GIB, Setup, plan, shape

# Published configs (config.json fields the plan reads) and their published parameter counts.
SHAPES = {
    "Qwen2.5-0.5B": ({"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24,
                      "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
                      "tie_word_embeddings": True}, 494_032_768),
    "Mistral-7B": ({"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                    "tie_word_embeddings": False}, 7_241_732_096),
    "Qwen2.5-7B": ({"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                    "tie_word_embeddings": False}, 7_615_616_512),
    "Llama-3.1-8B": ({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                      "tie_word_embeddings": False, "attention_bias": False}, 8_030_261_248),
    "Llama-3.1-70B": ({"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "num_hidden_layers": 80,
                       "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                       "tie_word_embeddings": False, "attention_bias": False}, 70_553_706_496),
}
LAYOUTS = [(1, 1), (8, 1), (8, 4), (4, 2)]  # (GPUs per node, nodes)


@pytest.mark.parametrize("name", SHAPES)
def test_parameter_counts_match_the_published_ones(name):
    config, published = SHAPES[name]
    assert shape(config).params == published


@pytest.mark.parametrize("name", SHAPES)
def test_model_states_equal_deepspeeds_estimators(name):
    """ZeRO-2 and ZeRO-3, with and without offload, on 1 to 32 GPUs: the same bytes per GPU
    as DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs` (importable without a GPU)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    config, params = SHAPES[name]
    largest = shape(config).largest_layer
    for gpus, nodes in LAYOUTS:
        for offload in (False, True):
            ours = plan(config, Setup(zero=2, gpus=gpus, nodes=nodes, offload_optimizer=offload)).model_states_bytes
            _, theirs = estimate_zero2_model_states_mem_needs(params, gpus, nodes, cpu_offload=offload)
            assert ours == theirs, (name, gpus, nodes, offload)
        for offload, offload_params in [(False, False), (True, False), (True, True)]:
            ours = plan(config, Setup(zero=3, gpus=gpus, nodes=nodes, offload_optimizer=offload,
                                      offload_params=offload_params)).model_states_bytes
            _, theirs, _ = estimate_zero3_model_states_mem_needs(params, largest, gpus, nodes, cpu_offload=offload,
                                                                 cpu_offload_params=offload_params)
            assert ours == theirs, (name, gpus, nodes, offload, offload_params)


def test_the_size_agrees_with_accelerate():
    """accelerate's own sizes of the model built empty from the config (what `accelerate
    estimate-memory` reads from the hub): fp32 weights are 4P (plus the rotary buffer it
    counts too), and training with Adam 4x that, as posttrain's fp32 model states. An
    untied model: accelerate counts a tied output head a second time."""
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    config, params = SHAPES["Mistral-7B"]
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    total, (largest_bytes, _) = calculate_maximum_sizes(model)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert total - buffers == 4 * params
    assert plan(config, Setup(mixed_precision=False)).model_states_bytes == 4 * (total - buffers)  # "training using Adam"
    assert largest_bytes >= 4 * shape(config).largest_layer      # a block of layers, at least the embedding


def test_what_each_setting_changes():
    config, params = SHAPES["Qwen2.5-0.5B"]
    base = plan(config, Setup(method="grpo", beta=0.04, batch=8, seq=1024, completion=512))
    assert base.reference_bytes == 4 * params                 # TRL loads the reference as the policy: fp32
    assert base.model_states_bytes == 16 * params             # fp32 weights, gradients, AdamW's two moments
    bf16 = plan(config, Setup(method="grpo", beta=0.04, batch=8, seq=1024, completion=512, load_bytes=2))
    assert bf16.model_states_bytes == 8 * params and bf16.reference_bytes == 2 * params   # all in bf16
    # without gradient checkpointing autograd keeps autocast's bf16 casts of the fp32 weights
    assert base.activations_bytes - bf16.activations_bytes == 2 * params
    deepspeed = plan(config, Setup(method="grpo", beta=0.04, engine="deepspeed"))
    assert deepspeed.reference_bytes == 2 * params and deepspeed.model_states_bytes == 20 * params  # bf16 weights
    assert plan(config, Setup(method="grpo", beta=0.0)).reference_bytes == 0       # TRL drops it at beta 0
    lora = plan(config, Setup(method="grpo", beta=0.04, lora_rank=16))
    assert lora.reference_bytes == 0 and lora.trainable_params < params / 50       # adapters off = the reference
    assert lora.gradients_bytes == 4 * lora.trainable_params                      # fp32, as the adapter trains
    checkpointed = plan(config, Setup(batch=8, seq=1024, gradient_checkpointing=True))
    assert checkpointed.activations_bytes < plan(config, Setup(batch=8, seq=1024)).activations_bytes / 5
    sft = plan(config, Setup(method="sft", batch=8, seq=1024))
    grpo = plan(config, Setup(method="grpo", batch=8, seq=1024, completion=512))
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    tile = 4096 * 32768 * (2 + 4)                                    # one bf16 tile of TRL's kernel, its fp32 copy
    head = vocab * hidden * 4                                        # the head's gradient, summed in fp32
    assert sft.logits_bytes == tile + 4 * 8 * 1024 * hidden + head   # every token scored
    assert grpo.logits_bytes == tile + 4 * 8 * 512 * hidden + head   # the completion only
    small = plan(config, Setup(method="grpo", batch=2, seq=64, completion=32, lora_rank=8))
    assert small.logits_bytes == 64 * 32768 * 6 + 4 * 64 * hidden    # one short tile; a frozen head (LoRA)
    on_cpu = plan(config, Setup(method="grpo", batch=2, seq=64, completion=32, cpu=True, mixed_precision=False))
    assert on_cpu.logits_bytes == 126 * 32768 * (4 + 4 * 7) + 4 * 126 * hidden + 4 * vocab * hidden  # all positions
    assert sft.generation_bytes == 0
    colocated = plan(config, Setup(vllm_share=0.3, gpu_bytes=80 * GIB))
    assert colocated.generation_bytes == int(0.3 * 80 * GIB)
    resident = ("weights", "optimizer", "reference", "critic", "reward_model")
    for p in (base, lora, checkpointed, sft):      # one process, no accumulation: the gradients come as
        backward = max(p.activations_bytes + p.logits_bytes, p.gradients_bytes)   # the activations go
        peak = max(backward, p.generation_bytes)                                   # the KV cache goes first
        assert p.total_bytes == sum(getattr(p, f"{part}_bytes") for part in resident) + peak
        assert p.model_states_bytes == p.weights_bytes + p.gradients_bytes + p.optimizer_bytes
    assert colocated.total_bytes == sum(getattr(colocated, f"{part}_bytes") for part in resident + ("generation",)) \
        + max(colocated.activations_bytes + colocated.logits_bytes, colocated.gradients_bytes)   # vLLM stays
    for held in (Setup(accumulation=4), Setup(gpus=2), Setup(zero=2)):   # gradients outlive the step's start
        p = plan(config, held)
        backward = p.gradients_bytes + p.activations_bytes + p.logits_bytes
        assert p.total_bytes == sum(getattr(p, f"{part}_bytes") for part in resident) + \
            max(backward, p.gradients_bytes + p.generation_bytes)
    gathered = plan(config, Setup(zero=3, gpus=8, gather_for_generation=True, batch=64, seq=4096))
    assert gathered.generation_bytes == plan(config, Setup(zero=3, gpus=8, batch=64, seq=4096)).generation_bytes \
        + 2 * params                                                    # TRL gathers the whole bf16 model to sample
    assert plan(config, Setup(vllm_server=True)).generation_bytes == 0


def test_the_logit_tiles_are_trls():
    """The plan's logit tile is the one TRL's fused LM head computes in (trl 1.x)."""
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    from posttrain.capacity.memory import TILE_TOKENS, TILE_VOCAB

    assert (TILE_TOKENS, TILE_VOCAB) == (TOKEN_CHUNK_SIZE, _CHUNKED_LOGPROB_CHUNK_SIZE)


def test_critic_free_grpo_against_ppo_for_70b():
    """bf16 with AdamW before sharding, and per GPU on 8 x H100-80GB with ZeRO-3: PPO holds a
    trained critic and a frozen reward model besides the policy and the reference."""
    config, params = SHAPES["Llama-3.1-70B"]
    setups = {"ppo": Setup(method="ppo", beta=0.04, engine="deepspeed"),
              "grpo": Setup(method="grpo", beta=0.04, engine="deepspeed"),
              "grpo_beta0": Setup(method="grpo", beta=0.0, engine="deepspeed")}
    states = {k: (p.model_states_bytes + p.reference_bytes + p.critic_bytes + p.reward_model_bytes)
              for k, s in setups.items() for p in [plan(config, s)]}
    assert states["ppo"] > 600e9
    assert states["ppo"] - states["grpo"] == 20 * params + 2 * params     # the critic's states and the reward model
    assert states["grpo"] - states["grpo_beta0"] == 2 * params            # the reference
    sharded = plan(config, Setup(method="grpo", beta=0.04, zero=3, gpus=8))
    assert sharded.model_states_bytes + sharded.reference_bytes < states["grpo"] / 7


def test_the_command_prints_the_plan(tmp_path):
    config, params = SHAPES["Qwen2.5-0.5B"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = cli("memory", tmp_path, "--method", "grpo", "--beta", "0.04", "--batch", "8", "--seq", "1024",
               "--gpu", "H100-80GB", "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    for key in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "reference_bytes", "activations_bytes",
                "logits_bytes", "generation_bytes", "model_states_bytes", "total_bytes"):
        assert isinstance(figures[key], int) and figures[key] >= 0, key
    assert figures["params"] == params and figures["fits"] is True
    text = cli("memory", tmp_path, "--zero", "3", "--gpus", "8")
    assert text.returncode == 0 and "model_states_bytes" in text.stdout and "GiB" in text.stdout


@pytest.mark.parametrize("args, needles", [
    (["--gpus", "0"], ["--gpus", "out of range"]),
    (["--completion", "5000", "--seq", "1024"], ["--completion"]),
    (["--offload-params"], ["--offload-params", "--zero 3"]),
    (["--vllm-share", "0.3"], ["--vllm-share", "--gpu"]),
    (["--gpu", "Z80"], ["unknown GPU profile"]),
    (["--zero", "4"], ["--zero"]),
])
def test_bad_input_is_one_line(args, needles, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["Qwen2.5-0.5B"][0]))
    assert_refused(cli("memory", tmp_path, *args), *needles)


def test_a_model_it_cannot_plan_is_one_line(tmp_path):
    assert_refused(cli("memory", tmp_path / "nowhere"), "no config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    assert_refused(cli("memory", tmp_path), "gpt2", "dense decoder")


PROBE = """
import sys
from flows.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "trl") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("case", ["missing", "no_config", "not_json", "no_fields", "bad_field"])
def test_a_bad_model_folder_is_refused_before_torch_is_imported(case, tmp_path):
    """Issue 49: `posttrain memory` on a missing folder or a broken config.json says so
    before it imports torch or transformers (that import is seconds of CPU and ~650 MB)."""
    import subprocess
    import sys

    folder = tmp_path / "model"
    if case != "missing":
        folder.mkdir()
    body = {"not_json": "{x", "no_fields": json.dumps({"model_type": "llama"}),
            "bad_field": json.dumps({**SHAPES["Qwen2.5-0.5B"][0], "num_hidden_layers": 4.0})}.get(case)
    if body is not None:
        (folder / "config.json").write_text(body)
    done = subprocess.run([sys.executable, "-c", PROBE, "memory", str(folder)], capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("HEAVY=")]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and str(folder) in lines[0] and "fix:" in lines[0], done.stderr
    assert "HEAVY=\n" in done.stderr, done.stderr  # none of torch, transformers, trl
