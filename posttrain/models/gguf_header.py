"""A GGUF file's header, walked with every count checked against the bytes left before it is
used: what `posttrain model import` reads before the `gguf` package parses the file.

A header is counts and lengths (tensors, metadata entries, string lengths, array lengths,
dimensions) that a reader trusts to size what it reads next; a damaged or hostile file can
claim 2^62 tensors or a 2^63-byte string in a few bytes. This walk never allocates what a
header claims: strings are skipped by seeking, arrays by arithmetic, each count is refused
when even its smallest encoding would not fit in what remains of the file, and every
tensor's data must lie inside the file, aligned, and overlap no other's.

Layout (GGUF v2 and v3, little-endian): magic `GGUF`, version u32, tensor count u64,
metadata count u64; each metadata entry a string key, a u32 type and its value (arrays: an
element type u32, a count u64, the elements); each tensor a string name, n_dims u32, n_dims
u64 dimensions, a u32 type and a u64 offset into the data, which starts at the next
multiple of `general.alignment` (32 by default) after the header.
"""

from __future__ import annotations

import struct
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 8                 # GGML's GGML_MAX_DIMS is 4; anything far past it is damage
MAX_DEPTH = 4                # arrays of arrays, nested this deep at most
SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
STRING, ARRAY = 8, 9
MIN_ENTRY = 8 + 4 + 1        # a metadata entry: an empty key, its type, a one-byte value
MIN_TENSOR = 8 + 4 + 4 + 8   # a tensor: an empty name, n_dims 0, its type, its offset


class HeaderError(ValueError):
    """The file is not a GGUF file a reader can trust; the message says where and why."""


class _Cursor:
    def __init__(self, fh, size: int):
        self.fh, self.size, self.at = fh, size, 0

    def left(self) -> int:
        return self.size - self.at

    def take(self, count: int, what: str) -> bytes:
        if count > self.left():
            raise HeaderError(f"{what} at byte {self.at:,} runs past the end of the file ({self.size:,} bytes)")
        data = self.fh.read(count)
        self.at += count
        return data

    def skip(self, count: int, what: str) -> None:
        if count > self.left():
            raise HeaderError(f"{what} at byte {self.at:,} claims {count:,} bytes, more than the file's "
                              f"{self.left():,} left")
        self.at += count
        self.fh.seek(self.at)

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def count(self, what: str, smallest: int) -> int:
        """A u64 count whose items take at least `smallest` bytes each: refused unless they fit."""
        found = self.u64(what)
        if found * smallest > self.left():
            raise HeaderError(f"{what} claims {found:,}, more than the {self.left():,} bytes left could hold")
        return found

    def string(self, what: str, keep: int = 0) -> str:
        """A length-prefixed string: its first `keep` bytes read (as text), the rest skipped."""
        length = self.u64(f"{what}'s length")
        if length > self.left():
            raise HeaderError(f"{what} at byte {self.at:,} claims {length:,} bytes, more than the file's "
                              f"{self.left():,} left")
        head = self.take(min(length, keep), what)
        self.skip(length - len(head), what)
        return head.decode("utf-8", "replace")


def _skip_value(cur: _Cursor, kind: int, what: str, depth: int = 0) -> None:
    if kind in SCALARS:
        cur.skip(SCALARS[kind], what)
    elif kind == STRING:
        cur.string(what)
    elif kind == ARRAY:
        if depth >= MAX_DEPTH:
            raise HeaderError(f"{what} nests arrays more than {MAX_DEPTH} deep")
        inner = cur.u32(f"{what}'s element type")
        if inner not in SCALARS and inner not in (STRING, ARRAY):
            raise HeaderError(f"{what} has an unknown element type {inner}")
        smallest = SCALARS.get(inner, 8 if inner == STRING else 12)
        items = cur.count(f"{what}'s element count", smallest)
        if inner in SCALARS:
            cur.skip(items * SCALARS[inner], what)
        else:
            for _ in range(items):
                _skip_value(cur, inner, what, depth + 1)
    else:
        raise HeaderError(f"{what} has an unknown value type {kind}")


KEEP = {"general.alignment", "general.architecture"}


def read_header(path: str | Path) -> dict:
    """{version, tensors, metadata, alignment, architecture, data_start, data_end} of the GGUF
    file at `path`, every count and offset checked (module docstring); HeaderError on the
    first problem. Bounded: reads at most the file once, allocates nothing a count claims."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        cur = _Cursor(fh, size)
        if cur.take(4, "the magic") != MAGIC:
            raise HeaderError("it does not begin with the bytes GGUF")
        version = cur.u32("the version")
        if version not in VERSIONS:
            raise HeaderError(f"version {version} is not one this reader knows ({', '.join(map(str, VERSIONS))})")
        tensors = cur.count("the tensor count", MIN_TENSOR)
        entries = cur.count("the metadata count", MIN_ENTRY)
        alignment, architecture = 32, None
        for i in range(entries):
            key = cur.string(f"metadata entry {i}'s key", keep=64)
            kind = cur.u32(f"metadata {key!r}'s type")
            if key == "general.alignment" and kind == 4:
                alignment = cur.u32(f"metadata {key!r}")
            elif key == "general.architecture" and kind == STRING:
                architecture = cur.string(f"metadata {key!r}", keep=64)
            else:
                _skip_value(cur, kind, f"metadata {key!r}")
        if alignment == 0 or alignment & (alignment - 1):
            raise HeaderError(f"general.alignment {alignment} is not a power of two")
        spans = []
        for i in range(tensors):
            name = cur.string(f"tensor {i}'s name", keep=64)
            dims = cur.u32(f"tensor {name!r}'s dimension count")
            if dims > MAX_DIMS:
                raise HeaderError(f"tensor {name!r} claims {dims} dimensions (GGML has at most 4)")
            shape = [cur.u64(f"tensor {name!r}'s dimension") for _ in range(dims)]
            kind = cur.u32(f"tensor {name!r}'s type")
            offset = cur.u64(f"tensor {name!r}'s offset")
            if offset % alignment:
                raise HeaderError(f"tensor {name!r}'s offset {offset:,} is not a multiple of the alignment {alignment}")
            spans.append((offset, name, shape, kind))
    data_start = -(-cur.at // alignment) * alignment
    return {"version": version, "tensors": tensors, "metadata": entries, "alignment": alignment,
            "architecture": architecture, "data_start": data_start, "spans": spans, "size": size}


def check_spans(header: dict, nbytes) -> None:
    """Every tensor's data inside the file and overlapping no other's; `nbytes(kind, shape)`
    is the tensor's size in bytes (None for a type the caller does not know: refused)."""
    end_before, previous = header["data_start"], None
    for offset, name, shape, kind in sorted(header["spans"]):
        count = nbytes(kind, shape)
        if count is None:
            raise HeaderError(f"tensor {name!r} has an unknown tensor type {kind}")
        start = header["data_start"] + offset
        if start < end_before:
            raise HeaderError(f"tensor {name!r}'s data overlaps tensor {previous!r}'s")
        if start + count > header["size"]:
            raise HeaderError(f"tensor {name!r}'s data ends at byte {start + count:,}, past the end of the file "
                              f"({header['size']:,} bytes): it is truncated")
        end_before, previous = start + count, name
