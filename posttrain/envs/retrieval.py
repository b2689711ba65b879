"""Questions answered from a local corpus through a search tool: `retrieval`.

The episode's tool `search(query)` ranks the corpus with BM25 (the `bm25s` package) and
shows the top `top_k` documents; the model then answers, graded by the `dataset`
environment's verifiers (`exact`, `numeric`, `math`, `choice`, `regex`) on its last reply.

    data:
      env: retrieval
      chat: true
      options: {corpus: custom/docs.jsonl, train: custom/train.jsonl, heldout: custom/heldout.jsonl,
                verifier: exact}

The corpus is JSON lines in `custom/`, one document a line (`id_field`, `text_field`); the
question files and their options are the `dataset` environment's. Without `corpus`, a
built-in corpus of invented towns (each document a town's founding year and population,
none of them knowable without looking) and its questions are generated from
`corpus_seed`: the smallest demo, numeric answers.

The index is built in `prepare` and written to `data/index/` (an output of the stage, so
DVC versions it with the splits); the later stages load it from there when its corpus
digest matches, and build it in memory otherwise (`posttrain check`, before prepare). Each
row's gold episode (for the SFT warmup) searches with the question, reads the results and
answers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from posttrain.envs.dataset import VERIFIERS, DatasetEnv, DatasetOptions
from posttrain.errors import OptionError, invalid
from posttrain.files import json_lines
from posttrain.plugins import CUSTOM_DIR, resolve

INDEX_DIR = "data/index"  # where prepare writes the index, from the workspace
DIGEST_FILE = "corpus.sha256"
MAX_DOCUMENTS = 200_000
MAX_DOCUMENT_CHARS = 20_000

_SYLLABLES = ["var", "nel", "os", "trel", "ka", "dun", "mir", "ath", "bel", "sor", "quin", "ta", "lo", "vek",
              "ran", "dor", "ise", "hal", "um", "pry", "gen", "cal", "wy", "zet"]
_REGIONS = ["northern", "southern", "eastern", "western", "coastal", "highland", "river", "lake"]
_QUESTIONS = [("In what year was {town} founded?", "founded"), ("How many people live in {town}?", "population")]


class SearchIndex:
    """BM25 over a corpus, loaded from `index_dir` when it holds this corpus's index."""

    def __init__(self, documents: list[dict], digest: str, index_dir: str | None):
        import bm25s

        self.documents, self.digest = documents, digest
        saved = Path(index_dir) / DIGEST_FILE if index_dir else None
        self.loaded = saved is not None and saved.is_file() and saved.read_text().strip() == digest
        if self.loaded:  # prepare's index (data/index), for this very corpus
            self.bm25 = bm25s.BM25.load(index_dir, load_vocab=True, show_progress=False)
        else:
            self.bm25 = bm25s.BM25()
            self.bm25.index(self._tokens([d["text"] for d in documents]), show_progress=False)

    @staticmethod
    def _tokens(texts: list[str]):
        import bm25s

        return bm25s.tokenize(texts, stopwords="en", show_progress=False)

    def save(self, index_dir: Path) -> None:
        index_dir.mkdir(parents=True, exist_ok=True)
        self.bm25.save(str(index_dir), show_progress=False)
        (index_dir / DIGEST_FILE).write_text(self.digest + "\n")

    def search(self, query: str, k: int) -> list[dict]:
        tokens = self._tokens([query[:2000]])
        if not tokens.ids or not tokens.ids[0]:
            return []
        hits, scores = self.bm25.retrieve(tokens, k=min(k, len(self.documents)), show_progress=False)
        return [self.documents[int(i)] for i, s in zip(hits[0], scores[0]) if s > 0]


class RetrievalEpisode:
    """One episode: the model may search the corpus; the answer is in its last reply."""

    def __init__(self, index: SearchIndex, top_k: int):
        self.index, self.top_k = index, top_k

    def reset(self, **row) -> None:
        return None

    def search(self, query: str) -> str:
        """Search the documents and see the best matches.

        Args:
            query: A few words naming what to look up, for example "Varnel founded".
        """
        hits = self.index.search(query, self.top_k)
        return "\n".join(f"[{d['id']}] {d['text']}" for d in hits) if hits else "(no document matches)"


class RetrievalOptions(DatasetOptions):
    """`data.options` of the retrieval environment: the dataset environment's, the corpus and the search."""
    corpus: str | None = Field(None, min_length=1, description="Documents: a .jsonl file in custom/, one "
                               "document a line; null for the built-in towns corpus.")
    id_field: str = Field("id", min_length=1, description="Corpus: the column holding a document's id.")
    text_field: str = Field("text", min_length=1, description="Corpus: the column holding a document's text.")
    train: str | None = Field(None, min_length=1, description="Training questions (.jsonl or .parquet in custom/); "
                              "with `corpus`.")
    heldout: str | None = Field(None, min_length=1, description="Held-out questions, same format; with `corpus`.")
    verifier: Literal[VERIFIERS] = Field("numeric", description=f"How a reply is judged: one of {', '.join(VERIFIERS)}.")
    top_k: int = Field(3, ge=1, le=20, description="Documents a search shows.")
    max_turns: int = Field(3, ge=1, le=20, description="Tool-calling rounds an episode may take.")
    system: str | None = Field("Look the answer up with the search tool, then reply with the answer only.",
                               max_length=20_000, description="System prompt (before the tools' descriptions).")
    towns: int = Field(300, ge=10, le=5000, description="Built-in corpus: towns (two questions each).")
    corpus_seed: int = Field(0, description="Built-in corpus: the seed that invents the towns.")
    heldout_size: int = Field(200, ge=1, le=5000, description="Built-in corpus: questions held out.")

    @model_validator(mode="after")
    def _files_together(self):
        given = [name for name in ("corpus", "train", "heldout") if getattr(self, name)]
        if given and len(given) < 3:
            missing = sorted({"corpus", "train", "heldout"} - set(given))
            raise invalid(f"{', '.join(given)} given without {', '.join(missing)}",
                          "give a corpus and both question files (custom/), or none of them for the built-in corpus")
        if not given and self.heldout_size >= 2 * self.towns:
            raise invalid(f"heldout_size {self.heldout_size} leaves no question of {2 * self.towns} to train on",
                          "hold out fewer questions or raise towns")
        return self


class RetrievalEnv(DatasetEnv):
    name = "retrieval"
    Options = RetrievalOptions

    def __init__(self, **options):
        given = RetrievalOptions(**options)
        self.setup(given)  # the dataset environment's verifiers grade the replies
        self.built_in = given.corpus is None
        self.max_turns, self.top_k = given.max_turns, given.top_k
        self.documents, self._facts = (towns(given.towns, given.corpus_seed) if self.built_in
                                       else (self._read_corpus(), None))
        self.digest = corpus_digest(self.documents)
        # one index for every episode TRL builds: prepare's (data/index) when it is this corpus's
        self.index = SearchIndex(self.documents, self.digest, INDEX_DIR)
        self.episode = functools.partial(RetrievalEpisode, self.index, self.top_k)

    def _read_corpus(self) -> list[dict]:
        path = Path(self.options.corpus)
        if path.is_absolute() or ".." in path.parts or path.parts[0] != CUSTOM_DIR or path.suffix != ".jsonl":
            raise OptionError("corpus", f"{str(path)[:200]!r} is not a .jsonl file inside the workspace's "
                              f"{CUSTOM_DIR}/ folder", f"put the documents in {CUSTOM_DIR}/, e.g. {CUSTOM_DIR}/docs.jsonl")
        if not resolve(path).is_file():
            raise OptionError("corpus", f"{path} does not exist", f"write the documents to {path}, one JSON object a line")
        documents, seen = [], {}
        with open(resolve(path), "rb") as fh:
            for number, record, problem in json_lines(fh):
                try:
                    if problem:
                        raise ValueError(problem)
                    doc = {"id": str(record[self.options.id_field]), "text": str(record[self.options.text_field])}
                except (ValueError, KeyError, TypeError):
                    raise OptionError("corpus", f"{path} line {number} is not a JSON object with "
                                      f"{self.options.id_field!r} and {self.options.text_field!r}",
                                      "fix the line, or set data.options.id_field / text_field") from None
                documents.append(self._checked(doc, path, number))
                if doc["id"] in seen:  # search results name documents by id: two of one id are ambiguous
                    raise OptionError("corpus", f"{path} line {number}: id {doc['id'][:80]!r} is also line "
                                      f"{seen[doc['id']]}'s", "give every document its own id")
                seen[doc["id"]] = number
        if not documents:
            raise OptionError("corpus", f"{path} has no documents", "give at least one")
        return documents

    @staticmethod
    def _checked(doc: dict, path: Path, number: int) -> dict:
        if not doc["text"].strip() or len(doc["text"]) > MAX_DOCUMENT_CHARS:
            raise OptionError("corpus", f"{path} line {number}: the text is empty or over {MAX_DOCUMENT_CHARS} "
                              "characters", "split long documents into passages")
        if number > MAX_DOCUMENTS:
            raise OptionError("corpus", f"{path} has over {MAX_DOCUMENTS} documents", "index fewer")
        return doc

    def generate(self, seed: int) -> dict[str, list[dict]]:
        splits = super().generate(seed) if not self.built_in else self._built_in_splits(seed)
        return {name: [self.with_trace(r) for r in rows] for name, rows in splits.items()}

    def _built_in_splits(self, seed: int) -> dict[str, list[dict]]:
        rows = [{"prompt": question.format(town=fact["town"]), "completion": str(fact[key]), "answer": str(fact[key])}
                for fact in self._facts for question, key in _QUESTIONS]
        random.Random(seed).shuffle(rows)
        held = self.options.heldout_size
        return {"train": rows[held:], "heldout": rows[:held]}

    def with_trace(self, row: dict) -> dict:
        """The row with its gold episode: search with the question, read, answer."""
        call = {"type": "function", "function": {"name": "search", "arguments": {"query": row["prompt"]}}}
        return {**row, "trace": [{"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "name": "search", "content": self.episode().search(row["prompt"])},
                                 {"role": "assistant", "content": row["completion"]}]}

    def save_index(self, index_dir: Path) -> dict:
        """Write the search index to `index_dir` (prepare: data/index); what it wrote, for the manifest."""
        self.index.save(index_dir)
        return {"documents": len(self.documents), "sha256": self.digest}


def corpus_digest(documents: list[dict]) -> str:
    return hashlib.sha256(json.dumps(documents, sort_keys=True).encode()).hexdigest()


def towns(count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The built-in corpus: `count` invented towns, each a document, and their facts."""
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize())
    facts, documents = [], []
    for i, town in enumerate(sorted(names)):
        fact = {"town": town, "founded": rng.randrange(1200, 1950), "population": rng.randrange(800, 90_000)}
        region = rng.choice(_REGIONS)
        facts.append(fact)
        documents.append({"id": f"town-{i:04d}", "text": f"{town} is a town in the {region} region. It was founded "
                          f"in {fact['founded']} and {fact['population']} people live there."})
    return documents, facts
