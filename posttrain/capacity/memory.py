"""Training memory per GPU, from a model's config.json alone: what `posttrain memory` prints.

Units: bytes, per GPU. Shapes: P parameters in the model, T the ones that train (P, or a
LoRA adapter's), L the parameters of its largest module (DeepSpeed's
`largest_layer_params`: the embedding in every decoder here), N GPUs in all (gpus x nodes),
b sequences per micro-batch, s tokens per sequence, c completion tokens (GRPO), V vocab.

Model states (weights, gradients, optimizer states) follow DeepSpeed's estimators
exactly (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`;
mixed-precision AdamW: 2 bytes of 16-bit weights per parameter, and 18 per trained
parameter of 16-bit and fp32 gradients (6), fp32 master weights (4) and Adam's two moments
(8)), extended to the cases they leave out (ZeRO-0/1, LoRA, fp32 training on a CPU):

    zero 0           2P + 18T                    (no sharding: DDP)
    zero 1           2P + 6T + 12T/N             (optimizer states sharded)
    zero 2           2P + 18T/N                  (and gradients)
    zero 2, offload  2P                          (optimizer and gradients on the CPU)
    zero 3           4L + 18T/N (+ 2(P-T)/N)     (weights too; one gathered layer in flight)
    zero 3, offload  4L + 2P/N; with params offloaded too, 4L

fp32 training (the CPU default) keeps 4 bytes of weights, 4 of gradients and 8 of Adam per
parameter, no 16-bit copies; so does the Trainer without DeepSpeed on a GPU, since TRL 1.x
loads models in float32 and trains them under bf16 autocast (plus the bf16 copies of the
trained weights autocast keeps for the backward pass, 2T): `Setup.engine` tells them apart. The other parts are stated per function: the reference
model, activations (with and without gradient checkpointing), the vocab-sized tensors the
loss needs, and generation (a colocated vLLM's share of the GPU, or transformers' KV
cache); bench/training_memory.py measures the whole against real TRL steps on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from posttrain.capacity import optimizers
from posttrain.capacity.modelconfig import GIB, LARGEST_DIMENSION, BadField, field_refused, head_counts, positive, text_config
from posttrain.capacity.optimizers import Tensor
from posttrain.yamlfile import show

DECODERS = {"llama", "mistral", "qwen2", "qwen3", "gemma2"}  # dense decoders: gate/up/down MLP, GQA attention
LAYER_NORMS = {"gemma2": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm")}  # RMSNorms per layer where not Llama's two
TIED_BY_DEFAULT = {"gemma2"}  # model types whose config ties the head unless it says otherwise
ADAM_STATES = 8      # bytes per trained parameter: Adam's two fp32 moments
MIXED_GRADS = 6      # 16-bit and fp32 gradients (DeepSpeed's count)
MASTER = 4           # fp32 master weights in mixed precision
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Shape.linears order
LINEARS = frozenset(LINEAR_NAMES)
ATTENTION = frozenset(LINEAR_NAMES[:4])


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, from its config.json."""
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) features of one layer's linear modules: q, k, v, o, gate, up, down."""
        q = self.heads * self.head_dim
        return [(self.hidden, q), (self.hidden, self.kv_dim), (self.hidden, self.kv_dim), (q, self.hidden),
                (self.hidden, self.intermediate), (self.hidden, self.intermediate), (self.intermediate, self.hidden)]

    @property
    def params(self) -> int:
        """P: embedding (+ an untied output head), per layer the linears (+ q/k/v biases,
        + q/k norms), two RMSNorms, and the final norm."""
        layer = sum(i * o for i, o in self.linears()) + len(self.norms) * self.hidden
        layer += (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        layer += 2 * self.head_dim if self.qk_norm else 0
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    @property
    def largest_layer(self) -> int:
        """L: the parameters of the largest single module (as DeepSpeed's `model_to_params`)."""
        return max([self.vocab * self.hidden] + [i * o for i, o in self.linears()])

    def layer_tensors(self) -> list[Tensor]:
        """One decoder layer's parameters, named as transformers names them (`{i}` the layer)."""
        found = []
        for name, (i, o) in zip(LINEAR_NAMES, self.linears()):
            module = f"model.layers.{{i}}.{'self_attn' if name in ATTENTION else 'mlp'}.{name}"
            found.append(Tensor(f"{module}.weight", i * o, (o, i)))
            if self.qkv_bias and name in ("q_proj", "k_proj", "v_proj"):
                found.append(Tensor(f"{module}.bias", o))
        if self.qk_norm:
            found += [Tensor(f"model.layers.{{i}}.self_attn.{n}.weight", self.head_dim) for n in ("q_norm", "k_norm")]
        return found + [Tensor(f"model.layers.{{i}}.{n}.weight", self.hidden)
                        for n in self.norms]

    def outer_tensors(self) -> list[Tensor]:
        """The parameters outside the layers: the embedding, the final norm, an untied head."""
        head = [] if self.tied else [Tensor("lm_head.weight", self.vocab * self.hidden, (self.vocab, self.hidden))]
        return [Tensor("model.embed_tokens.weight", self.vocab * self.hidden),
                Tensor("model.norm.weight", self.hidden)] + head

    def lora_tensors(self, rank: int, modules: frozenset[str] = LINEARS) -> list[Tensor]:
        """One layer's LoRA adapter of rank `rank`: lora_A (r x in) and lora_B (out x r) per module."""
        return [t for name, (i, o) in zip(LINEAR_NAMES, self.linears()) if name in modules
                for t in (Tensor(f"{name}.lora_A", rank * i, (rank, i)), Tensor(f"{name}.lora_B", o * rank, (o, rank)))]

    def lora_params(self, rank: int, modules: frozenset[str] = LINEARS) -> int:
        """T of a LoRA adapter of rank `rank` on the named linears of every layer (all of
        them: peft's `all-linear`): r x (in + out) per module."""
        return self.layers * sum(rank * (i + o) for name, (i, o) in zip(LINEAR_NAMES, self.linears())
                                 if name in modules)


def shape(config: dict) -> Shape:
    """The decoder shape of a Hugging Face config; ValueError naming what is missing or
    which model types are known."""
    cfg = text_config(config)
    kind = cfg.get("model_type", "")
    if kind not in DECODERS:
        raise ValueError(f"model_type {str(kind)[:40]!r} is not one of the decoders this plan knows "
                         f"({', '.join(sorted(DECODERS))}: gate/up/down MLP, GQA attention)")
    heads, kv_heads = head_counts(cfg)
    hidden = positive(cfg, "hidden_size")
    return Shape(vocab=positive(cfg, "vocab_size"), hidden=hidden, layers=positive(cfg, "num_hidden_layers"),
                 heads=heads, kv_heads=kv_heads, head_dim=positive(cfg, "head_dim", hidden // heads),
                 intermediate=positive(cfg, "intermediate_size"),
                 tied=bool(cfg.get("tie_word_embeddings", kind in TIED_BY_DEFAULT)),
                 qkv_bias=bool(cfg.get("attention_bias", kind in ("qwen2", "qwen2_5"))), qk_norm=kind == "qwen3",
                 norms=LAYER_NORMS.get(kind, ("input_layernorm", "post_attention_layernorm")))


@dataclass(frozen=True)
class Setup:
    """One training setup: method, sharding, precision and batch."""
    method: str = "grpo"            # sft | grpo | ppo
    zero: int = 0                   # 0 (DDP) .. 3; FSDP full sharding counts as 3
    gpus: int = 1                   # per node
    nodes: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False    # ZeRO-3 only
    lora_rank: int = 0              # 0: every weight trains
    lora_modules: frozenset[str] = LINEARS  # the linears LoRA adapts (LINEAR_NAMES)
    optim: str = "adamw_torch"      # transformers' `optim`: AdamW, 8-bit (`adamw_bnb_8bit`), `sgd`,
                                    # GaLore (`galore_adamw`), or `logra` (an estimate): posttrain/capacity/optimizers.py
    galore_rank: int = 128          # GaLore's rank (transformers' default for `optim_args: rank=...`)
    galore_targets: str | tuple[str, ...] = LINEAR_NAMES  # `optim_target_modules`, matched as transformers matches
    sketch_rank: int = 256          # LoGRA's sketch rank (NeMo Automodel's default)
    beta: float = 0.0               # KL weight: > 0 keeps a reference model (GRPO, PPO)
    batch: int = 1                  # b: sequences per micro-batch per GPU
    seq: int = 1024                 # s: tokens per sequence (prompt + completion)
    completion: int | None = None   # c: completion tokens (GRPO's logits); None: s
    gradient_checkpointing: bool = False
    mixed_precision: bool = True    # bf16 compute (GPU); False: fp32 (CPU)
    engine: str | None = None       # deepspeed (16-bit weights, fp32 master) | trainer (the Trainer without
                                    # DeepSpeed, FSDP as zero 3: fp32 weights under bf16 autocast); None: deepspeed
                                    # for zero >= 1, else trainer
    cpu: bool = False               # on CPUs: PyTorch ops where a GPU runs TRL's Triton kernels
    vllm_share: float = 0.0         # colocated vLLM's share of the GPU (GRPO generation)
    gpu_bytes: int = 0              # the GPU's memory, for the vLLM share and the budget
    accumulation: int = 1           # gradient_accumulation_steps: > 1 keeps gradients between backward passes
    load_bytes: int = 4             # bytes per weight as TRL loads the model (model_init_kwargs dtype): float32 4
                                    # (TRL 1.x's default), bfloat16 / float16 2; DeepSpeed casts to 16-bit anyway
    extra_trainable: int = 0        # LoRA: parameters of `modules_to_save`, trained whole
    trainable_layers: int = 0       # partial training (a stage's `trainable:`): the top this many layers and the
    trainable_patterns: tuple[str, ...] = ()  # final norm, and the parameters these globs name; neither: all train
    generation_batch: int | None = None  # sequences generated at once per GPU (GRPO); None: the micro-batch
    gather_for_generation: bool = False  # DeepSpeed ZeRO-3: TRL gathers the whole 16-bit model to generate
    vllm_server: bool = False       # generation on a vLLM server elsewhere: none here


@dataclass(frozen=True)
class Plan:
    """Per GPU, in bytes. `total_bytes` is the peak of a step's two phases on top of what
    stays resident (weights, optimizer states, the reference, a colocated vLLM): sampling
    (transformers' KV cache, and under ZeRO-3 the gathered model) or the backward pass
    (activations and the loss's logit work; the gradients too where they outlive a step,
    `gradients_held`, else whichever of the two is larger)."""
    params: int
    trainable_params: int
    largest_layer_params: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    model_states_bytes: int
    reference_bytes: int
    critic_bytes: int
    reward_model_bytes: int
    activations_bytes: int
    logits_bytes: int
    generation_bytes: int
    optimizer_step_bytes: int    # a transient of the optimizer step beyond its states (GaLore's SVD)
    total_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def engine(setup: Setup) -> str:
    """Who holds the model states: `deepspeed` or the Trainer alone (`trainer`)."""
    return setup.engine or ("deepspeed" if setup.zero >= 1 else "trainer")


def sixteen_bit_weights(setup: Setup) -> bool:
    """Whether the weights themselves are 16-bit: DeepSpeed in mixed precision casts the
    model; the Trainer keeps the fp32 weights TRL loads (TRL 1.x loads float32 unless
    `model_init_kwargs` says otherwise) and computes under bf16 autocast."""
    return setup.mixed_precision and engine(setup) == "deepspeed"


@dataclass(frozen=True)
class Trained:
    """What trains: each tensor with its number of copies (a layer's tensor once per trained
    layer), how many decoder layers the backward pass runs through (from the lowest trained
    one to the top), and whether the output head trains."""
    tensors: tuple[tuple[Tensor, int], ...]
    depth: int
    head: bool

    @property
    def params(self) -> int:
        return sum(t.numel * n for t, n in self.tensors)


def trained(shape: Shape, setup: Setup) -> Trained:
    """The parameters a setup trains: a LoRA adapter (and `modules_to_save`), the top
    `trainable_layers` and the final norm and what `trainable_patterns` name (as
    posttrain.training.trainable selects them), or all of them."""
    layers, outer = shape.layer_tensors(), shape.outer_tensors()
    if setup.lora_rank:
        saved = ((Tensor("modules_to_save", setup.extra_trainable), 1),) if setup.extra_trainable else ()
        adapter = tuple((t, shape.layers) for t in shape.lora_tensors(setup.lora_rank, setup.lora_modules))
        return Trained(adapter + saved, shape.layers, False)
    if not (setup.trainable_layers or setup.trainable_patterns):
        return Trained(tuple((t, shape.layers) for t in layers) + tuple((t, 1) for t in outer), shape.layers, True)
    from posttrain.training.trainable import selected

    top = setup.trainable_layers or None
    chosen = set(selected([t.name for t in outer], top_layers=top, patterns=list(setup.trainable_patterns),
                          num_layers=shape.layers))
    counts, lowest = {}, shape.layers
    indices = range(shape.layers) if setup.trainable_patterns else range(shape.layers - min(top, shape.layers),
                                                                         shape.layers)
    for i in indices:  # a layer's names with its index: the patterns may name some layers only
        names = [t.name.format(i=i) for t in layers]
        keep = set(selected(names, top_layers=top, patterns=list(setup.trainable_patterns), num_layers=shape.layers))
        for t, name in zip(layers, names):
            if name in keep:
                counts[t] = counts.get(t, 0) + 1
                lowest = min(lowest, i)
    head = "lm_head.weight" in chosen or (shape.tied and "model.embed_tokens.weight" in chosen)
    depth = shape.layers if "model.embed_tokens.weight" in chosen else shape.layers - lowest
    tensors = tuple(counts.items()) + tuple((t, 1) for t in outer if t.name in chosen)
    return Trained(tensors, depth, head)


@dataclass(frozen=True)
class OptimizerStates:
    """Unsharded bytes of what an optimizer keeps for the trained tensors: the gradients it
    reads, its states (moments, projections, masters it keeps itself) and the transient of
    its step (GaLore's SVD)."""
    gradients: int
    states: int
    transient: int


def galore_targets(setup: Setup, what: Trained) -> set[str]:
    """The trained linear weights GaLore projects: the modules `galore_targets` names, as
    transformers matches `optim_target_modules` (`all-linear`: every linear, the head too)."""
    from posttrain.training.optimizer_options import matching

    modules = {t.module().format(i=0): t.name for t, _ in what.tensors if t.linear}
    return {modules[m] for m in matching(setup.galore_targets, list(modules))}


def logra_targets(what: Trained) -> set[str]:
    """LoGRA's assumed targets: every trained attention and MLP projection."""
    return {t.name for t, _ in what.tensors if t.linear and t.name.split(".")[-2] in LINEARS}


def optimizer_states(setup: Setup, what: Trained, dtype: int) -> OptimizerStates:
    """The optimizer's bytes for the trained tensors, each by its rule
    (posttrain/capacity/optimizers.py); `dtype`: bytes per element of the trained weights."""
    family = optimizers.kind(setup.optim)
    gradients = states = transient = 0
    targets = galore_targets(setup, what) if family == "galore" else logra_targets(what) if family == "logra" else set()
    for t, n in what.tensors:
        grad, state = dtype * t.numel, optimizers.adamw(t, dtype)
        if family == "8bit":
            state = optimizers.bnb_8bit(t)
            transient = max(transient, optimizers.bnb_cpu_step(t) if setup.cpu else 0)
        elif family == "sgd":
            state = 0
        elif t.name in targets and family == "galore":
            state = optimizers.galore(t, dtype, setup.galore_rank)
            transient = max(transient, optimizers.galore_step(t, dtype))
        elif t.name in targets:  # LoGRA
            grad, state = optimizers.logra(t, setup.sketch_rank, dtype == 2)
            transient = max(transient, optimizers.logra_projection(t, setup.sketch_rank))
        gradients, states = gradients + grad * n, states + state * n
    return OptimizerStates(gradients, states, transient)


def flat_moments(setup: Setup, t: int) -> int:
    """DeepSpeed's optimizer states over its flat fp32 partitions of `t` trained parameters:
    AdamW 8 bytes each, bitsandbytes' 8-bit AdamW 2 and an fp32 absmax per 256, SGD none."""
    family = optimizers.kind(setup.optim)
    if family in ("galore", "logra"):
        raise ValueError(f"{setup.optim} projects whole weight matrices, which DeepSpeed's flat partitions are not: "
                         "plan it with the Trainer alone (--engine trainer: DDP, or FSDP as --zero 3)")
    if family == "8bit":
        return 2 * t + 2 * 4 * math.ceil(t / optimizers.BNB_BLOCK)
    return 0 if family == "sgd" else ADAM_STATES * t


def model_states(p: int, t: int, largest: int, setup: Setup,
                 optimizer: OptimizerStates | None = None) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per GPU for `p` parameters of which `t` train
    (the table in the module docstring). Totals equal DeepSpeed's estimators for full
    training in mixed precision (ZeRO-2: 2P + int(18P/N); ZeRO-3: 4L + int(18P/N)). The
    Trainer without DeepSpeed keeps the weights as TRL loads them (`load_bytes`: fp32 by
    default), gradients and the optimizer's states in the same dtype (4 + 4 + 8 per trained
    parameter in fp32 with AdamW), a LoRA adapter in fp32; FSDP shards them as ZeRO-3 does.
    `optimizer`: the Trainer's per-tensor gradients and states (`optimizer_states`); None:
    AdamW's."""
    n = setup.gpus * setup.nodes
    if not sixteen_bit_weights(setup):  # the Trainer: the weights as loaded; fp32 on the CPU
        w = setup.load_bytes if setup.mixed_precision else 4
        lora = p > t
        trained_bytes = 4 if lora else w  # peft keeps the adapter in fp32 (autocast_adapter_dtype)
        if optimizer is None:
            optimizer = OptimizerStates(trained_bytes * t, ADAM_STATES * trained_bytes // 4 * t, 0)
        weights, gradients, states = _shard(w * (p - t) + trained_bytes * t, optimizer.gradients, optimizer.states,
                                            setup.zero, n, largest)
        if setup.offload_optimizer and setup.zero >= 1:  # the step runs on the CPU, with the gradients
            states, gradients = 0, 0 if setup.zero >= 2 else gradients
        return (4 * largest if setup.offload_params else weights), gradients, states
    zero = setup.zero
    frozen = p - t
    fixed = MIXED_GRADS + MASTER  # DeepSpeed's 18 per trained parameter, with AdamW's 8 of moments
    moments = flat_moments(setup, t)
    if zero == 3:
        if setup.offload_optimizer and setup.offload_params:
            return 4 * largest, 0, 0
        if setup.offload_optimizer:
            return 4 * largest + int(2 * p / n), 0, 0
        total = 4 * largest + int((fixed * t + moments) / n) + int(2 * frozen / n)
        weights = 4 * largest + int(2 * p / n)
        gradients = int(4 * t / n)
        return weights, gradients, total - weights - gradients
    if setup.offload_optimizer and zero >= 1:
        return 2 * p, 0, 0
    if zero == 2:
        total = 2 * p + int((fixed * t + moments) / n)
        gradients = int(MIXED_GRADS * t / n)
        return 2 * p, gradients, total - 2 * p - gradients
    states = MASTER * t + moments
    return 2 * p, MIXED_GRADS * t, int(states / n) if zero == 1 else states


def _shard(weights: int, gradients: int, optimizer: int, zero: int, n: int, largest: int) -> tuple[int, int, int]:
    """fp32 states sharded as ZeRO stage `zero` shards them over `n` GPUs."""
    if zero >= 1:
        optimizer = int(optimizer / n)
    if zero >= 2:
        gradients = int(gradients / n)
    if zero == 3:
        weights = 4 * largest + int(weights / n)
    return weights, gradients, optimizer


def activations(shape: Shape, setup: Setup, depth: int | None = None) -> int:
    """Bytes autograd keeps for the backward pass of one micro-batch (b x s tokens).
    Per token and layer, a Llama block keeps about 11H + 3K + 4I values (H hidden, K the
    KV width, I the MLP width: both RMSNorms' fp32 inputs and outputs, q/k/v and their
    rotated copies, the attention output, the gate, up, activation and product of the
    MLP), 2 bytes each in bf16 (9H + 3K + 4I at 4 bytes in fp32, where the norms need no
    upcast). Fused attention keeps no s x s scores. With gradient checkpointing, each
    layer keeps only its input (H per token) and one layer is recomputed at a time. Only the
    `depth` layers the backward pass runs through keep anything: below the lowest trained
    layer nothing needs a gradient (partial training)."""
    depth = shape.layers if depth is None else depth
    h, k, i = shape.hidden, shape.kv_dim, shape.intermediate
    per_layer = 2 * (11 * h + 3 * k + 4 * i) if setup.mixed_precision else 4 * (9 * h + 3 * k + 4 * i)
    tokens = setup.batch * setup.seq
    if setup.gradient_checkpointing:
        return tokens * (depth * h * (2 if setup.mixed_precision else 4) + (per_layer if depth else 0))
    return tokens * depth * per_layer


# TRL 1.x never materialises a whole [tokens, vocab] logits tensor: both trainers patch the
# model with a fused LM head (trl.trainer.utils.add_fused_lm_head) whose log-prob kernel
# (trl.kernels.chunked_logprob) projects and folds one tile of at most TILE_TOKENS x
# TILE_VOCAB logits at a time, forward and backward.
TILE_TOKENS = 4096      # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
TILE_VOCAB = 32768      # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
# fp32 temporaries of one tile besides the tile itself: where Triton runs the fold (CUDA),
# the fp32 copy the gradient GEMMs read; in torch ops (the CPU), measured with
# bench/training_memory.py (7 per tile, for SFT and GRPO alike).
TILE_FP32_COPIES = {"cuda": 1, "cpu": 7}


def logits(shape: Shape, setup: Setup, head_trains: bool = True) -> int:
    """Bytes of the loss's vocab-sized work, TRL 1.x's chunked log-prob kernel: one tile of
    min(N, TILE_TOKENS) x min(V, TILE_VOCAB) logits in the model's dtype plus
    `TILE_FP32_COPIES` fp32 copies, and the backward's fp32 accumulators: N x H for the
    hidden states' gradient and, when the output head trains, V x H for its weight (and
    its 16-bit copy where the weights are 16-bit: DeepSpeed). N, the tokens scored: on a GPU
    (Triton) only those with a label, the completion for GRPO and PPO (b x c; every token,
    b x s, for SFT: an upper bound); in torch ops (the CPU) every position, b x (s - 1)."""
    if setup.cpu:
        tokens = setup.batch * (setup.seq - 1)
    else:
        tokens = setup.batch * (setup.seq if setup.method == "sft" else (setup.completion or setup.seq))
    dtype = 2 if setup.mixed_precision else 4
    tile = min(tokens, TILE_TOKENS) * min(shape.vocab, TILE_VOCAB)
    head = 0 if setup.lora_rank or not head_trains else shape.vocab * shape.hidden * (4 + (2 if sixteen_bit_weights(setup) else 0))
    return tile * (dtype + 4 * TILE_FP32_COPIES["cpu" if setup.cpu else "cuda"]) + 4 * tokens * shape.hidden + head


def generation(shape: Shape, setup: Setup) -> int:
    """GRPO / PPO sampling: a colocated vLLM's share of the GPU (resident throughout), none
    with a vLLM server elsewhere, else transformers' generate KV cache for the generation
    batch (2 x layers x K x g x s values, g the sequences generated at once)."""
    if setup.method == "sft" or setup.vllm_server:
        return 0
    if setup.vllm_share:
        return int(setup.vllm_share * setup.gpu_bytes)
    g = setup.generation_batch or setup.batch
    return 2 * shape.layers * shape.kv_dim * g * setup.seq * (2 if setup.mixed_precision else 4)


def autocast_copies(p: int, t: int, setup: Setup, backward_params: int | None = None) -> int:
    """The 16-bit casts of fp32 weights that bf16 autocast hands to each matmul and autograd
    keeps for the backward pass: 2 bytes per fp32 weight the backward pass runs through
    (`backward_params`: all of them unless partial training stops it lower) when the model is
    loaded in fp32, else the LoRA adapter's, without gradient checkpointing (which keeps only
    each layer's input and recomputes the rest)."""
    if not setup.mixed_precision or sixteen_bit_weights(setup) or setup.gradient_checkpointing:
        return 0
    fp32 = (p if backward_params is None else backward_params) if setup.load_bytes == 4 else (t if p > t else 0)
    return int(2 * fp32 / setup.gpus / setup.nodes) if setup.zero == 3 else 2 * fp32


def plan(config: dict, setup: Setup) -> Plan:
    """Every part of one training setup's peak memory per GPU."""
    s = shape(config)
    p = s.params
    what = trained(s, setup)
    t = what.params
    n = setup.gpus * setup.nodes
    frozen_dtype = 2 if sixteen_bit_weights(setup) else setup.load_bytes if setup.mixed_precision else 4
    added = t if setup.lora_rank else 0  # the adapter and peft's trainable copies of `modules_to_save`
    optimizer_plan = None
    if not sixteen_bit_weights(setup):
        optimizer_plan = optimizer_states(setup, what, 4 if setup.lora_rank or not setup.mixed_precision
                                          else setup.load_bytes)
    weights, gradients, optimizer = model_states(p + added, t, s.largest_layer, setup, optimizer_plan)
    states = weights + gradients + optimizer
    # TRL's reference model, loaded as the policy: absent with beta 0, and with LoRA (the base with adapters off)
    frozen_copy = int(frozen_dtype * p / n) if setup.zero == 3 else frozen_dtype * p
    reference = frozen_copy if setup.method in ("grpo", "ppo") and setup.beta > 0 and not setup.lora_rank else 0
    critic = states if setup.method == "ppo" else 0          # a value model as large as the policy, trained
    reward_model = frozen_copy if setup.method == "ppo" else 0
    partial = not setup.lora_rank and what.depth < s.layers
    layer_params = sum(x.numel for x in s.layer_tensors())
    through = what.depth * layer_params + s.vocab * s.hidden if partial else None
    acts = activations(s, setup, what.depth) + autocast_copies(p + added, t, setup, through)
    logit, gen = logits(s, setup, what.head), generation(s, setup)
    gather = 2 * p if setup.gather_for_generation and setup.zero == 3 and not (setup.vllm_share or setup.vllm_server) \
        else 0  # TRL gathers the ZeRO-3 model for transformers' generate, not for a vLLM engine
    resident = weights + optimizer + reference + critic + reward_model + (gen if setup.vllm_share else 0)
    held = gradients if gradients_held(setup) else 0
    step = gradients + (optimizer_plan.transient if optimizer_plan else 0)  # the optimizer step's own transient
    backward = max(acts + logit + held, step) if held else max(acts + logit, step)
    sampling = 0 if setup.vllm_share else gen + gather + held   # the KV cache is freed before the loss
    return Plan(params=p, trainable_params=t, largest_layer_params=s.largest_layer, weights_bytes=weights,
                gradients_bytes=gradients, optimizer_bytes=optimizer, model_states_bytes=states,
                reference_bytes=reference, critic_bytes=critic, reward_model_bytes=reward_model,
                activations_bytes=acts, logits_bytes=logit, generation_bytes=gen + gather,
                optimizer_step_bytes=step - gradients, total_bytes=resident + max(backward, sampling))


def gradients_held(setup: Setup) -> bool:
    """Whether the gradients exist while a backward pass starts (all activations and the
    loss's logit work held): with gradient accumulation (the earlier micro-batches'), under
    DeepSpeed (its gradient partitions and buckets) and under DDP on several processes (its
    buckets). Otherwise the Trainer frees them after each step (`zero_grad(set_to_none=True)`)
    and the backward pass creates them layer by layer as it frees that layer's
    activations: the peak is the larger of the two, not their sum."""
    return setup.accumulation > 1 or engine(setup) == "deepspeed" or setup.gpus * setup.nodes > 1


MOST_GPUS_PER_NODE = MOST_NODES = 1024  # as launcher.processes, launcher.nodes and training.num_gpus allow


def check_ranges(setup: Setup, where: str) -> None:
    """`posttrain memory`'s numbers within what a training job can be: a `UserError` naming
    the flag and its range otherwise (a 400-digit --seq would overflow the float
    arithmetic; --beta inf, NaN or a billion GPUs per node would print nonsense)."""
    from posttrain.errors import UserError

    completion = setup.seq if setup.completion is None else setup.completion
    ranges = [("--gpus", setup.gpus, 1, MOST_GPUS_PER_NODE), ("--nodes", setup.nodes, 1, MOST_NODES),
              ("--batch", setup.batch, 1, LARGEST_DIMENSION), ("--seq", setup.seq, 1, LARGEST_DIMENSION),
              ("--completion", completion, 1, setup.seq), ("--lora-rank", setup.lora_rank, 0, LARGEST_DIMENSION),
              ("--galore-rank", setup.galore_rank, 1, LARGEST_DIMENSION),
              ("--sketch-rank", setup.sketch_rank, 1, LARGEST_DIMENSION),
              ("--trainable-layers", setup.trainable_layers, 0, LARGEST_DIMENSION)]
    for flag, value, low, high in ranges:
        if not low <= value <= high:
            limit = " (at most --seq)" if flag == "--completion" else ""
            raise UserError(f"{where} {flag}", f"out of range: {show(value)} is not a whole number from {low:,} to "
                            f"{high:,}", f"pass one in that range{limit}")
    for flag, value, high, what in [("--beta", setup.beta, math.inf, "a finite number >= 0"),
                                    ("--vllm-share", setup.vllm_share, 1, "a fraction from 0 up to (not including) 1")]:
        if not 0 <= value < high:  # NaN fails every comparison
            raise UserError(f"{where} {flag}", f"out of range: {show(value)}", f"pass {what}")


LOGRA_ESTIMATE = ("LoGRA is an estimate from NeMo Automodel's documented gradient_sketch optimizer (no maintained "
                  "implementation runs here): fp32 sketches and every attention and MLP projection assumed")


def check_optimizer(setup: Setup, where: str) -> None:
    """`--optim` and the levers beside it as one training job can combine them: a `UserError`
    naming the flag otherwise."""
    from posttrain.errors import UserError
    from posttrain.training.optimizer_options import optimizer_names

    family = optimizers.kind(setup.optim)
    if setup.optim != "logra" and setup.optim not in optimizer_names():
        raise UserError(f"{where} --optim", f"{show(setup.optim)} is not a transformers optimizer",
                        "pass one of transformers' `optim` names (e.g. adamw_torch, adamw_bnb_8bit, galore_adamw), "
                        "or logra")
    if setup.lora_rank and (family in ("galore", "logra") or setup.trainable_layers):
        flag = "--trainable-layers" if setup.trainable_layers else "--optim"
        raise UserError(f"{where} {flag}", "a LoRA adapter trains on its own low-rank weights",
                        "leave out --lora-rank, or the other lever")
    if family == "galore" and setup.zero:
        raise UserError(f"{where} --optim", "GaLore projects each weight's whole gradient: transformers runs it "
                        "without sharding (DDP)", "plan it with --zero 0")
    if family == "logra" and engine(setup) == "deepspeed":
        raise UserError(f"{where} --optim", "LoGRA sketches whole weight matrices, which DeepSpeed's flat partitions "
                        "are not", "plan it with --engine trainer (DDP, or FSDP as --zero 3)")


def report(model: str, setup: Setup, *, gpu: str | None, gpus_file: str) -> dict:
    """`posttrain memory`'s figures for a model folder (or config.json): the plan, and with
    a GPU profile its memory and whether the plan fits. Bad input is a `UserError` naming
    the flag."""
    from posttrain.errors import UserError
    from posttrain.capacity.modelconfig import load_config_json
    from posttrain.capacity.profiles import load_gpu_profile

    where = "posttrain memory"

    def refused(err: Exception) -> UserError:
        if isinstance(err, FileNotFoundError):
            return UserError(model, "no config.json found", "pass a model folder or a config.json path")
        if isinstance(err, BadField):
            return field_refused(model, err)
        detail = f"no {err}" if isinstance(err, KeyError) else str(err)[:240]
        return UserError(model, f"cannot plan this model ({detail})", "pass a dense decoder's config.json")

    # the model's config.json first: a missing folder or a broken file is refused before the
    # optimizer check imports transformers (seconds of CPU for a typo in a path)
    try:
        config = load_config_json(model)
        layers = shape(config).layers
    except (FileNotFoundError, BadField, KeyError, ValueError, TypeError) as err:
        raise refused(err) from None
    check_ranges(setup, where)
    if setup.offload_params and setup.zero != 3:
        raise UserError(f"{where} --offload-params", "only ZeRO-3 shards and offloads the weights", "add --zero 3")
    if setup.vllm_share and not gpu:
        raise UserError(f"{where} --vllm-share", "a share of which GPU?", "name it with --gpu")
    if setup.trainable_layers > layers:
        raise UserError(f"{where} --trainable-layers", f"{setup.trainable_layers} exceeds the model's {layers} "
                        "decoder layers", f"pass at most {layers}")
    check_optimizer(setup, where)
    gpu_bytes = int(load_gpu_profile(gpus_file, gpu)["memory_gib"] * GIB) if gpu else 0
    try:
        figures = plan(config, Setup(**{**asdict(setup), "gpu_bytes": gpu_bytes})).as_dict()
    except (BadField, KeyError, ValueError, TypeError) as err:
        raise refused(err) from None
    if gpu:
        figures.update(gpu=gpu, gpu_bytes=gpu_bytes, fits=figures["total_bytes"] <= gpu_bytes)
    if setup.optim == "logra":
        figures["estimate"] = LOGRA_ESTIMATE
    return figures
