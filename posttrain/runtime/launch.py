"""Training under a launcher: `torchrun` or `accelerate launch`, on several processes and nodes.

A training stage (sft, grpo@NAME) does the work around training in its own process: data,
the pass-rate filter, evaluation, the gate, its outputs and its MLflow run. Its training
goes through `train(config, stage, function, job)`, by the stage's `launcher` (the
pipeline's `launcher:` unless the stage has its own):

- `in_process`: `function(config, job)` runs here, as it always did.
- `torchrun` / `accelerate`: the job goes to `<run_dir>/launch/job.json` and the launcher
  starts `python -m posttrain.runtime.launch JOB` as every process of this node (node 0); other
  nodes join with `posttrain join` and receive the job from rank 0. Every rank runs
  `function(config, job)`: the Trainer shards the batches and syncs the gradients (DDP,
  or DeepSpeed ZeRO / FSDP as the accelerate config says). Only global rank 0 saves the
  model, writes `result.json` and lets the Trainer log its training metrics to the
  stage's MLflow run; each rank reports what it trained on and a digest of its final
  weights to `ranks/rank-N.json`. The stage's own process then writes the metrics files
  and the rest of the run (`launch/ranks.json` among it), as in-process.
- A rank that raises writes its one-line reason to `errors/rank-N.txt`; the launcher ends
  the other ranks (torch elastic) and the stage fails with that line (`TrainingFailed`).

Multi-node launches use static rendezvous (node 0 at `rdzv_endpoint`), so global rank 0 is
always node 0's first process: the node that runs the stage holds the job. The workspace
(job, checkpoints, outputs) must be on a filesystem every node sees.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from posttrain.runtime import lifetime
from posttrain.errors import TrainingFailed, UserError
from posttrain.files import read_json, write_json
from posttrain.runtime.host_checks import rdzv_endpoint
from posttrain.probe import free_port, tcp_problem
from posttrain.redact import redact_text
from posttrain.yamlfile import show

LAUNCH_DIR = "launch"          # inside a stage's checkpoint run folder
EXAMPLES_KEPT = 2000           # example digests a rank report keeps (the count is exact)


def command(launcher, *, node_rank: int = 0, job: str | None = None, where: str = "launcher") -> list[str]:
    """The launcher's command line that runs `python -m posttrain.runtime.launch [JOB]` on this node."""
    nodes, per_node = launcher.nodes, launcher.processes
    if launcher.type == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
               "--max-restarts", "0"]
        if nodes == 1:
            cmd.append("--standalone")  # a free port on loopback
        else:
            host, port = rdzv_endpoint(launcher, where)
            cmd += ["--node-rank", str(node_rank), "--master-addr", host, "--master-port", port,
                    "--rdzv-conf", f"timeout={launcher.rdzv_timeout_s}"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launcher.accelerate_config,
               "--num_processes", str(nodes * per_node), "--num_machines", str(nodes)]
        if nodes > 1:
            host, port = rdzv_endpoint(launcher, where)
            cmd += ["--machine_rank", str(node_rank), "--main_process_ip", host, "--main_process_port", port,
                    "--rdzv_conf", f"timeout={launcher.rdzv_timeout_s}"]
        else:
            cmd += ["--main_process_port", str(free_port())]
    return [*cmd, "-m", "posttrain.runtime.launch", *([job] if job else [])]


def launch_env() -> dict[str, str]:
    """The ranks' environment: this one, on the CPU where there is no CUDA (gloo)."""
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def train(config, stage: str, function, job: dict) -> dict:
    """Run `function(config, job)` (a module-level function) under the stage's launcher; its
    result (JSON), plus `world_size`. `job["run_dir"]` holds the launch files; a launched rank
    imports `function` by its module and name (`import_path`)."""
    launcher = config.stage_launcher(stage)
    if launcher.type == "in_process":
        return {**function(config, job), "world_size": 1}
    from posttrain.tracking.recorder import Recorder

    recorder = Recorder.active()
    folder = Path(job["run_dir"]) / LAUNCH_DIR
    for old in ("ranks", "errors"):  # a resumed job's reports are the new ones
        shutil.rmtree(folder / old, ignore_errors=True)
    (folder / "result.json").unlink(missing_ok=True)
    write_json(folder / "job.json", {"config": config.model_dump(mode="json", by_alias=True),
                                     "function": import_path(function), "job": job, "stage": stage, "cwd": os.getcwd(),
                                     **recorder.handle()})
    cmd = command(launcher, job=str(folder / "job.json"), where=f"{stage}: launcher")
    print(f"posttrain: {stage}: training on {launcher.nodes} node(s) x {launcher.processes} process(es) "
          f"({launcher.type}){awaited(launcher, stage)}", flush=True)
    code = run_streamed(cmd)
    if code != 0 or not (folder / "result.json").is_file():
        raise TrainingFailed(failure(stage, folder, code))
    ranks = [read_json(p) for p in sorted((folder / "ranks").glob("rank-*.json"), key=lambda p: int(p.stem[5:]))]
    recorder.tag("posttrain.launcher", f"{launcher.type} {launcher.nodes}x{launcher.processes}")
    recorder.text(json.dumps(ranks, indent=1), f"{LAUNCH_DIR}/ranks.json")
    return {**read_json(folder / "result.json"), "world_size": launcher.nodes * launcher.processes}


def awaited(launcher, stage: str) -> str:
    """What node 0 waits for, and until when, on several nodes (else nothing)."""
    if launcher.nodes == 1:
        return ""
    return (f"; waits for nodes 1..{launcher.nodes - 1} (`posttrain join --stage {stage} --node-rank N` there) "
            f"until {clock_after(launcher.rdzv_timeout_s)} (launcher.rdzv_timeout_s)")


def clock_after(seconds: float) -> str:
    """The local date and time `seconds` from now: when a wait ends."""
    return f"{datetime.datetime.now() + datetime.timedelta(seconds=seconds):%Y-%m-%d %H:%M:%S}"


def run_streamed(cmd: list[str]) -> int:
    """Run the launcher, its output passed through; it (and its ranks) end with this thread."""
    with subprocess.Popen(cmd, env=launch_env(), stdout=sys.stdout, stderr=sys.stderr,
                          preexec_fn=lifetime.die_with_this_thread()) as proc:
        return proc.wait()


def failure(stage: str, folder: Path, code: int) -> str:
    """One line: the first rank that failed and why (a rank's own error before one that
    only lost its peers), else the launcher's exit code."""
    errors = sorted((folder / "errors").glob("rank-*.txt"), key=lambda p: (p.name.endswith(".secondary.txt"),
                                                                          p.stat().st_mtime))
    if errors and not errors[0].name.endswith(".secondary.txt"):
        return f"{stage}: {errors[0].read_text().strip()}"
    seen = f"; {errors[0].read_text().strip()}" if errors else ""
    return (f"{stage}: the launcher exited with code {code} and no rank raised an error of its own (a rank was "
            f"killed: out of memory, or from outside){seen}")


def import_path(function) -> str:
    """`module:name` of a module-level function: how a rank process finds it (`resolve`)."""
    if "." in function.__qualname__:
        raise ValueError(f"{function.__qualname__} is not a module-level function: a launched rank cannot import it")
    return f"{function.__module__}:{function.__qualname__}"


def resolve(function: str):
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)


# --- on every rank -------------------------------------------------------------------------
def rank() -> tuple[int, int]:
    """(global rank, world size) of this process; (0, 1) outside a launched job."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def is_main() -> bool:
    return rank()[0] == 0


def from_main(value):
    """`value` as rank 0 has it, on every rank of a launched job (as is outside one)."""
    if rank()[1] == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Recorder:
    """Wraps a Trainer's data collator and keeps a digest of every example this rank
    trained on (what shows that the ranks shared the work, not repeated it)."""

    def __init__(self, collator):
        self.collator, self.count, self.digests = collator, 0, []

    def __call__(self, examples):
        for example in examples:
            self.count += 1
            if len(self.digests) < EXAMPLES_KEPT:
                text = json.dumps(example, sort_keys=True, default=lambda v: getattr(v, "tolist", lambda: str(v))())
                self.digests.append(hashlib.sha1(text.encode()).hexdigest()[:16])
        return self.collator(examples)


def observe(trainer) -> Recorder | None:
    """Start recording what this rank trains on, in a launched job (None otherwise)."""
    if rank()[1] == 1:
        return None
    recorder = Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    return recorder


def weights_digest(model) -> str | None:
    """sha256 of a model's parameters (names and bytes, in order); None when this process
    holds only shards of them (DeepSpeed ZeRO-3, FSDP's DTensors) or cannot read them."""
    import torch

    digest = hashlib.sha256()
    try:
        for name, param in model.named_parameters():
            if param.numel() == 0 or hasattr(param, "ds_id") or type(param.data) is not torch.Tensor:
                return None
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    except (RuntimeError, TypeError):  # a report never fails a stage
        return None
    return digest.hexdigest()


def report(trainer, recorder: Recorder | None, run_dir: str) -> None:
    """This rank's report: world size, the examples it trained on, its final weights' digest."""
    if recorder is None:
        return
    global_rank, world = rank()
    model = trainer.accelerator.unwrap_model(trainer.model)
    write_json(Path(run_dir) / LAUNCH_DIR / "ranks" / f"rank-{global_rank}.json",
               {"rank": global_rank, "world_size": world, "backend": trainer.accelerator.state.backend,
                "distributed_type": str(trainer.accelerator.distributed_type), "examples": recorder.count,
                "example_digests": recorder.digests, "weights_sha256": weights_digest(model)})


def worker(job_path: str | None) -> None:
    """One rank of a launched job: receive the job (rank 0 reads it, the others get it from
    rank 0), run it, leave the result (rank 0) or the reason it failed."""
    lifetime.die_with_parent()  # the launcher's agent: a killed stage leaves no rank behind
    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState()  # joins the process group the launcher set up (gloo without CUDA)
    box = [read_json(job_path) if job_path and state.is_main_process else None]
    dist.broadcast_object_list(box, src=0)
    spec = box[0]
    os.chdir(spec["cwd"])  # the workspace (a joining node may start elsewhere): custom/, relative paths
    folder = Path(spec["job"]["run_dir"]) / LAUNCH_DIR
    try:
        result = run_job(spec)
    except BaseException as err:
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:400]
        # a rank that lost its peers (one died) fails too: that is not the cause
        kind = "secondary" if lost_a_peer(err) else "error"
        (folder / "errors").mkdir(parents=True, exist_ok=True)
        (folder / "errors" / f"rank-{state.process_index}.{kind}.txt").write_text(
            f"rank {state.process_index} of {state.num_processes} failed: {redact_text(reason)}\n")
        raise
    if state.is_main_process:
        write_json(folder / "result.json", result)
    if dist.is_initialized():  # gloo's threads end before the interpreter: left to exit, a rank aborted (SIGABRT)
        dist.destroy_process_group()


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err` is a collective that failed because another rank went away."""
    import torch.distributed as dist

    lost = ("connection closed by peer", "connection reset by peer", "broken pipe", "nccl communicator was aborted",
            "timed out", "socket")
    return isinstance(err, getattr(dist, "DistBackendError", ())) or any(w in str(err).lower() for w in lost)


def run_job(spec: dict) -> dict:
    """The job's function on this rank; rank 0 logs into the stage's MLflow run (`attached`)."""
    from posttrain.config import PipelineConfig

    config = PipelineConfig.model_validate(spec["config"])
    function = resolve(spec["function"])
    if not (is_main() and spec["run_id"]):
        return function(config, spec["job"])
    from posttrain.tracking.recorder import attached

    with attached(spec):  # left RUNNING: the stage's own process ends the run, with the stage's outcome
        return function(config, spec["job"])


def join(config, stage: str, node_rank: int, where: str) -> int:
    """Node `node_rank`'s part of the next launched job of `stage` (`posttrain join`)."""
    launcher = config.stage_launcher(stage)
    if launcher.nodes == 1:
        raise UserError(where, f"stage {stage} runs on one node (launcher.nodes is 1): there is nothing to join",
                        "set launcher.nodes (and type torchrun or accelerate) in the config")
    if not 1 <= node_rank < launcher.nodes:
        raise UserError(f"{where} --node-rank", f"{show(node_rank)} is not one of the other nodes "
                        f"1..{launcher.nodes - 1}",
                        "node 0 is the one that runs the stage; give each other node its own rank")
    wait_for_node0(launcher, stage, node_rank, where)
    started = time.perf_counter()
    code = run_streamed(command(launcher, node_rank=node_rank, where=where))
    print(f"posttrain: join {stage}: node {node_rank} done in {time.perf_counter() - started:.0f} s, exit {code}",
          flush=True)
    return code


def wait_for_node0(launcher, stage: str, node_rank: int, where: str) -> None:
    """Until node 0's launcher listens at the rendezvous endpoint, saying so first; at most
    `rdzv_timeout_s`, then a `UserError` (torchrun would wait as long with no word, then
    end in a traceback). The launcher starts once node 0 answers; the probe sends nothing."""
    host, port = rdzv_endpoint(launcher, f"{where}: launcher.rdzv_endpoint")
    timeout = launcher.rdzv_timeout_s
    deadline = time.monotonic() + timeout
    print(f"posttrain: join {stage}: node {node_rank} of {launcher.nodes} waits for node 0's rendezvous at "
          f"{host}:{port} until {clock_after(timeout)} (launcher.rdzv_timeout_s: {timeout} s)",
          file=sys.stderr, flush=True)
    while problem := tcp_problem(host, int(port), timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise UserError(where, f"stage {stage}: node 0's rendezvous at {host}:{port} did not answer within "
                            f"{timeout} s ({problem})", "start the stage on node 0 first (posttrain run, or dvc "
                            "repro there), or correct launcher.rdzv_endpoint")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

if __name__ == "__main__":
    from posttrain.redact import guard_standard_streams

    guard_standard_streams()  # a rank's MLflow lines carry the tracking URI too (plain `dvc repro` shows them)
    worker(sys.argv[1] if len(sys.argv) > 1 else None)
