"""Conversational prompts (`data.chat: true`): the model's own chat template.

The prepare stage keeps each row's conversation (`messages`: the environment's system
prompt, if any, and the user turn) and renders `prompt` with the base model's template
and the generation prompt, the text every generation of the pipeline starts from
(evaluation, gates, the pass-rate filter, the serving check). TRL gets the conversation
itself and applies the same template (SFT: prompt and assistant completion; GRPO: the
prompt), so training and evaluation see the same tokens. Reward functions get plain
completion text either way (`completion_texts`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path


def chat_template(model_dir: str | Path) -> str | None:
    """The chat template a tokenizer folder carries (tokenizer_config.json's
    `chat_template`, or `chat_template.jinja`), without loading the tokenizer."""
    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text()).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            return None
        return template or None
    return None


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_dir: str):
    """The model's tokenizer, loaded once per process (the config check and the prepare
    stage both render with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def conversation(prompt: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def render(rows: list[dict], tokenizer, system: str | None) -> list[dict]:
    """Rows with `messages` (the conversation) and `prompt` rendered by the template."""
    out = []
    for row in rows:
        messages = conversation(row["prompt"], system)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append({**row, "prompt": text, "messages": messages})
    return out


def sft_rows(rows: list[dict]) -> list[dict]:
    """TRL's prompt-completion rows: conversational when the rows carry `messages`."""
    if rows and "messages" in rows[0]:
        # an assistant turn's content, without the space a plain-text target needs after its prompt
        return [{"prompt": r["messages"], "completion": [{"role": "assistant", "content": r["completion"].strip()}]}
                for r in rows]
    return [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]


def grpo_rows(rows: list[dict]) -> list[dict]:
    """TRL's prompt-only rows with every other column (`answer`, and whatever else the
    environment's rows carry): TRL passes them to the reward functions by name."""
    return [{**reward_columns(r), "prompt": r.get("messages", r["prompt"])} for r in rows]


def reward_columns(row: dict) -> dict:
    """What a reward function gets of a row besides the completion: every column but the
    prompt, its conversation and the SFT target."""
    return {k: v for k, v in row.items() if k not in ("prompt", "messages", "completion")}


def completion_texts(completions: list) -> list[str]:
    """Plain text of TRL's completions: a conversational one is a list of messages."""
    return [c[-1]["content"] if isinstance(c, list) and c and isinstance(c[-1], dict) else c for c in completions]
