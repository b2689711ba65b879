"""KV-cache capacity arithmetic, following vLLM's V1 engine (see shared REFERENCE).

Units: bytes per token are per GPU; memory in bytes; a block holds `block_size` tokens.
Only the model's `config.json` (and safetensors headers, for the weights' size) is read.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from posttrain.capacity.modelconfig import GIB, head_counts, load_config_json, positive, text_config  # noqa: F401 (re-exported)
from posttrain.capacity.modelconfig import LARGEST_DIMENSION, count

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}
ATTENTION_LAYERS = {"full_attention", "attention", "sliding_attention", "chunked_attention"}
SAFETENSORS_HEADER_MAX_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE


@dataclass(frozen=True)
class KVSpec:
    """What one token costs in KV cache, per GPU, and what a sequence costs besides."""
    full_layers: int
    sliding_layers: int
    sliding_window: int | None
    other_layers: int          # linear attention / Mamba: fixed state per sequence, no per-token KV
    bytes_per_token_per_layer: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per token summed over all attention layers (full and sliding)."""
        return (self.full_layers + self.sliding_layers) * self.bytes_per_token_per_layer

    def session_bytes(self, tokens: int) -> int:
        """KV bytes one session of `tokens` tokens holds (sliding layers keep a window)."""
        window = min(tokens, self.sliding_window or tokens)
        return self.bytes_per_token_per_layer * (self.full_layers * tokens + self.sliding_layers * window)


def tp_fits(config: dict, tp: int) -> bool:
    """Whether vLLM can split the model over `tp` GPUs: `tp` divides the query heads, and
    divides the KV heads or is a multiple of them (each GPU then holds a replica of one).
    MLA's latent is not split, so only the query heads count there."""
    heads, kv_heads = head_counts(config)
    if tp < 1 or heads % tp:
        return False
    return bool(text_config(config).get("kv_lora_rank")) or (kv_heads % tp if tp <= kv_heads else tp % kv_heads) == 0


def tp_sizes(config: dict, up_to: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `up_to` that `tp_fits` (what an error offers instead)."""
    return [tp for tp in range(1, up_to + 1) if tp_fits(config, tp)]


def kv_dtype_bytes(config: dict, kv_dtype: str = "auto") -> int:
    """Bytes per cached value: 1 for fp8; else the model dtype, fp32 served as 16-bit."""
    if kv_dtype.startswith("fp8"):
        return 1
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return min(DTYPE_BYTES.get(dtype.replace("torch.", ""), 2), 2)


def kv_spec(config: dict, *, tp: int = 1, kv_dtype: str = "auto") -> KVSpec:
    """The per-GPU KV layout of a Hugging Face config (GQA/MHA, MLA, sliding, hybrid).
    ValueError when a count the layout needs is not a whole number >= 1, or `tp` does not fit."""
    cfg = text_config(config)
    dtype_bytes = kv_dtype_bytes(cfg, kv_dtype)
    layers = positive(cfg, "num_hidden_layers")
    heads, kv_heads = head_counts(cfg)
    if not tp_fits(cfg, tp):
        raise ValueError(f"tensor parallel size {tp} does not split {heads} attention heads / {kv_heads} KV heads")
    if cfg.get("kv_lora_rank"):  # MLA: one latent "head" per token per layer, not split by TP
        rope = positive(cfg, "qk_rope_head_dim") if cfg.get("qk_rope_head_dim") else 0
        return KVSpec(layers, 0, None, 0, (positive(cfg, "kv_lora_rank") + rope) * dtype_bytes)
    head_dim = positive(cfg, "head_dim") if cfg.get("head_dim") else positive(cfg, "hidden_size") // heads
    if head_dim < 1:
        raise ValueError(f"hidden_size {cfg['hidden_size']} is smaller than num_attention_heads {heads}")
    per_layer = 2 * max(1, kv_heads // tp) * head_dim * dtype_bytes
    types = cfg.get("layer_types")
    if types is None:  # all full attention; no list of `layers` entries (a hostile count would exhaust memory)
        return KVSpec(layers, 0, None, 0, per_layer)
    if not isinstance(types, list):
        raise ValueError("layer_types must be a list of layer kinds")
    window = positive(cfg, "sliding_window") if cfg.get("sliding_window") else None
    sliding = sum(t in {"sliding_attention", "chunked_attention"} for t in types) if window else 0
    full = sum(t in ATTENTION_LAYERS for t in types) - sliding
    return KVSpec(full, sliding, window if sliding else None, len(types) - full - sliding, per_layer)


def estimate_params(config: dict) -> int:
    """Parameters of a decoder-only transformer from its config, for when no weights are
    at hand: embeddings (tied or not), attention and gated MLP (or MoE experts) per layer.
    An estimate: norms and biases are left out (well under 1% for public models). ValueError
    naming a field that is not a whole number in range (`positive`)."""
    cfg = text_config(config)
    hidden, layers = positive(cfg, "hidden_size"), positive(cfg, "num_hidden_layers")
    heads, kv_heads = head_counts(cfg)
    head_dim = positive(cfg, "head_dim", hidden // heads)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    experts = count(cfg, "n_routed_experts") or count(cfg, "num_local_experts") or count(cfg, "num_experts")
    dense_mlp = 3 * hidden * (count(cfg, "intermediate_size") or 4 * hidden)
    mlp = dense_mlp if not experts else 3 * hidden * count(cfg, "moe_intermediate_size") * experts \
        + dense_mlp * count(cfg, "n_shared_experts")
    embeddings = count(cfg, "vocab_size") * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp)


def weight_bytes(model_dir: str | Path, config: dict) -> int:
    """Bytes of weights as served: safetensors headers' element counts (or, with no
    weights in the folder, `estimate_params`) x the served dtype's size.
    ValueError names a file whose header is not a safetensors header."""
    dtype_bytes = kv_dtype_bytes(text_config(config), "auto")
    elements = 0
    for file in Path(model_dir).glob("*.safetensors"):
        try:
            elements += header_elements(file)
        except (struct.error, ValueError, KeyError, TypeError, AttributeError, MemoryError, RecursionError) as err:
            raise ValueError(f"{file.name} has no readable safetensors header ({type(err).__name__})") from None
    return (elements or estimate_params(config)) * dtype_bytes


def header_elements(file: Path) -> int:
    """The elements of every tensor a safetensors file's header declares: at most
    SAFETENSORS_HEADER_MAX_BYTES of header (safetensors' own limit) and of dimensions in
    0..LARGEST_DIMENSION each (a hostile header could declare 10^400 elements)."""
    with open(file, "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        if size > SAFETENSORS_HEADER_MAX_BYTES:
            raise ValueError(f"a {size:,}-byte header")
        header = json.loads(fh.read(size))
    shapes = [t["shape"] for k, t in header.items() if k != "__metadata__"]
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= LARGEST_DIMENSION
               for shape in shapes for d in shape):
        raise ValueError("a dimension that is not a count")
    return sum(math.prod(shape) for shape in shapes)


def kv_memory_for(model_dir: str | Path, config: dict, *, profile: dict | None = None, utilization: float = 0.92,
                  tp: int = 1, kv_dtype: str = "auto", kv_memory_bytes: int | None = None) -> tuple:
    """(KV spec, weights' bytes per GPU, KV memory per GPU) of a model split over `tp` GPUs
    of `profile` (`posttrain.capacity.profiles.load_gpu_profile`), or with exactly `kv_memory_bytes` of KV memory."""
    spec = kv_spec(config, tp=tp, kv_dtype=kv_dtype)
    weights = weight_bytes(model_dir, config) // tp
    if kv_memory_bytes is None:
        kv_memory_bytes = kv_memory_on_gpu(int(profile["memory_gib"] * GIB), utilization, weights,
                                           int(profile["reserve_gib"] * GIB))
    return spec, weights, kv_memory_bytes


@dataclass(frozen=True)
class Capacity:
    kv_bytes_per_token: int
    block_size: int
    kv_memory_bytes: int
    num_blocks: int
    block_tokens: int          # num_blocks x block_size: token slots in the pool
    kv_cache_tokens: int       # vLLM's "KV cache size": max_concurrency x context_length
    context_length: int
    max_concurrency: float


def capacity(spec: KVSpec, *, kv_memory_bytes: int, block_size: int, context_length: int) -> Capacity:
    """vLLM's count: whole blocks of KV memory, and sessions of `context_length` tokens.

    num_blocks = kv_memory // (block_size x bytes per token); each session needs
    ceil(L / block_size) whole blocks (fewer on sliding layers, via `session_bytes`);
    max_concurrency = num_blocks / blocks per session; and, as vLLM 0.32 reports it
    (`get_kv_cache_capacity`), KV cache tokens = int(max_concurrency x L).
    """
    block_bytes = block_size * spec.kv_bytes_per_token
    num_blocks = max(0, kv_memory_bytes // block_bytes) if block_bytes else 0
    blocks_per_session = math.ceil(spec.session_bytes(context_length) / block_bytes) if block_bytes else 0
    concurrency = num_blocks / blocks_per_session if blocks_per_session else 0.0
    return Capacity(spec.kv_bytes_per_token, block_size, kv_memory_bytes, num_blocks, num_blocks * block_size,
                    int(concurrency * context_length), context_length, concurrency)


def kv_memory_on_gpu(gpu_bytes: int, utilization: float, weights: int, reserve: int) -> int:
    """Memory left for KV: total x utilisation - weights - activation/runtime reserve."""
    return max(0, int(gpu_bytes * utilization) - weights - reserve)


def as_dict(cap: Capacity) -> dict:
    return asdict(cap)


@dataclass(frozen=True)
class Paging:
    paged_sessions: float         # sessions that fit when each holds only the blocks it uses
    reserved_sessions: float      # sessions that fit when each reserves the full context
    paged_waste: float            # share of allocated KV memory holding no token (last-block slack)
    reserved_waste: float         # share of reserved KV memory holding no token


def paging(spec: KVSpec, *, num_blocks: int, block_size: int, context_length: int,
           session_lengths: list[int]) -> Paging:
    """Paged blocks (vLLM) versus reserving `context_length` per session, for sessions whose
    lengths are drawn from `session_lengths` (tokens, each <= context_length)."""
    block_bytes = block_size * spec.kv_bytes_per_token
    used = [spec.session_bytes(n) for n in session_lengths]
    paged = [math.ceil(u / block_bytes) * block_bytes for u in used]
    reserved = math.ceil(spec.session_bytes(context_length) / block_bytes) * block_bytes
    pool = num_blocks * block_bytes
    mean_used, mean_paged = sum(used) / len(used), sum(paged) / len(paged)
    return Paging(pool / mean_paged, pool / reserved, 1 - mean_used / mean_paged, 1 - mean_used / reserved)


def concurrency_by_context(spec: KVSpec, *, kv_memory_bytes: int, block_size: int,
                           contexts: list[int]) -> list[dict]:
    """Maximum concurrent sessions at each context length (the serving plot's points)."""
    return [{"context_length": n, "max_concurrency": capacity(spec, kv_memory_bytes=kv_memory_bytes,
                                                              block_size=block_size, context_length=n).max_concurrency}
            for n in contexts]
