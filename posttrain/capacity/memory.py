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

from posttrain.capacity.modelconfig import GIB, LARGEST_DIMENSION, BadField, field_refused, head_counts, positive, text_config
from posttrain.yamlfile import show

DECODERS = {"llama", "mistral", "qwen2", "qwen3"}  # dense decoders: gate/up/down MLP, GQA attention
ADAM_STATES = 8      # bytes per trained parameter: Adam's two fp32 moments
MIXED_GRADS = 6      # 16-bit and fp32 gradients (DeepSpeed's count)
MASTER = 4           # fp32 master weights in mixed precision
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Shape.linears order
LINEARS = frozenset(LINEAR_NAMES)


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
        layer = sum(i * o for i, o in self.linears()) + 2 * self.hidden
        layer += (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        layer += 2 * self.head_dim if self.qk_norm else 0
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    @property
    def largest_layer(self) -> int:
        """L: the parameters of the largest single module (as DeepSpeed's `model_to_params`)."""
        return max([self.vocab * self.hidden] + [i * o for i, o in self.linears()])

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
                 intermediate=positive(cfg, "intermediate_size"), tied=bool(cfg.get("tie_word_embeddings", False)),
                 qkv_bias=bool(cfg.get("attention_bias", kind in ("qwen2", "qwen2_5"))), qk_norm=kind == "qwen3")


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
    optimizer_state_bytes: int = ADAM_STATES  # per trained parameter: AdamW's fp32 moments 8, 8-bit 2, SGD 0
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
    trainable_params: int = 0       # partial training (a stage's `trainable:`): the parameters that train; 0: all
    generation_batch: int | None = None  # sequences generated at once per GPU (GRPO); None: the micro-batch
    gather_for_generation: bool = False  # DeepSpeed ZeRO-3: TRL gathers the whole 16-bit model to generate
    vllm_server: bool = False       # generation on a vLLM server elsewhere: none here


def optimizer_state_bytes(optim: str) -> int:
    """Optimizer state bytes per trained parameter of a transformers `optim` name: 8-bit
    AdamW variants (bitsandbytes) 2, SGD 0, AdamW and the rest 8 (two fp32 moments)."""
    return 2 if "8bit" in optim else 0 if optim.startswith("sgd") else ADAM_STATES


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


def model_states(p: int, t: int, largest: int, setup: Setup) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per GPU for `p` parameters of which `t` train
    (the table in the module docstring). Totals equal DeepSpeed's estimators for full
    training in mixed precision (ZeRO-2: 2P + int(18P/N); ZeRO-3: 4L + int(18P/N)). The
    Trainer without DeepSpeed keeps the weights as TRL loads them (`load_bytes`: fp32 by
    default), gradients and AdamW's moments in the same dtype (4 + 4 + 8 per trained
    parameter in fp32), a LoRA adapter in fp32; FSDP shards them as ZeRO-3 does."""
    n = setup.gpus * setup.nodes
    adam = setup.optimizer_state_bytes
    if not sixteen_bit_weights(setup):  # the Trainer: the weights as loaded; fp32 on the CPU
        w = setup.load_bytes if setup.mixed_precision else 4
        lora = p > t
        trained = 4 if lora else w  # peft keeps the adapter in fp32 (autocast_adapter_dtype)
        moments = adam * trained // 4 if adam == ADAM_STATES else adam  # torch's AdamW: the parameter's dtype
        weights, gradients, optimizer = _shard(w * (p - t) + trained * t, trained * t, moments * t, setup.zero, n,
                                               largest)
        if setup.offload_optimizer and setup.zero >= 1:  # the step runs on the CPU, with the gradients
            optimizer, gradients = 0, 0 if setup.zero >= 2 else gradients
        return (4 * largest if setup.offload_params else weights), gradients, optimizer
    zero = setup.zero
    frozen = p - t
    per_trained = MIXED_GRADS + MASTER + adam  # DeepSpeed's 18 with AdamW
    if zero == 3:
        if setup.offload_optimizer and setup.offload_params:
            return 4 * largest, 0, 0
        if setup.offload_optimizer:
            return 4 * largest + int(2 * p / n), 0, 0
        total = 4 * largest + int(per_trained * t / n) + int(2 * frozen / n)
        weights = 4 * largest + int(2 * p / n)
        gradients = int(4 * t / n)
        return weights, gradients, total - weights - gradients
    if setup.offload_optimizer and zero >= 1:
        return 2 * p, 0, 0
    if zero == 2:
        total = 2 * p + int(per_trained * t / n)
        gradients = int(MIXED_GRADS * t / n)
        return 2 * p, gradients, total - 2 * p - gradients
    optimizer = (MASTER + adam) * t
    return 2 * p, MIXED_GRADS * t, int(optimizer / n) if zero == 1 else optimizer


def _shard(weights: int, gradients: int, optimizer: int, zero: int, n: int, largest: int) -> tuple[int, int, int]:
    """fp32 states sharded as ZeRO stage `zero` shards them over `n` GPUs."""
    if zero >= 1:
        optimizer = int(optimizer / n)
    if zero >= 2:
        gradients = int(gradients / n)
    if zero == 3:
        weights = 4 * largest + int(weights / n)
    return weights, gradients, optimizer


def activations(shape: Shape, setup: Setup) -> int:
    """Bytes autograd keeps for the backward pass of one micro-batch (b x s tokens).
    Per token and layer, a Llama block keeps about 11H + 3K + 4I values (H hidden, K the
    KV width, I the MLP width: both RMSNorms' fp32 inputs and outputs, q/k/v and their
    rotated copies, the attention output, the gate, up, activation and product of the
    MLP), 2 bytes each in bf16 (9H + 3K + 4I at 4 bytes in fp32, where the norms need no
    upcast). Fused attention keeps no s x s scores. With gradient checkpointing, each
    layer keeps only its input (H per token) and one layer is recomputed at a time."""
    h, k, i = shape.hidden, shape.kv_dim, shape.intermediate
    per_layer = 2 * (11 * h + 3 * k + 4 * i) if setup.mixed_precision else 4 * (9 * h + 3 * k + 4 * i)
    tokens = setup.batch * setup.seq
    if setup.gradient_checkpointing:
        return tokens * (shape.layers * h * (2 if setup.mixed_precision else 4) + per_layer)
    return tokens * shape.layers * per_layer


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


def logits(shape: Shape, setup: Setup) -> int:
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
    head = 0 if setup.lora_rank else shape.vocab * shape.hidden * (4 + (2 if sixteen_bit_weights(setup) else 0))
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


def autocast_copies(p: int, t: int, setup: Setup) -> int:
    """The 16-bit casts of fp32 weights that bf16 autocast hands to each matmul and autograd
    keeps for the backward pass: 2 bytes per fp32 weight (all of them when the model is
    loaded in fp32, else the LoRA adapter's), without gradient checkpointing (which keeps
    only each layer's input and recomputes the rest)."""
    if not setup.mixed_precision or sixteen_bit_weights(setup) or setup.gradient_checkpointing:
        return 0
    fp32 = p if setup.load_bytes == 4 else (t if p > t else 0)
    return int(2 * fp32 / setup.gpus / setup.nodes) if setup.zero == 3 else 2 * fp32


def plan(config: dict, setup: Setup) -> Plan:
    """Every part of one training setup's peak memory per GPU."""
    s = shape(config)
    p = s.params
    t = s.lora_params(setup.lora_rank, setup.lora_modules) + setup.extra_trainable if setup.lora_rank else \
        (setup.trainable_params or p)
    n = setup.gpus * setup.nodes
    frozen_dtype = 2 if sixteen_bit_weights(setup) else setup.load_bytes if setup.mixed_precision else 4
    added = t if setup.lora_rank else 0  # the adapter and peft's trainable copies of `modules_to_save`
    weights, gradients, optimizer = model_states(p + added, t, s.largest_layer, setup)
    states = weights + gradients + optimizer
    # TRL's reference model, loaded as the policy: absent with beta 0, and with LoRA (the base with adapters off)
    frozen_copy = int(frozen_dtype * p / n) if setup.zero == 3 else frozen_dtype * p
    reference = frozen_copy if setup.method in ("grpo", "ppo") and setup.beta > 0 and not setup.lora_rank else 0
    critic = states if setup.method == "ppo" else 0          # a value model as large as the policy, trained
    reward_model = frozen_copy if setup.method == "ppo" else 0
    acts = activations(s, setup) + autocast_copies(p + added, t, setup)
    logit, gen = logits(s, setup), generation(s, setup)
    gather = 2 * p if setup.gather_for_generation and setup.zero == 3 and not setup.vllm_share else 0
    resident = weights + optimizer + reference + critic + reward_model + (gen if setup.vllm_share else 0)
    held = gradients if gradients_held(setup) else 0
    backward = acts + logit + held if held else max(acts + logit, gradients)
    sampling = 0 if setup.vllm_share else gen + gather + held   # the KV cache is freed before the loss
    return Plan(params=p, trainable_params=t, largest_layer_params=s.largest_layer, weights_bytes=weights,
                gradients_bytes=gradients, optimizer_bytes=optimizer, model_states_bytes=states,
                reference_bytes=reference, critic_bytes=critic, reward_model_bytes=reward_model,
                activations_bytes=acts, logits_bytes=logit, generation_bytes=gen + gather,
                total_bytes=resident + max(backward, sampling))


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
              ("--completion", completion, 1, setup.seq), ("--lora-rank", setup.lora_rank, 0, LARGEST_DIMENSION)]
    for flag, value, low, high in ranges:
        if not low <= value <= high:
            limit = " (at most --seq)" if flag == "--completion" else ""
            raise UserError(f"{where} {flag}", f"out of range: {show(value)} is not a whole number from {low:,} to "
                            f"{high:,}", f"pass one in that range{limit}")
    for flag, value, high, what in [("--beta", setup.beta, math.inf, "a finite number >= 0"),
                                    ("--vllm-share", setup.vllm_share, 1, "a fraction from 0 up to (not including) 1")]:
        if not 0 <= value < high:  # NaN fails every comparison
            raise UserError(f"{where} {flag}", f"out of range: {show(value)}", f"pass {what}")


def report(model: str, setup: Setup, *, gpu: str | None, gpus_file: str) -> dict:
    """`posttrain memory`'s figures for a model folder (or config.json): the plan, and with
    a GPU profile its memory and whether the plan fits. Bad input is a `UserError` naming
    the flag."""
    from posttrain.errors import UserError
    from posttrain.capacity.modelconfig import load_config_json
    from posttrain.capacity.profiles import load_gpu_profile

    where = "posttrain memory"
    check_ranges(setup, where)
    if setup.offload_params and setup.zero != 3:
        raise UserError(f"{where} --offload-params", "only ZeRO-3 shards and offloads the weights", "add --zero 3")
    if setup.vllm_share and not gpu:
        raise UserError(f"{where} --vllm-share", "a share of which GPU?", "name it with --gpu")
    gpu_bytes = int(load_gpu_profile(gpus_file, gpu)["memory_gib"] * GIB) if gpu else 0
    try:
        config = load_config_json(model)
        figures = plan(config, Setup(**{**asdict(setup), "gpu_bytes": gpu_bytes})).as_dict()
    except FileNotFoundError:
        raise UserError(model, "no config.json found", "pass a model folder or a config.json path") from None
    except BadField as err:
        raise field_refused(model, err) from None
    except (KeyError, ValueError, TypeError) as err:
        detail = f"no {err}" if isinstance(err, KeyError) else str(err)[:240]
        raise UserError(model, f"cannot plan this model ({detail})", "pass a dense decoder's config.json") from None
    if gpu:
        figures.update(gpu=gpu, gpu_bytes=gpu_bytes, fits=figures["total_bytes"] <= gpu_bytes)
    return figures
