"""Sampling completions with vLLM: the evaluation's fast path.

Run as its own process (vLLM spawns workers, so it must start under `__main__`):

    python -m posttrain.vllm_engine.sample --job JOB.json --out OUT.json

JOB holds `models` (name -> folder), `prompts`, `n`, `temperature`, `max_tokens`, `seed`.
One engine serves every model where it can: it starts on the first, and each later model
of the same architecture has its weights loaded into it (as TRL's colocated GRPO does),
which saves an engine start per model. vLLM's CPU backend repacks weights at load and
cannot take new ones; there each model gets its own engine. OUT maps each name to `{"greedy": [...], "sampled": [[...]]}`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path


def same_architecture(a: str, b: str) -> bool:
    keys = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")
    ca, cb = (json.loads((Path(d) / "config.json").read_text()) for d in (a, b))
    return all(ca.get(k) == cb.get(k) for k in keys)


def load_into(llm, model_dir: str) -> None:
    """Swap `model_dir`'s weights into the running engine."""
    from safetensors.torch import load_file

    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        model.load_weights(load_file(str(path)).items())
    llm.reset_prefix_cache()


def engine_inputs(tokenizer, prompts: list[str]) -> list:
    """The prompts as vLLM takes them: text, or token ids when a chat template already
    wrote the BOS token (vLLM would add another, as transformers would)."""
    from posttrain.scoring.generation import rendered_with_bos

    if not rendered_with_bos(tokenizer, prompts):
        return prompts
    return [{"prompt_token_ids": tokenizer.encode(p, add_special_tokens=False)} for p in prompts]


def sample(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights can swap
    prompts, n = job["prompts"], job["n"]
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], seed=job["seed"])
    sampled = SamplingParams(n=n, temperature=job["temperature"], max_tokens=job["max_tokens"], seed=job["seed"])
    def engine(model_dir):
        return LLM(model=model_dir, dtype=job["dtype"], enforce_eager=True, seed=job["seed"],
                   max_model_len=job["max_model_len"], kv_cache_memory_bytes=job["kv_cache_memory_bytes"])

    out, llm, loaded = {}, None, None
    for name, model_dir in job["models"].items():
        if llm is not None and model_dir != loaded and same_architecture(loaded, model_dir):
            try:
                load_into(llm, model_dir)
            except (AssertionError, RuntimeError):  # CPU kernels repack weights: no swapping there
                llm = None
        elif model_dir != loaded:
            llm = None
        if llm is None:
            gc.collect()
            llm = engine(model_dir)
        loaded = model_dir
        inputs = engine_inputs(llm.get_tokenizer(), prompts)
        out[name] = {
            "greedy": [o.outputs[0].text for o in llm.generate(inputs, greedy, use_tqdm=False)],
            "sampled": [[c.text for c in o.outputs] for o in llm.generate(inputs, sampled, use_tqdm=False)],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m posttrain.vllm_engine.sample")
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = sample(json.loads(Path(args.job).read_text()))
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
