"""The serving stage's prediction against real vLLM (the CPU build here): one server
answers both the capacity check and the load test."""

import pytest

from posttrain.config import ServingSection
from posttrain.stages.serving import check_with_vllm
from posttrain.training.tiny_model import save_tiny_model

pytestmark = pytest.mark.slow


def test_one_vllm_server_reports_the_predicted_capacity_and_takes_the_load(tmp_path):
    # the default tiny model: 4 layers x 2 KV heads x dim 32 x 2 B = 1,024 B/token in bf16
    # (vLLM's CPU attention does not take head_dim 16, as SMALL has)
    save_tiny_model(tmp_path, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=512, max_positions=64, seed=0)
    serving = ServingSection(context_length=8192, vllm_check={"kv_memory_mib": 64},
                             load_test={"requests": 48, "concurrency": 16, "max_num_seqs": 4, "max_tokens": 4})
    result = check_with_vllm(str(tmp_path), serving, [f"{a}+{b}=" for a in range(4) for b in range(4)])
    # 64 MiB / (128-token blocks x 1,024 B) = 512 blocks; a 64-token session takes one whole block
    assert result["vllm_context_length"] == 64 and result["vllm_block_size"] == 128
    assert result["vllm_num_blocks"] == result["predicted_num_blocks"] == 512
    assert result["vllm_kv_cache_tokens"] == result["predicted_kv_cache_tokens"] == 32_768
    assert result["vllm_max_concurrency"] == result["predicted_max_concurrency"] == 512.0
    # the same server, queueing more requests than its 4 sequences at once
    assert result["load_requests"] == 48 and result["load_failed_requests"] == 0
    assert result["load_requests_per_second"] > 0 and result["load_output_tokens_per_second"] > 0
    assert 0 < result["load_latency_p50_ms"] <= result["load_latency_p95_ms"] <= result["load_latency_p99_ms"]


def test_the_load_test_replays_multi_turn_tool_sessions(tmp_path):
    """A model that calls the calculator, served by vLLM: each replayed session is two
    requests (the call, then the answer after the tool's result), the tool runs between
    them, the answer verifies, and no session grows past the size the report predicts."""
    from chat_model import memorized_model
    from transformers import AutoTokenizer

    from posttrain.envs.calculator import CalculatorEnv
    from posttrain.envs.tools import ToolLimits

    env = CalculatorEnv()
    row = env.generate(0)["train"][0]
    folder = memorized_model(tmp_path / "model", row, env)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cap = 96
    predicted = len(tokenizer.apply_chat_template([{"role": "system", "content": env.system},
                                                   {"role": "user", "content": row["prompt"]}],
                                                  tools=[env.episode().calc], add_generation_prompt=True,
                                                  return_dict=False)) + cap
    serving = ServingSection(context_length=1024, vllm_check={"enabled": False, "kv_memory_mib": 64},
                             load_test={"requests": 6, "concurrency": 3, "max_num_seqs": 2})
    sessions = {"rows": [row], "tokenizer": tokenizer, "env": env, "max_tokens": cap, "limits": ToolLimits(),
                "predicted_tokens": predicted}
    result = check_with_vllm(str(folder), serving, [], sessions)
    assert result["load_sessions"] == 6 and result["load_failed_sessions"] == 0, result
    assert result["load_requests"] == 12 and result["load_turns_per_session"] == 2
    assert result["load_tool_calls_per_session"] == 1 and result["load_tool_errors_per_session"] == 0
    assert result["load_correct_rate"] == 1.0
    assert 0 < result["load_peak_session_tokens"] <= predicted
    assert 0 < result["load_session_latency_p50_ms"] <= result["load_session_latency_p95_ms"]
