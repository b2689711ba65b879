"""A `posttrain model export` file in llama.cpp itself: greedy replies from llama-cpp-python (llama.cpp's
own Python binding) against transformers' on the model the file was written from, token for token.

llama-cpp-python is not a posttrain dependency: PyPI ships it as source only, and pip builds llama.cpp
with cmake and a C++ compiler (docs/commands.md says how long that took here). Install it into the
venv first:

    .venv/bin/pip install llama-cpp-python==0.3.36          # builds llama.cpp (minutes)
    .venv/bin/python bench/gguf_llama_cpp.py                 # SmolLM2 (make smollm2), f32 and q8_0, 20 prompts

For each GGUF type it writes the file (posttrain.models.gguf_export), loads it in llama.cpp, and
decodes each chat prompt greedily from the same prompt tokens transformers gets, up to `--tokens` new
tokens or the end of turn. It prints, per type, how many replies equal transformers' token for token
and the share of equal tokens (position by position), and writes the record to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from real_model import commit, machine  # noqa: E402


def prompts(count: int) -> list[str]:
    return [f"{i} + {2 * i + 7}" for i in range(count)]


def transformers_replies(model_dir: Path, texts: list[str], tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy new ids) per prompt, fp32, the chat template with its generation prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs, replies = [], []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=tokens, do_sample=False)[0].tolist()
        prompt = ids["input_ids"][0].tolist()
        inputs.append(prompt)
        replies.append(out[len(prompt):])
    return inputs, replies


def llama_cpp_replies(gguf: Path, inputs: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy new ids per prompt from llama.cpp (top_k 1), the same prompt ids, stopping at its EOS."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=2, seed=0, verbose=False)
    replies = []
    for prompt in inputs:
        llm.reset()
        reply = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            reply.append(token)
            if token == llm.token_eos() or len(reply) == tokens:
                break
        replies.append(reply)
    return replies


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    equal = sum(a == b for a, b in zip(reference, other))
    positions = sum(max(len(a), len(b)) for a, b in zip(reference, other))
    same = sum(x == y for a, b in zip(reference, other) for x, y in zip(a, b))
    return {"replies": len(reference), "equal_replies": equal, "equal_token_share": same / max(positions, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--types", nargs="+", default=["f32", "q8_0"])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gguf_llama_cpp.json"))
    args = parser.parse_args()
    import llama_cpp  # noqa: F401 - refused here, before any export, when it is not installed

    from posttrain.models.gguf_export import export_gguf

    model = Path(args.model)
    inputs, reference = transformers_replies(model, prompts(args.prompts), args.tokens)
    record = {"model": model.name, "machine": machine(), "commit": commit(),
              "llama_cpp_python": llama_cpp.__version__, "tokens": args.tokens, "types": {}}
    with tempfile.TemporaryDirectory(prefix="posttrain-llama-cpp-") as folder:
        for kind in args.types:
            path = Path(folder) / f"m-{kind}.gguf"
            export_gguf(model, path, kind=kind)
            started = time.monotonic()
            found = compare(reference, llama_cpp_replies(path, inputs, args.tokens))
            record["types"][kind] = {**found, "seconds": time.monotonic() - started}
            print(f"{kind}: {found['equal_replies']}/{found['replies']} replies equal transformers' token for token, "
                  f"{found['equal_token_share']:.3f} of tokens", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
