"""The serving stage's prediction against real vLLM (the CPU build here)."""

import pytest

from posttrain.config import VLLMCheck
from posttrain.stages.serving import check_with_vllm
from posttrain.tiny_model import save_tiny_model

pytestmark = pytest.mark.slow


def test_prediction_equals_what_vllm_reports(tmp_path):
    # the default tiny model: 4 layers x 2 KV heads x dim 32 x 2 B = 1,024 B/token in bf16
    save_tiny_model(tmp_path, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=512, max_positions=64, seed=0)
    result = check_with_vllm(str(tmp_path), VLLMCheck(kv_memory_mib=64), context_length=8192)
    # 64 MiB / (128-token blocks x 1,024 B) = 512 blocks; a 64-token session takes one whole block
    assert result["vllm_context_length"] == 64 and result["vllm_block_size"] == 128
    assert result["vllm_num_blocks"] == result["predicted_num_blocks"] == 512
    assert result["vllm_kv_cache_tokens"] == result["predicted_kv_cache_tokens"] == 32_768
    assert result["vllm_max_concurrency"] == result["predicted_max_concurrency"] == 512.0
