"""KV-cache arithmetic on public model shapes (values from their published config.json)."""

import pytest

from posttrain.capacity.kv import capacity, concurrency_by_context, estimate_params, kv_spec, paging, tp_sizes

LLAMA_31_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096, "torch_dtype": "bfloat16"}
QWEN25_05B = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "hidden_size": 896, "torch_dtype": "bfloat16"}
QWEN3_8B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "head_dim": 128, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
# The 27B hybrid of the shared REFERENCE: 16 full-attention layers (4 KV heads of dim 256)
# among 64, the others linear attention with a fixed per-sequence state.
HYBRID_27B = {"num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
              "hidden_size": 5120, "torch_dtype": "bfloat16",
              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16}
# Alternating local/global attention with a 4,096-token window (Gemma-2 style).
SLIDING = {**LLAMA_31_8B, "sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"] * 16}


@pytest.mark.parametrize("config,tp,kv_dtype,expected", [
    (LLAMA_31_8B, 1, "auto", 131_072),                  # GQA: 2 x 32 layers x 8 heads x 128 x 2 B
    (LLAMA_31_8B, 4, "auto", 32_768),                   # TP splits the 8 KV heads 2 per GPU
    (LLAMA_31_8B, 16, "auto", 16_384),                  # fewer KV heads than GPUs: replicated, 1 per GPU
    (LLAMA_31_8B, 1, "fp8", 65_536),                    # fp8 KV: 1 byte per value
    (QWEN25_05B, 1, "auto", 12_288),                    # head_dim from hidden_size / heads = 64
    (QWEN3_8B, 1, "auto", 147_456),                     # explicit head_dim
    (DEEPSEEK_V3, 1, "auto", 70_272),                   # MLA: (512 + 64) x 61 layers x 2 B
    (DEEPSEEK_V3, 8, "auto", 70_272),                   # MLA latents are not split by TP
    (HYBRID_27B, 1, "auto", 65_536),                    # only full-attention layers hold per-token KV
    ({**LLAMA_31_8B, "torch_dtype": "float32"}, 1, "auto", 131_072),  # fp32 checkpoints served as 16-bit
])
def test_kv_bytes_per_token(config, tp, kv_dtype, expected):
    assert kv_spec(config, tp=tp, kv_dtype=kv_dtype).kv_bytes_per_token == expected


def test_hybrid_session_of_8k_tokens_holds_512_mib():
    assert kv_spec(HYBRID_27B).session_bytes(8192) == 512 * 2**20


def test_sliding_layers_hold_at_most_the_window():
    spec = kv_spec(SLIDING)
    per_layer = 2 * 8 * 128 * 2
    assert spec.session_bytes(1000) == 32 * 1000 * per_layer
    assert spec.session_bytes(16384) == per_layer * (16 * 16384 + 16 * 4096)


@pytest.mark.parametrize("kv_memory,context,blocks,tokens,concurrency", [
    (64 * 2**20, 256, 512, 65_536, 256.0),      # seen here with vLLM CPU: 64 MiB, block 128
    (2**30, 256, 8192, 1_048_576, 4096.0),      # seen here with vLLM CPU: 1 GiB
    (2**30, 300, 8192, 819_200, 8192 / 3),      # 300 tokens need 3 whole blocks of 128
    (64 * 2**20, 64, 512, 32_768, 512.0),       # seen here: a 64-token context still takes a whole block
])
def test_capacity_counts_whole_blocks(kv_memory, context, blocks, tokens, concurrency):
    tiny = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
    cap = capacity(kv_spec(tiny), kv_memory_bytes=kv_memory, block_size=128, context_length=context)
    assert (cap.num_blocks, cap.kv_cache_tokens, cap.block_tokens) == (blocks, tokens, blocks * 128)
    assert cap.max_concurrency == pytest.approx(concurrency)


TINY = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}


@pytest.mark.parametrize("lengths,paged,reserved,paged_waste,reserved_waste", [
    ([1024], 8.0, 8.0, 0.0, 0.0),              # every session uses the whole context: no difference
    ([512], 16.0, 8.0, 0.0, 0.5),              # half-length sessions: paging fits twice as many
    ([100], 64.0, 8.0, 0.21875, 0.90234375),   # short sessions: one 128-token block each, 28 slots idle
    ([128, 896], 16.0, 8.0, 0.0, 0.5),         # a mix averaging half the context
])
def test_paging_against_reserving_the_context(lengths, paged, reserved, paged_waste, reserved_waste):
    # 64 blocks of 128 tokens; sessions of up to 1,024 tokens (8 blocks)
    result = paging(kv_spec(TINY), num_blocks=64, block_size=128, context_length=1024, session_lengths=lengths)
    assert (result.paged_sessions, result.reserved_sessions) == pytest.approx((paged, reserved))
    assert (result.paged_waste, result.reserved_waste) == pytest.approx((paged_waste, reserved_waste))


def test_concurrency_halves_as_the_context_doubles():
    points = concurrency_by_context(kv_spec(TINY), kv_memory_bytes=2**30, block_size=16, contexts=[1024, 2048, 4096])
    assert [p["max_concurrency"] for p in points] == [1024.0, 512.0, 256.0]


@pytest.mark.parametrize("config,billions", [
    ({**LLAMA_31_8B, "intermediate_size": 14336, "vocab_size": 128256}, 8.03),   # Llama-3.1-8B: 8.03B
    ({**QWEN25_05B, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}, 0.49),  # 0.49B
])
def test_parameter_estimate_from_config_alone(config, billions):
    assert estimate_params(config) / 1e9 == pytest.approx(billions, rel=0.02)


@pytest.mark.parametrize("config,sizes", [
    (TINY, [1, 2, 4]),                                   # 4 heads, 2 KV heads: 4 GPUs hold a replica of one KV head each
    (LLAMA_31_8B, [1, 2, 4, 8, 16, 32]),                 # 32 heads, 8 KV heads
    ({**TINY, "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 768}, [1, 2, 4, 12]),  # 6 splits 12, not 4
    (DEEPSEEK_V3, [1, 2, 4, 8, 16, 32, 64]),             # MLA: only the 128 query heads are split
])
def test_tensor_parallel_sizes_vllm_accepts(config, sizes):
    assert tp_sizes(config) == sizes


@pytest.mark.parametrize("config,message", [
    ({**TINY, "num_attention_heads": 0}, "num_attention_heads"),            # 0 heads: was a ZeroDivisionError
    ({**TINY, "num_attention_heads": -4}, "num_attention_heads"),           # negative
    ({**TINY, "num_key_value_heads": 3}, "num_key_value_heads"),            # 3 KV heads cannot serve 4 heads
    ({**TINY, "num_hidden_layers": float("inf")}, "num_hidden_layers"),     # JSON's Infinity
    ({**TINY, "hidden_size": 2}, "hidden_size"),                            # head_dim 0
    ({**TINY, "sliding_window": "4k", "layer_types": ["sliding_attention"] * 4}, "sliding_window"),  # not a count
    ([TINY], "JSON object"),                                                # a list, not a config
])
def test_unusable_config_is_a_value_error(config, message):
    with pytest.raises(ValueError, match=message):
        kv_spec(config)


def test_tensor_parallel_size_must_split_the_heads():
    with pytest.raises(ValueError, match="tensor parallel size 3"):
        kv_spec(TINY, tp=3)


def test_a_huge_layer_count_costs_no_memory():
    # no list of 2**24 layer kinds (the most a config.json may give) is built: the estimate is arithmetic
    assert kv_spec({**TINY, "num_hidden_layers": 2**24}).full_layers == 2**24
