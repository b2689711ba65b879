"""What an optimizer keeps per trained tensor: the state bytes behind `posttrain memory --optim`.

Units: bytes. A tensor is one parameter of the model (`Tensor`: its transformers name, its
element count, and `(out, in)` for a linear layer's weight); `dtype` is the bytes per element of
the trained weight as the optimizer sees it (4 for fp32, 2 for bf16). Each rule is read off the
installed package's own code:

- AdamW (torch; `adamw_torch`, `adamw_torch_fused`, ...): two moments in the weight's dtype,
  `2 x dtype` per element. SGD (`sgd`, no momentum by default): nothing.
- 8-bit AdamW (bitsandbytes; `adamw_bnb_8bit`, `adamw_8bit`, `paged_adamw_8bit`):
  `bitsandbytes.optim.optimizer.Optimizer2State.init_state` keeps two uint8 states (1 byte per
  element each) and, block-wise, one fp32 absmax per 256 elements per state
  (`2 + 2 x 4 x ceil(n / 256) / n` bytes per element); a tensor of fewer than `min_8bit_size`
  = 4,096 elements keeps two fp32 states (8 bytes per element), and so does every
  `nn.Embedding` weight: transformers' Trainer registers them for 32-bit states
  (`GlobalOptimManager.register_module_override(module, "weight", {"optim_bits": 32})`,
  `Trainer.create_optimizer`). Its quantisation maps are two 256-entry tables shared by all.
- GaLore (galore-torch; `galore_adamw`): each targeted linear weight of shape (out, in) keeps
  Adam's two moments of its projected gradient, `r' x max(out, in)` each with
  `r' = min(rank, min(out, in))`, and the projection: `GaLoreProjector.get_orthogonal_matrix`
  takes a slice of `torch.linalg.svd`'s factor, and for an fp32 gradient that slice is a view
  that keeps the whole `min(out, in)^2` factor alive (a bf16 one is copied: `r' x min(out, in)`
  in bf16). Every other parameter gets AdamW. The projection is recomputed by an SVD every
  `update_proj_gap` steps (the first step included): a transient of `U` (out x k), `S` (k)
  and `Vh` (k x in) in fp32, k = min(out, in), plus an fp32 copy of a 16-bit gradient; every
  step, `project_back` makes the full-size update and its scaled copy.
- LoGRA (`logra`, an estimate: no maintained implementation runs here; see
  docs/memory.md): each targeted linear weight keeps a rank-r sketch of its gradient instead of
  the gradient (`out x r` in fp32), RowAdam's one second moment per output row (`out` fp32),
  its `[r, in]` random projection (regenerated from a seed, held while the layer's sketch
  accumulates), and an fp32 master copy when the weights themselves are 16-bit; no first moment.
  Read off NeMo Automodel's documentation (its nightly `gradient_sketch` pages: the sketch
  `[rows, rank]`, the projection `[rank, width]`, `second_moment` `[rows, 1]`, "fp32 masters of
  low-precision targets"); the sketch's dtype and the default targets are not stated there:
  fp32 and every attention and MLP projection are assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ADAMW_BYTES = 2          # moments per element, times the weight's dtype
BNB_BLOCK = 256          # bitsandbytes' block-wise 8-bit optimizers: elements per absmax
BNB_MIN_8BIT = 4096      # bitsandbytes' `min_8bit_size`: smaller tensors keep 32-bit states
EMBEDDING = "embed_tokens"


@dataclass(frozen=True)
class Tensor:
    """One parameter: its transformers name (`{i}` for the layer index), elements and, for a
    linear layer's weight, (out, in) features."""
    name: str
    numel: int
    linear: tuple[int, int] | None = None

    def module(self) -> str:
        """The module the parameter belongs to (`model.layers.{i}.mlp.up_proj`)."""
        return self.name.rsplit(".", 1)[0]


def kind(optim: str) -> str:
    """The family of a transformers `optim` name whose states the plan knows: `adamw`,
    `8bit` (bitsandbytes AdamW), `sgd`, `galore`, `logra`; any other name plans as AdamW."""
    if optim == "logra":
        return "logra"
    if optim.startswith("galore_"):
        return "galore"
    if "8bit" in optim:
        return "8bit"
    if optim.startswith("sgd"):
        return "sgd"
    return "adamw"


def adamw(t: Tensor, dtype: int) -> int:
    return ADAMW_BYTES * dtype * t.numel


def bnb_8bit(t: Tensor) -> int:
    """bitsandbytes' 8-bit AdamW states of one tensor (module docstring)."""
    if t.numel < BNB_MIN_8BIT or EMBEDDING in t.name:
        return 8 * t.numel
    return 2 * t.numel + 2 * 4 * math.ceil(t.numel / BNB_BLOCK)


def galore(t: Tensor, dtype: int, rank: int) -> int:
    """GaLore's moments and projection of one targeted linear weight (module docstring)."""
    out, inp = t.linear
    small = min(out, inp)
    r = min(rank, small)
    projection = small * small * 4 if dtype == 4 else r * small * dtype
    return 2 * r * max(out, inp) * dtype + projection


def galore_step(t: Tensor, dtype: int) -> int:
    """The transient of one target's step: the larger of a projection update (U, S, Vh in fp32,
    and an fp32 copy of a 16-bit gradient) and `project_back`'s full-size update and its scaled
    copy (2 x out x in in the weight's dtype)."""
    out, inp = t.linear
    k = min(out, inp)
    svd = 4 * (out * k + k + k * inp) + (4 * out * inp if dtype != 4 else 0)
    return max(svd, 2 * dtype * out * inp)


def bnb_cpu_step(t: Tensor) -> int:
    """bitsandbytes' 8-bit step on a CPU (`backends/cpu/ops.py`): both states dequantised to
    fp32, and fp32 copies of the gradient and the weight, one tensor at a time (16 bytes per
    element); CUDA's kernel updates in place."""
    return 16 * t.numel if t.numel >= BNB_MIN_8BIT and EMBEDDING not in t.name else 0


def logra(t: Tensor, rank: int, sixteen_bit: bool) -> tuple[int, int]:
    """(gradient, optimizer) bytes of one LoGRA target: the fp32 sketch in place of its
    gradient; the row moment, and an fp32 master where the weight is 16-bit."""
    out, inp = t.linear
    r = min(rank, inp)
    return 4 * out * r, 4 * out + (4 * t.numel if sixteen_bit else 0)


def logra_projection(t: Tensor, rank: int) -> int:
    """One target's `[r, in]` fp32 projection, alive while its layer's sketch accumulates."""
    _, inp = t.linear
    return 4 * min(rank, inp) * inp
