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


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def render_without_transformers(model_dir: str | Path, messages: list[dict], tools: list | None = None) -> str | None:
    """The prompt `tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True)`
    renders, by the same Jinja environment transformers compiles templates in (sandboxed,
    trim_blocks, lstrip_blocks, loopcontrols, its `tojson`, `raise_exception`, `strftime_now`,
    the named special tokens): `posttrain check` measures prompts without importing transformers
    and torch (seven seconds). None where it cannot tell (no template, any error): ask transformers."""
    template = chat_template(model_dir)
    if template is None:
        return None
    try:
        special = _special_tokens(str(model_dir))
        return _compiled(template).render(messages=messages, tools=tools or None, documents=None,
                                          add_generation_prompt=True, **special)
    except Exception:  # the template's own refusal, or what this environment lacks: transformers says which
        return None


@functools.lru_cache(maxsize=4)
def _special_tokens(model_dir: str) -> dict[str, str]:
    found = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins, as transformers merges
        path = Path(model_dir) / name
        if path.is_file():
            data = json.loads(path.read_text())
            for key in SPECIAL_TOKENS:
                value = data.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    found[key] = value
    return found


@functools.lru_cache(maxsize=4)
def _compiled(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # `{% generation %}...{% endgeneration %}`: transformers' mask markers
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        from datetime import datetime

        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_dir: str):
    """The model's tokenizer, loaded once per process (the config check and the prepare
    stage both render with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def conversation(prompt: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def render(rows: list[dict], tokenizer, system: str | None, tools: list | None = None) -> list[dict]:
    """Rows with `messages` (the conversation) and `prompt` rendered by the template
    (with the tools' signatures in it, for a tool environment)."""
    out = []
    for row in rows:
        messages = conversation(row["prompt"], system)
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        out.append({**row, "prompt": text, "messages": messages})
    return out


def sft_rows(rows: list[dict], tools: list[dict] | None = None) -> list[dict]:
    """TRL's prompt-completion rows: conversational when the rows carry `messages`; for
    a tool environment (`tools`: the tools' JSON schemas) TRL's conversational rows, each
    the whole gold episode (`trace`: calls, results, answer) with the tools it may call,
    for `assistant_only_loss` (the template's generation markers: tool results get no loss)."""
    if tools is not None:
        listed = json.dumps(tools)
        return [{"messages": r["messages"] + [_arguments_as_text(m) for m in gold_episode(r)], "tools": listed}
                for r in rows]
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
    prompt, its conversation, the SFT target and the gold episode."""
    return {k: v for k, v in row.items() if k not in ("prompt", "messages", "completion", "trace")}


def completion_texts(completions: list) -> list[str]:
    """Plain text of TRL's completions: a conversational one is a list of messages, and
    of an episode (replies, tool results) the text is its last reply: never a tool's
    result, which an episode cut short after a call would otherwise end with."""
    return [_last_reply(c) if isinstance(c, list) else c for c in completions]


def gold_episode(row: dict) -> list[dict]:
    """The turns after the question that SFT trains on: the row's `trace` (calls, results,
    answer) when the environment wrote one, else the answer alone."""
    return row.get("trace") or [{"role": "assistant", "content": row["completion"].strip()}]


def _last_reply(messages: list) -> str:
    replies = [m for m in messages if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
    return (replies[-1].get("content") or "") if replies else ""


def _arguments_as_text(message: dict) -> dict:
    """A trace message whose tool calls carry their arguments as JSON text: one table
    column holds every tool's arguments, whatever their names (the template writes text as is)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [{**c, "function": {**c["function"],
                                                          "arguments": json.dumps(c["function"]["arguments"])}}
                                      for c in calls]}


TOOL_TEMPLATE = Path(__file__).parent / "chat_templates/chatml_tools.jinja"
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def tool_ready(tokenizer, where: str = "model.path") -> str | None:
    """Make `tokenizer` render tool calls and results and parse calls back (TRL's
    `parse_response` reads its `response_template`); the tool environments need both.

    The model's own template stays when it renders a whole tool round-trip and TRL knows
    how to parse it (`trl.chat_template_utils.add_response_schema`), or the tokenizer
    carries a response template already. Otherwise posttrain's tool-capable ChatML
    (TOOL_TEMPLATE) replaces it, when the vocabulary has ChatML's turn tokens: returns
    the line that says so. A model with neither is refused (UserError at `where`)."""
    from trl.chat_template_utils import add_response_schema, qwen3_template, supports_tool_calling

    from posttrain.errors import UserError

    if supports_tool_calling(tokenizer):
        if getattr(tokenizer, "response_template", None) is not None:
            return None
        try:
            add_response_schema(tokenizer)
            return None
        except ValueError:
            pass  # a template TRL cannot parse calls from: posttrain's, where the vocabulary allows
    vocab = tokenizer.get_vocab()
    if not all(token in vocab for token in CHATML_TOKENS):
        raise UserError(where, "the model's chat template cannot render tool calls and its vocabulary has no "
                               "ChatML tokens (<|im_start|>, <|im_end|>) for posttrain's tool template",
                        "use a model whose chat template renders tools (TRL's add_response_schema knows it), "
                        "or set a tool-capable chat_template and response_template in its tokenizer_config.json")
    tokenizer.chat_template = TOOL_TEMPLATE.read_text()
    tokenizer.response_template = qwen3_template
    return (f"posttrain: the model's chat template cannot render tool calls; using posttrain's tool-capable "
            f"ChatML ({TOOL_TEMPLATE.relative_to(Path(__file__).parent.parent)})")
