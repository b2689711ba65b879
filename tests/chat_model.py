"""A small model of a pretrained family's shape, built offline: Qwen2's architecture (a
few layers, random weights), a byte-level BPE tokenizer trained here with `tokenizers`
on the task's own text, ChatML special tokens and chat template, saved as an ordinary
Hugging Face folder (what `model.path` points at for a real model)."""

from __future__ import annotations

from pathlib import Path

# Qwen2.5's template, trimmed of tool calls: a system turn when given, ChatML turns, the
# assistant header as the generation prompt.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_chat_model(dest: Path, texts: list[str], *, vocab_size: int = 400, hidden_size: int = 64,
                     layers: int = 2, heads: int = 2, kv_heads: int = 1, positions: int = 512, seed: int = 0,
                     architecture: str = "qwen2") -> Path:
    """Write the tokenizer and model to `dest`; head_dim = hidden_size / heads (vLLM's CPU
    kernels want >= 32). `architecture`: qwen2, or llama (SmolLM2's and Llama 3's family)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                              Qwen2ForCausalLM)

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(dest)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL}
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[architecture]
    config = config_class(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=positions, tie_word_embeddings=True,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(dest)
    return Path(dest)


def memorized_model(dest: Path, row: dict, env, steps: int = 300) -> Path:
    """A small chat model trained (a plain PyTorch loop) until it says one gold episode by
    heart: the call, then the answer after the tool's result."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.chat import TOOL_TEMPLATE, tool_ready
    from posttrain.envs.tools import guard

    texts = [row["prompt"], TOOL_TEMPLATE.read_text()] * 20
    build_chat_model(dest, texts, vocab_size=600, positions=1024, hidden_size=64, layers=2)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    tool_ready(tokenizer)
    tokenizer.save_pretrained(dest)
    messages = [{"role": "system", "content": env.system}, {"role": "user", "content": row["prompt"]}] + row["trace"]
    ids = torch.tensor([tokenizer.apply_chat_template(messages, tools=[guard(env.episode)().calc],
                                                      return_dict=False)])
    model = AutoModelForCausalLM.from_pretrained(dest)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(dest)
    return dest
