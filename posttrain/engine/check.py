"""Load a model in real vLLM with a fixed KV memory and report vLLM's own capacity.

Run as its own process (vLLM spawns workers, so it must start under `__main__`):

    python -m posttrain.engine.check MODEL --kv-memory-bytes N --context L --out FILE

FILE receives vLLM's figures, read from the engine's cache config rather than its logs:
block size, number of blocks, KV cache tokens, maximum concurrency for L-token requests.
"""

from __future__ import annotations

import argparse
import json


def engine_capacity(model_dir: str, *, kv_memory_bytes: int, context_length: int, dtype: str) -> dict:
    from vllm import LLM

    llm = LLM(model=model_dir, kv_cache_memory_bytes=kv_memory_bytes, max_model_len=context_length,
              dtype=dtype, enforce_eager=True, seed=0)
    cache = llm.llm_engine.vllm_config.cache_config
    return {"block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks,
            "kv_cache_tokens": cache.kv_cache_size_tokens, "max_concurrency": cache.kv_cache_max_concurrency,
            "kv_cache_dtype": str(cache.cache_dtype), "model_dtype": str(llm.llm_engine.vllm_config.model_config.dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m posttrain.engine.check")
    parser.add_argument("model")
    parser.add_argument("--kv-memory-bytes", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = engine_capacity(args.model, kv_memory_bytes=args.kv_memory_bytes, context_length=args.context,
                             dtype=args.dtype)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
