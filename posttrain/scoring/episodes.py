"""Episodes of a tool environment, outside training: the model (or a scripted policy)
replies, posttrain runs the tools it calls, until it answers without a call.

The same steps as TRL's `GRPOTrainer` tool loop, so an episode here is one the trainer
would have run: the conversation rendered with the tokenizer's chat template and the
tools' schemas, each reply parsed with TRL's `parse_response`, each call run on a
guarded episode (posttrain.envs.tools.guard: time limit, size cap, errors become the
tool's reply), the whole episode (replies and tool results) capped at `max_tokens`
tokens and `max_turns` tool-calling rounds. The verdict is the environment's `verify`
on the last reply.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field

from posttrain.chat import conversation
from posttrain.envs.tools import ToolLimits, guard, tool_names


@dataclass
class Episode:
    """One episode: its conversation (system, user, then assistant and tool turns), the
    last reply, and what it cost."""
    messages: list[dict]
    tools: list
    prompt_tokens: int = 0
    tokens: int = 0          # the episode's tokens after the prompt: replies and tool results
    turns: int = 0           # assistant replies
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    truncated: bool = False  # stopped by the token or turn cap, not by a reply without a call
    instance: object = field(default=None, repr=False)

    @property
    def final(self) -> str:
        replies = [m for m in self.messages if m["role"] == "assistant"]
        return (replies[-1].get("content") or "") if replies else ""

    def record(self, verdict: bool) -> dict:
        """What the evaluation tables keep of it."""
        return {"messages": self.messages, "final": self.final, "correct": verdict, "turns": self.turns,
                "tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "tokens": self.tokens,
                "truncated": self.truncated}


def start(factory, row: dict, system: str | None) -> Episode:
    """A fresh guarded episode for `row`: TRL's `reset(**row)`, whose string (if any)
    is appended to the user turn."""
    instance = factory()
    observation = instance.reset(**row)
    question = row.get("question", row["prompt"]) if "messages" not in row else row["messages"][-1]["content"]
    messages = conversation(question + (observation or ""), system)
    tools = [getattr(instance, name) for name in tool_names(type(instance))]
    return Episode(messages=messages, tools=tools, instance=instance)


def prompt_ids(tokenizer, episode: Episode) -> list[int]:
    return tokenizer.apply_chat_template(episode.messages, tools=episode.tools, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def take(tokenizer, episode: Episode, reply_ids: list[int], prefix_ids: list[int], *, max_tokens: int,
         max_turns: int) -> None:
    """Add the model's reply to the episode and run the tools it calls; marks it done
    when the reply calls none, or when a cap is reached."""
    from trl.chat_template_utils import parse_response

    message = parse_response(tokenizer, reply_ids, prefix=prefix_ids, tools=episode.tools) if reply_ids else \
        {"role": "assistant", "content": ""}
    episode.messages.append({"role": "assistant", "content": message.get("content") or "",
                             **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})})
    episode.turns += 1
    episode.tokens += len(reply_ids)
    calls = message.get("tool_calls") or []
    if not calls:  # the answer; cut short when the reply ran out of tokens before its end-of-turn token
        episode.done = True
        episode.truncated = bool(reply_ids) and reply_ids[-1] not in tokenizer.all_special_ids
        return
    if episode.turns > max_turns or episode.tokens >= max_tokens:
        episode.done = episode.truncated = True
        return
    before = len(tokenizer.apply_chat_template(episode.messages, tools=episode.tools, tokenize=True,
                                               return_dict=False))
    for call in calls:
        episode.messages.append(run_call(episode, call))
    after = len(prompt_ids(tokenizer, episode))
    episode.tokens += after - before
    if episode.tokens >= max_tokens:
        episode.done = episode.truncated = True


def run_call(episode: Episode, call: dict) -> dict:
    """One tool call as the tool message that answers it (TRL's shape: an exception
    becomes `{"error": ...}`)."""
    episode.tool_calls += 1
    function = call.get("function", {}) if call.get("type", "function") == "function" else {}
    name = function.get("name", "unknown")
    tools = {tool.__name__: tool for tool in episode.tools}
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        result = tools[name](**arguments)
    except Exception as err:
        episode.tool_errors += 1
        result = {"error": str(err)}
    return {"role": "tool", "name": name, "content": str(result)}


def run_episodes(model, tokenizer, env, rows: list[dict], *, n: int, temperature: float, max_tokens: int,
                 seed: int, system: str | None = None, batch_size: int = 64, limits=None) -> list[list[Episode]]:
    """`n` episodes per row (temperature 0: greedy, n must be 1), every round of replies
    generated in batches across the episodes still running; each tool call under `limits`
    (posttrain.envs.tools.ToolLimits)."""
    import torch

    torch.manual_seed(seed)

    def replies(prompts: list[list[int]], budget: int) -> list[list[int]]:
        return generate_ids(model, tokenizer, prompts, temperature=temperature, max_new_tokens=budget)

    return play(tokenizer, env, rows, replies, n=n, max_tokens=max_tokens, system=system, batch_size=batch_size,
                limits=limits)


def play(tokenizer, env, rows: list[dict], replies, *, n: int, max_tokens: int, system: str | None = None,
         batch_size: int = 64, limits=None) -> list[list[Episode]]:
    """The episodes' loop, whatever generates: `replies(prompts, budget)` answers a batch of
    conversations (token ids) with one reply each (token ids, with the end-of-turn token
    when the reply ended), at most `budget` tokens; transformers (`run_episodes`) or vLLM
    (posttrain.vllm_engine.sample) behind it."""
    factory = guard(env.episode, limits or ToolLimits())
    max_turns = getattr(env, "max_turns", 8)
    system = system if system is not None else getattr(env, "system", None)
    episodes = [[start(factory, row, system) for _ in range(n)] for row in rows]
    flat = [e for group in episodes for e in group]
    while True:
        running = [e for e in flat if not e.done]
        if not running:
            break
        for begin in range(0, len(running), batch_size):
            batch = running[begin:begin + batch_size]
            prompts = [prompt_ids(tokenizer, e) for e in batch]
            for e, ids in zip(batch, prompts):
                e.prompt_tokens = e.prompt_tokens or len(ids)
            budget = max(1, max(max_tokens - e.tokens for e in batch))
            for e, ids, reply in zip(batch, prompts, replies(prompts, budget)):
                take(tokenizer, e, reply[:max(0, max_tokens - e.tokens)], ids, max_tokens=max_tokens,
                     max_turns=max_turns)
                if not e.done and e.tokens >= max_tokens:
                    e.done = e.truncated = True
    return episodes


def stop_ids(tokenizer) -> list[int]:
    """The end-of-turn tokens a reply stops at: the tokenizer's, and ChatML's `<|im_end|>` where it has one."""
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return sorted(set(stops + ([end] if isinstance(end, int) and end != tokenizer.unk_token_id else [])))


def ended_reply(ids: list[int], finish_reason: str | None, stops: list[int]) -> list[int]:
    """A vLLM reply's token ids with its end-of-turn token when it ended on one (some
    outputs leave it out), so `take` sees an answer that ended, not one cut short."""
    return ids + stops[:1] if finish_reason == "stop" and stops and (not ids or ids[-1] not in stops) else ids


def as_record(episode: Episode) -> dict:
    """An episode as JSON (what a vLLM sampling process sends back)."""
    return {"messages": episode.messages, "prompt_tokens": episode.prompt_tokens, "tokens": episode.tokens,
            "turns": episode.turns, "tool_calls": episode.tool_calls, "tool_errors": episode.tool_errors,
            "done": episode.done, "truncated": episode.truncated}


def from_record(record: dict) -> Episode:
    """`as_record`'s episode back; its `instance` carries the counts reward channels read."""
    import types

    return Episode(**record, tools=[], instance=types.SimpleNamespace(tool_calls=record["tool_calls"],
                                                                      tool_errors=record["tool_errors"]))


def generate_ids(model, tokenizer, prompts: list[list[int]], *, temperature: float,
                 max_new_tokens: int) -> list[list[int]]:
    """One reply per prompt (token ids, up to and with the end-of-turn token), left-padded
    batch generation."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sample = temperature > 0
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
                             do_sample=sample, temperature=temperature if sample else None, top_p=None, top_k=None,
                             max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=list(stops))
    replies = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        replies.append(row[:cut])
    return replies


def scripted_message(episode: Episode, row: dict, step: int) -> dict:
    """What a scripted policy says at `step` of a dry episode: the row's gold trace
    (`trace`) when it has one; else one call of each tool with arguments of the declared
    types, then the row's `completion`."""
    trace = [m for m in row.get("trace") or [] if m["role"] == "assistant"]
    if trace:
        return trace[min(step, len(trace) - 1)]
    if step < len(episode.tools):
        tool = episode.tools[step]
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": tool.__name__, "arguments": example_arguments(tool)}}]}
    return {"role": "assistant", "content": row.get("completion", "")}


def render_reply(tokenizer, episode: Episode, message: dict) -> str:
    """An assistant message as the text the model would generate for it: the template's
    rendering of the conversation with it, less the rendering without it."""
    before = tokenizer.apply_chat_template(episode.messages, tools=episode.tools, add_generation_prompt=True,
                                           tokenize=False)
    after = tokenizer.apply_chat_template(episode.messages + [message], tools=episode.tools, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the chat template renders the conversation differently once a reply is added "
                         "(not prefix-preserving)")
    return after[len(before):].rstrip("\n")


def example_arguments(tool) -> dict:
    """Arguments of the declared types for a scripted call (`1` for a number, `"1"` for a string)."""
    import typing

    samples = {int: 1, float: 1.0, bool: True, str: "1", list: [], dict: {}}
    hints = typing.get_type_hints(tool)
    return {name: samples.get(typing.get_origin(hints.get(name)) or hints.get(name), "1")
            for name in inspect.signature(tool).parameters if name != "self"}


def dry_episode(tokenizer, env, row: dict, *, max_tokens: int = 4096, limits=None) -> Episode:
    """One episode of `row` with the scripted policy, through the same steps as a
    model's: renders every turn, parses each reply back, runs the guarded tools.
    ValueError when a reply the policy wrote does not parse back to its own calls."""
    factory = guard(env.episode, limits or ToolLimits())
    episode = start(factory, row, getattr(env, "system", None))
    max_turns = getattr(env, "max_turns", 8)
    for step in range(max_turns + 1):
        prefix = prompt_ids(tokenizer, episode)
        message = scripted_message(episode, row, step)
        reply = tokenizer(render_reply(tokenizer, episode, message), add_special_tokens=False)["input_ids"]
        calls = len(episode.messages)
        take(tokenizer, episode, reply, prefix, max_tokens=max_tokens, max_turns=max_turns)
        parsed = episode.messages[calls]
        said = (message.get("content") or "").strip()
        if _names(parsed) != _names(message) or parsed.get("content", "").strip() != said:
            raise ValueError(f"the reply {message!r} rendered by the chat template parses back as {parsed!r}")
        if episode.done:
            break
    return episode


def _names(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], c["function"].get("arguments")) for c in message.get("tool_calls") or []]


def sample_episodes(models: dict[str, str], env, rows: list[dict], *, n: int, temperature: float, max_tokens: int,
                    seed: int, limits=None) -> tuple[dict[str, tuple[list[str], list[list[str]]]], dict[str, list]]:
    """Each model's greedy episode and `n` sampled episodes per row, as `sample_models`
    gives completions (the last replies, which the verifier reads), and the greedy
    episodes themselves (model name -> [Episode]), on transformers
    (posttrain.scoring.evaluation.sample_tool_models runs them on vLLM too)."""
    from posttrain.chat import tool_ready
    from posttrain.scoring.generation import load_policy

    completions, greedy_episodes = {}, {}
    for name, model_dir in models.items():
        model, tokenizer = load_policy(model_dir)
        tool_ready(tokenizer)
        greedy = [g[0] for g in run_episodes(model, tokenizer, env, rows, n=1, temperature=0.0, max_tokens=max_tokens,
                                             seed=seed, limits=limits)]
        sampled = run_episodes(model, tokenizer, env, rows, n=n, temperature=temperature, max_tokens=max_tokens,
                               seed=seed, limits=limits) if n else [[] for _ in rows]
        completions[name] = ([e.final for e in greedy], [[e.final for e in group] for group in sampled])
        greedy_episodes[name] = greedy
    return completions, greedy_episodes


def episode_figures(episodes: list[Episode]) -> dict[str, float]:
    """What the episodes cost, per episode on average: replies (`turns`), tool calls,
    failed calls, tokens after the prompt, and the share a cap cut short."""
    count = max(1, len(episodes))
    return {"turns": sum(e.turns for e in episodes) / count,
            "tool_calls": sum(e.tool_calls for e in episodes) / count,
            "tool_errors": sum(e.tool_errors for e in episodes) / count,
            "tokens": sum(e.tokens for e in episodes) / count,
            "truncated_rate": sum(e.truncated for e in episodes) / count}


def episode_table(episodes: list[Episode], rows: list[dict], verdicts: list[bool]) -> dict[str, list]:
    """The episodes as a readable table (mlflow.log_table): the question, the episode
    turn by turn as the model saw it, the last reply, the verdict and the counts."""
    def shown(message: dict) -> str:
        calls = "".join(f" -> {c['function']['name']}({json.dumps(c['function'].get('arguments'))})"
                        for c in message.get("tool_calls") or [])
        return f"[{message['role']}] {message.get('content') or ''}{calls}"

    return {"question": [r["messages"][-1]["content"] if "messages" in r else r["prompt"] for r in rows],
            "episode": ["\n".join(shown(m) for m in e.messages[1:]) for e in episodes],
            "final": [e.final for e in episodes], "answer": [r["answer"] for r in rows], "correct": verdicts,
            "turns": [e.turns for e in episodes], "tool_calls": [e.tool_calls for e in episodes],
            "tool_errors": [e.tool_errors for e in episodes], "tokens": [e.tokens for e in episodes]}
