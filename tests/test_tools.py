"""Tool environments: the tool-capable chat template, the guard around every tool, the
checks `posttrain check` makes, the calculator, and episodes run the way TRL runs them."""

from __future__ import annotations

import threading

import pytest

from chat_model import build_chat_model
from posttrain.chat import TOOL_TEMPLATE, tool_ready
from posttrain.envs.calculator import CalculatorEnv
from posttrain.envs.calculator import evaluate
from posttrain.envs.tools import ToolLimits, guard, tool_problems
from posttrain.errors import UserError
from posttrain.scoring.episodes import dry_episode, run_episodes


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A random-weight ChatML model whose own template renders no tools (SmolLM2's case)."""
    env = CalculatorEnv()
    texts = [r["prompt"] for r in env.generate(0)["train"][:200]] + [TOOL_TEMPLATE.read_text()]
    return build_chat_model(tmp_path_factory.mktemp("m") / "chat", texts, vocab_size=500, positions=1024)


@pytest.fixture
def tokenizer(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model)


def test_a_chatml_model_gets_the_tool_template_and_trl_parses_its_calls_back(tokenizer):
    from trl.chat_template_utils import (is_chat_template_prefix_preserving, is_chat_template_stop_token_trained,
                                         parse_response, supports_tool_calling)

    assert not supports_tool_calling(tokenizer)
    note = tool_ready(tokenizer)
    assert "chatml_tools.jinja" in note
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    assert is_chat_template_stop_token_trained(tokenizer)  # the SFT loss covers <|im_end|>
    assert tool_ready(tokenizer) is None  # once set, it stays
    env = CalculatorEnv()
    row = env.generate(0)["heldout"][0]
    episode = [{"role": "system", "content": env.system}, {"role": "user", "content": row["prompt"]}] + row["trace"]
    tools = [guard(env.episode)().calc]
    prefix = tokenizer.apply_chat_template(episode[:2], tools=tools, add_generation_prompt=True, return_dict=False)
    full = tokenizer.apply_chat_template(episode[:3], tools=tools, return_dict=False)
    call = parse_response(tokenizer, full[len(prefix):], prefix=prefix, tools=tools)
    assert call["tool_calls"] == row["trace"][0]["tool_calls"]
    # SFT on a trace trains the assistant's tokens only: never the tool's result
    out = tokenizer.apply_chat_template(episode, tools=tools, return_dict=True, return_assistant_tokens_mask=True)
    trained = tokenizer.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert "<tool_call>" in trained and trained.endswith("<|im_end|>")
    assert "<tool_response>" not in trained and trained.count("<|im_end|>") == 2


def test_a_model_without_chatml_tokens_or_tool_support_is_refused_in_one_line():
    from posttrain.training.tiny_model import build_tokenizer

    with pytest.raises(UserError) as err:
        tool_ready(build_tokenizer())
    assert str(err.value).startswith("model.path: ") and "\n" not in str(err.value)


class Misbehaving:
    """An episode whose tools go wrong in every way a user's can."""

    def reset(self, **row):
        return None

    def hang(self, x: int) -> str:
        """Never returns.

        Args:
            x: ignored
        """
        while True:
            pass

    def huge(self) -> str:
        """Returns 10 MB."""
        return "x" * 10_000_000

    def fails(self, x: int) -> str:
        """Raises every time.

        Args:
            x: ignored
        """
        raise KeyError("no such row")

    def quits(self) -> str:
        """Calls sys.exit."""
        raise SystemExit(3)


def test_the_guard_contains_a_hang_a_huge_reply_an_exception_and_an_exit():
    episode = guard(Misbehaving, ToolLimits(seconds=0.2, max_chars=1000))()
    episode.reset(prompt="p")
    with pytest.raises(RuntimeError, match="ran past its 0.2 s limit"):
        episode.hang(1)
    assert len(episode.huge()) < 1100
    with pytest.raises(RuntimeError, match="KeyError"):
        episode.fails(1)
    with pytest.raises(RuntimeError, match="SystemExit"):
        episode.quits()
    assert (episode.tool_calls, episode.tool_errors) == (4, 3)
    assert episode.reset(prompt="p") is None and episode.tool_calls == 0


def test_the_time_limit_holds_off_the_main_thread_too():
    episode = guard(Misbehaving, ToolLimits(seconds=0.2))()
    caught = []

    def call():
        try:
            episode.hang(1)
        except RuntimeError as err:
            caught.append(str(err))

    worker = threading.Thread(target=call)
    worker.start()
    worker.join(30)
    assert caught and "limit" in caught[0]


def test_the_guarded_tools_show_the_model_the_same_schema():
    from transformers.utils import get_json_schema

    from posttrain.envs.calculator import CalculatorEpisode

    assert get_json_schema(guard(CalculatorEpisode)().calc) == get_json_schema(CalculatorEpisode().calc)


class Untyped:
    def reset(self, **row):
        return None

    def lookup(self, key):
        """Looks up a key.

        Args:
            key: the key
        """
        return key


class Undocumented:
    def reset(self, **row):
        return None

    def lookup(self, key: str) -> str:
        return key


class NoArgsSection:
    def reset(self, **row):
        return None

    def lookup(self, key: str) -> str:
        """Looks up a key."""
        return key


class NoReset:
    def lookup(self, key: str) -> str:
        """Looks up a key.

        Args:
            key: the key
        """
        return key


class NoTools:
    def reset(self, **row):
        return None


@pytest.mark.parametrize("episode, words", [(Untyped, "lookup"), (Undocumented, "lookup"),
                                            (NoArgsSection, "key"), (NoReset, "no reset"), (NoTools, "no tools")])
def test_check_names_what_a_bad_tool_environment_lacks(episode, words):
    problems = tool_problems(episode)
    assert len(problems) == 1 and words in problems[0] and "\n" not in problems[0]


def test_the_built_in_calculator_passes_the_checks():
    assert tool_problems(CalculatorEnv().episode) == []


@pytest.mark.parametrize("expression, value", [("37 * 48", 1776), ("(37 + 48) * 2", 170), ("7 / 2", 3.5),
                                               ("-3 + 10 % 4", -1)])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('id')", "2 ** 10", "9" * 16 + " * 9",
                                        "x + 1", "1 / 0", "1 +" * 100 + "1", "open('f')", "(1).real"])
def test_the_calculator_refuses_anything_but_bounded_arithmetic(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def test_a_dry_episode_replays_the_gold_trace_through_template_parser_and_tools(tokenizer):
    tool_ready(tokenizer)
    env = CalculatorEnv()
    row = env.generate(0)["heldout"][3]
    episode = dry_episode(tokenizer, env, row)
    assert env.verify(episode.final, row["answer"])
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.truncated) == (2, 1, 0, False)
    assert episode.messages[3] == {"role": "tool", "name": "calc", "content": row["answer"]}


def test_a_dry_episode_scores_an_environment_whose_tools_fail(tokenizer):
    tool_ready(tokenizer)

    class Env:
        system = None
        episode = Misbehaving
        max_turns = 8

    Misbehaving.hang = NoReset.lookup  # keep the dry run short: every other tool misbehaves as above
    try:
        episode = dry_episode(tokenizer, Env(), {"prompt": "q", "completion": "done"})
    finally:
        del Misbehaving.hang
    assert (episode.tool_calls, episode.tool_errors, episode.final) == (4, 2, "done")  # fails and quits


def test_model_episodes_stop_within_their_caps(chat_model, tokenizer):
    from transformers import AutoModelForCausalLM

    tool_ready(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    env = CalculatorEnv()
    rows = env.generate(0)["heldout"][:3]
    episodes = run_episodes(model, tokenizer, env, rows, n=2, temperature=1.0, max_tokens=40, seed=0)
    assert [len(group) for group in episodes] == [2, 2, 2]
    for group in episodes:
        for episode in group:
            assert episode.done and (episode.tokens <= 40 or episode.truncated)
            assert episode.turns <= env.max_turns + 1


def test_sql_tools_queries_read_only_in_the_sandbox_and_its_gold_episode_verifies(tokenizer):
    from posttrain.envs.sql_tools import SQLToolsEnv

    tool_ready(tokenizer)
    env = SQLToolsEnv(heldout_size=20)
    assert tool_problems(env.episode) == []
    episode = guard(env.episode)()
    episode.reset()
    for hostile in ("DELETE FROM emp", "ATTACH DATABASE 'x.db' AS x", "PRAGMA writable_schema=1",
                    "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r"):
        with pytest.raises(RuntimeError):
            episode.query(hostile)
    assert episode.tool_errors == 4
    assert "more than 20 rows" in episode.query("SELECT * FROM emp")
    row = env.generate(0)["heldout"][0]
    done = dry_episode(tokenizer, env, row)
    assert env.verify(done.final, row["answer"]) and done.tool_calls == 1 and done.tool_errors == 0


def test_episode_channels_read_the_guarded_episodes_calls_and_failures():
    from posttrain.scoring.rewards import build_rewards

    env = CalculatorEnv()
    used, failed, idle = (guard(env.episode)() for _ in range(3))
    for episode in (used, failed, idle):
        episode.reset()
    used.calc("2 + 2")
    failed.calc("3 * 3")
    with pytest.raises(RuntimeError):
        failed.calc("open('x')")
    funcs, _ = build_rewards(env, {"tool_use": 1.0, "tool_errors": 1.0})
    completions = [[{"role": "assistant", "content": "4"}]] * 3
    columns = {"answer": ["4", "9", "1"], "environments": [used, failed, idle]}
    assert funcs[0](completions, **columns) == [1.0, 1.0, 0.0]
    assert funcs[1](completions, **columns) == [0.0, -0.5, 0.0]


def test_retrieval_finds_the_document_and_its_gold_episode_verifies(tokenizer):
    from posttrain.envs.retrieval import RetrievalEnv

    tool_ready(tokenizer)
    env = RetrievalEnv(towns=40, heldout_size=20)
    assert tool_problems(env.episode) == []
    splits = env.generate(0)
    assert (len(splits["train"]), len(splits["heldout"])) == (60, 20)
    assert not {r["prompt"] for r in splits["train"]} & {r["prompt"] for r in splits["heldout"]}
    for row in splits["heldout"]:  # the town the question names heads the results
        town = row["prompt"].split(" was ")[-1].split(" founded")[0] if "founded" in row["prompt"] else \
            row["prompt"].rsplit(" ", 1)[-1].rstrip("?")
        assert row["trace"][1]["content"].split("\n")[0].split("] ")[1].startswith(town + " "), row
    row = splits["heldout"][0]
    done = dry_episode(tokenizer, env, row)
    assert env.verify(done.final, row["answer"]) and (done.tool_calls, done.tool_errors) == (1, 0)
    assert env.verify(row["answer"], row["answer"]) and not env.verify(f"It is {row['answer']}.", row["answer"])
    assert guard(env.episode)().search("zzzz qqqq") == "(no document matches)"


def test_retrieval_index_is_written_by_prepare_and_reused_only_for_its_own_corpus(tmp_path, monkeypatch):
    from posttrain.envs.retrieval import INDEX_DIR, RetrievalEnv

    monkeypatch.chdir(tmp_path)
    env = RetrievalEnv(towns=30, heldout_size=10)
    assert not env.episode.args[0].loaded and env.save_index(tmp_path / INDEX_DIR)["documents"] == 30
    again = RetrievalEnv(towns=30, heldout_size=10)
    assert again.episode.args[0].loaded
    assert again.episode().search("Anything") == env.episode().search("Anything")
    assert not RetrievalEnv(towns=31, heldout_size=10).episode.args[0].loaded  # another corpus: built anew


def test_retrieval_over_a_users_corpus_and_its_bad_input(tmp_path, monkeypatch):
    import json

    from posttrain.envs import get_env
    from posttrain.errors import OptionError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "custom").mkdir()
    docs = [{"id": "d1", "text": "The Kestrel pump moves 40 litres a minute."},
            {"id": "d2", "text": "The Osprey valve is rated for 12 bar."}]
    (tmp_path / "custom" / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for split, question, answer in (("train", "What does the Kestrel pump move a minute?", "40 litres"),
                                    ("heldout", "What is the Osprey valve rated for?", "12 bar")):
        (tmp_path / "custom" / f"{split}.jsonl").write_text(json.dumps({"prompt": question, "answer": answer}) + "\n")
    files = {"corpus": "custom/docs.jsonl", "train": "custom/train.jsonl", "heldout": "custom/heldout.jsonl"}
    env = get_env("retrieval", **files, verifier="exact", top_k=1)
    row = env.generate(0)["heldout"][0]
    assert row["trace"][1]["content"] == "[d2] The Osprey valve is rated for 12 bar."
    assert env.verify("12 bar", row["answer"]) and not env.verify("12", row["answer"])
    with pytest.raises(Exception, match="heldout"):  # a corpus without its question files
        get_env("retrieval", corpus="custom/docs.jsonl", train="custom/train.jsonl")
    (tmp_path / "custom" / "docs.jsonl").write_text('{"id": "d1", "body": "no text field"}\n')
    with pytest.raises(OptionError, match="docs.jsonl line 1"):
        get_env("retrieval", **files, verifier="exact")
    with pytest.raises(OptionError, match="custom/"):
        get_env("retrieval", **{**files, "corpus": "/etc/passwd.jsonl"}, verifier="exact")


class Hostile:
    """Tools that return what is not a string, print to stdout, and a reset of 10 MB."""

    def reset(self, **row):
        return "y" * 10_000_000

    def mapping(self) -> str:
        """Returns a dict."""
        return {"rows": [1, 2, 3], "ok": True}

    def recursive(self) -> str:
        """Returns a list that holds itself."""
        loop = [1]
        loop.append(loop)
        return loop

    def enormous(self) -> str:
        """Returns ten million integers."""
        return list(range(10_000_000))

    def noisy(self) -> str:
        """Prints, then returns."""
        print("posttrain-progress 1/1 sampling")  # what the flow's display would read as progress
        return "done"

    def unshowable(self) -> str:
        """Returns an object whose repr raises."""
        class Bad:
            def __repr__(self):
                raise ValueError("no")
        return Bad()


def test_the_guard_shows_any_result_as_bounded_text_and_keeps_stdout_clean(capsys):
    episode = guard(Hostile, ToolLimits(seconds=5, max_chars=1000))()
    observation = episode.reset(prompt="p")
    assert len(observation) < 1100 and observation.endswith("more characters]")   # 10 MB, cut
    assert episode.mapping() == "{'ok': True, 'rows': [1, 2, 3]}"          # reprlib sorts the keys
    assert episode.recursive().endswith("[...]]]]]]]]]") and len(episode.recursive()) < 60   # 8 levels, then [...]
    assert len(episode.enormous()) < 1100                       # reprlib stops at 256 items: no 10^7-item string
    assert episode.noisy() == "done"
    assert episode.unshowable().startswith("<Bad instance at ")             # its repr raised: reprlib says what it is
    captured = capsys.readouterr()
    assert "posttrain-progress" not in captured.out and "posttrain-progress" in captured.err


@pytest.mark.parametrize("lines, needle", [
    # two documents of one id: a search result naming it would be ambiguous
    ([b'{"id": "d1", "text": "a"}', b'{"id": "d1", "text": "b"}'], "id 'd1' is also line 1's"),
    # a 100 MB line: read up to the line cap, refused unparsed
    ([b'{"id": "d1", "text": "' + b"x" * 100_000_000 + b'"}'], "docs.jsonl line 1"),
    # bytes that are not UTF-8
    ([b'{"id": "d1", "text": "\xff\xfe caf\xe9"}'], "docs.jsonl line 1"),
])
def test_a_hostile_corpus_is_refused_in_one_line(tmp_path, monkeypatch, lines, needle):
    from posttrain.envs import get_env
    from posttrain.errors import OptionError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "docs.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    for split in ("train", "heldout"):
        (tmp_path / "custom" / f"{split}.jsonl").write_text('{"prompt": "q", "answer": "a"}\n')
    with pytest.raises(OptionError, match=needle) as err:
        get_env("retrieval", corpus="custom/docs.jsonl", train="custom/train.jsonl", heldout="custom/heldout.jsonl",
                verifier="exact")
    assert "\n" not in str(err.value)


def test_a_million_tiny_documents_stop_at_the_cap(tmp_path, monkeypatch):
    """Read line by line and refused at the first document past MAX_DOCUMENTS: the rest of
    the file is never read, nothing is indexed."""
    from posttrain.envs import get_env, retrieval
    from posttrain.errors import OptionError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "custom").mkdir()
    with open(tmp_path / "custom" / "docs.jsonl", "w") as out:
        out.writelines(f'{{"id": "{i}", "text": "t"}}\n' for i in range(1_000_000))
    for split in ("train", "heldout"):
        (tmp_path / "custom" / f"{split}.jsonl").write_text('{"prompt": "q", "answer": "a"}\n')
    with pytest.raises(OptionError, match=f"over {retrieval.MAX_DOCUMENTS:,}|over {retrieval.MAX_DOCUMENTS}"):
        get_env("retrieval", corpus="custom/docs.jsonl", train="custom/train.jsonl", heldout="custom/heldout.jsonl",
                verifier="exact")
