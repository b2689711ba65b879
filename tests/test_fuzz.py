"""Property-based fuzzing of the parsers posttrain trusts with outside input (Hypothesis): the
config loader, incoming data rows (JSONL batches), the answer parsers and verifiers, and the
GGUF header walk. Thousands of generated inputs each, bounded by example count, never by
seconds; the property is the same everywhere: the input is accepted, or refused with one
line (UserError, a row's reason, HeaderError), and nothing else escapes. Each test counts
the inputs it saw (`SEEN`, printed by `pytest -s`)."""

from __future__ import annotations

import json
import string
import struct
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from posttrain.errors import UserError

pytestmark = pytest.mark.slow  # about a minute and a quarter on 2 cores: 28,000 inputs
SEEN: Counter = Counter()
FUZZ = settings(max_examples=2000, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FEW = settings(FUZZ, max_examples=300)   # the math verifier answers from a worker process: slower an input

# JSON-like values, nested: what a YAML file or a JSON line can hold
SCALARS = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True) | \
    st.text(max_size=40)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) |
                      st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
BASE = yaml.safe_load((REPO / "configs" / "pipeline.yaml").read_text())


def one_line(err: Exception) -> None:
    assert "\n" not in str(err), str(err)


def paths(tree: dict, prefix=()) -> list[tuple]:
    """Every key path of the default config (where a generated value goes)."""
    found = []
    for key, value in tree.items():
        found.append((*prefix, key))
        if isinstance(value, dict):
            found += paths(value, (*prefix, key))
    return found


KEY_PATHS = paths(BASE)


def replaced(tree: dict, path: tuple, value) -> dict:
    out = dict(tree)
    out[path[0]] = replaced(out[path[0]] if isinstance(out.get(path[0]), dict) else {}, path[1:], value) \
        if len(path) > 1 else value
    return out


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nfuzzed inputs: " + ", ".join(f"{name} {count:,}" for name, count in sorted(SEEN.items())))


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(KEY_PATHS), VALUES), min_size=1, max_size=3))
def test_config_loader(tmp_path_factory, changes):
    """The default config with 1-3 of its fields (any depth) set to any YAML value."""
    from posttrain.config import load_config

    SEEN["config (field values)"] += 1
    config = BASE
    for path, value in changes:
        config = replaced(config, path, value)
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_text(yaml.safe_dump(config))
    try:
        load_config(path)
    except UserError as err:
        one_line(err)


@FUZZ
@given(text=st.text(alphabet=string.printable + "\u00e9\u4e2d\ufeff", max_size=300))
def test_config_loader_on_any_text(tmp_path_factory, text):
    """Any text as the config file: YAML that does not parse, a scalar, a list, tabs, a BOM."""
    from posttrain.config import load_config

    SEEN["config (raw text)"] += 1
    path = tmp_path_factory.getbasetemp() / "raw.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except UserError as err:
        one_line(err)


@pytest.fixture(scope="module")
def arithmetic():
    from posttrain.envs import get_env

    return get_env("arithmetic", operand_max=49, heldout_size=100)


ROWS = st.dictionaries(st.sampled_from(["prompt", "answer", "completion", "extra"]), VALUES, max_size=4) | VALUES


@FUZZ
@given(rows=st.lists(ROWS, max_size=5), junk=st.binary(max_size=40))
def test_incoming_batches(tmp_path_factory, arithmetic, rows, junk):
    """A JSONL batch of any JSON values and a line of any bytes: each line kept or named with its reason."""
    from posttrain.ingest import read_batch

    SEEN["incoming JSONL lines"] += len(rows) + 1
    path = tmp_path_factory.getbasetemp() / "batch.jsonl"
    path.write_bytes(b"".join(json.dumps(r, allow_nan=True).encode() + b"\n" for r in rows) + junk + b"\n")
    kept, errors = read_batch(path, arithmetic, set())
    assert all(isinstance(r["prompt"], str) and isinstance(r["answer"], str) for r in kept)
    for error in errors:
        assert "\n" not in error and error.startswith(str(path)), error


@FUZZ
@given(completion=st.text(max_size=200), answer=st.text(alphabet="0123456789-", min_size=1, max_size=8))
def test_arithmetic_parsers(completion, answer):
    from posttrain.envs import get_env

    SEEN["arithmetic parse/verify"] += 2
    for reader in ("exact", "last_number"):
        env = get_env("arithmetic", answer=reader)
        parsed = env.parse(completion)
        assert parsed is None or parsed.lstrip("-").isdigit()
        assert env.verify(completion, answer) in (True, False)


@pytest.fixture(scope="module")
def dataset_envs(tmp_path_factory):
    """One dataset environment per verifier, on two rows each."""
    import os

    from posttrain.envs import get_env

    root = tmp_path_factory.mktemp("verifiers")
    (root / "custom").mkdir()
    for name in ("train", "heldout"):
        (root / "custom" / f"{name}.jsonl").write_text(json.dumps({"prompt": f"{name}?", "answer": "42"}) + "\n")
    before = os.getcwd()
    os.chdir(root)
    try:
        yield {verifier: get_env("dataset", train="custom/train.jsonl", heldout="custom/heldout.jsonl",
                                 verifier=verifier, **({"answer_pattern": r"<a>(.*?)</a>"} if verifier == "regex" else {}))
               for verifier in ("exact", "numeric", "choice", "regex", "math")}
    finally:
        os.chdir(before)


TEXTS = st.text(max_size=200) | st.sampled_from(["\\boxed{", "\\boxed{1", "1e999", "nan", "-0", "0x1F", "1_000",
                                                 "\\frac{1}{0}", "A) B", "<a>42</a>", "9" * 5000])


@FUZZ
@given(completion=TEXTS, answer=st.text(max_size=30) | st.sampled_from(["42", "3.5", "B", "\\frac{3}{4}"]))
def test_dataset_verifiers(dataset_envs, completion, answer):
    SEEN["dataset verify (exact, numeric, choice, regex)"] += 4
    for verifier in ("exact", "numeric", "choice", "regex"):
        assert dataset_envs[verifier].verify(completion, answer) in (True, False)


@FEW
@given(completion=TEXTS, answer=st.sampled_from(["42", "\\frac{3}{4}", "x^2", "\\sqrt{2}"]))
def test_the_math_verifier(dataset_envs, completion, answer):
    SEEN["dataset verify (math)"] += 1
    assert dataset_envs["math"].verify(completion, answer) in (True, False)


def _u64(value: int) -> bytes:
    return struct.pack("<Q", value)


# a GGUF prefix, then counts, keys, types and lengths drawn from the edges a reader trips on
EDGES = st.sampled_from([0, 1, 2, 3, 8, 9, 99, 2 ** 31, 2 ** 32 - 1, 2 ** 62, 2 ** 63, 2 ** 64 - 1])
PIECES = st.one_of(EDGES.map(lambda v: struct.pack("<I", v % 2 ** 32)), EDGES.map(_u64), st.binary(max_size=16))


@FUZZ
@given(version=st.sampled_from([2, 3, 1, 99]), counts=st.tuples(EDGES, EDGES), pieces=st.lists(PIECES, max_size=24))
def test_gguf_header_walk(tmp_path_factory, version, counts, pieces):
    from posttrain.models.gguf_header import HeaderError, read_header

    SEEN["GGUF headers"] += 1
    path = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", version) + _u64(counts[0]) + _u64(counts[1]) + b"".join(pieces))
    try:
        found = read_header(path)
    except HeaderError as err:
        one_line(err)
    else:
        assert found["tensors"] * 24 <= Path(path).stat().st_size
