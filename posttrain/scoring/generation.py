"""Sampling completions with transformers `generate` (the path that needs no vLLM)."""

from __future__ import annotations


def load_policy(model_dir: str):
    """Model and tokenizer from a Hugging Face folder, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model, tokenizer


def rendered_with_bos(tokenizer, prompts: list[str]) -> bool:
    """Whether the prompts already begin with the tokenizer's BOS token: a chat template
    that writes `{{ bos_token }}` (Llama 3, Gemma, Mistral) put it there, and tokenizing
    with special tokens would add a second one (TRL's chat path adds none)."""
    bos = getattr(tokenizer, "bos_token", None)
    return bool(bos and prompts and all(p.startswith(bos) for p in prompts))


def generate(model, tokenizer, prompts: list[str], *, n: int, temperature: float,
             max_new_tokens: int, batch_size: int = 256, seed: int = 0, report: bool = True) -> list[list[str]]:
    """`n` completions per prompt; temperature 0 means greedy (then n must be 1).

    Returns a list (one per prompt) of `n` decoded completions without special tokens.
    `report`: the prompts done are the current phase's progress (posttrain.progress).
    """
    import torch

    from posttrain import progress

    torch.manual_seed(seed)
    sample = temperature > 0
    out: list[list[str]] = []
    step = max(1, batch_size // n)
    special = not rendered_with_bos(tokenizer, prompts)
    for start in range(0, len(prompts), step):
        batch = tokenizer(prompts[start:start + step], return_tensors="pt", padding=True,
                          add_special_tokens=special).to(model.device)
        with torch.inference_mode():
            ids = model.generate(
                **batch, do_sample=sample, temperature=temperature if sample else None,
                top_p=None, top_k=None, num_return_sequences=n, max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(ids[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
        out.extend(texts[i:i + n] for i in range(0, len(texts), n))
        if report:
            progress.update(len(out), len(prompts))
    return out
