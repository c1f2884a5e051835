"""Options and error handling shared by the commands."""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any, Callable

import click
import torch

from ..errors import ConfigError, KVTierError, ModelNotInstalledError, UnsupportedError


def parse_budget(value: str | None) -> float | int | None:
    """'0.1' -> 0.1 (fraction), '512' -> 512 (tokens), 'none' -> None."""
    if value is None or value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            raise click.BadParameter(f"{value!r} is not a number; allowed: a fraction like 0.1 or a token "
                                     "count like 512") from None


EXIT_USAGE, EXIT_RUNTIME = 2, 3


def user_errors(fn: Callable) -> Callable:
    """Show kvtier's own errors as one line instead of a traceback.

    Exit codes: 2 for a mistake in what was asked (a bad setting, a missing model), 3 for a failure while
    running (a corrupt page, a full disk), 1 for anything else.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ConfigError, ModelNotInstalledError, UnsupportedError) as e:
            err = click.ClickException(f"{type(e).__name__}: {e}")
            err.exit_code = EXIT_USAGE
            raise err from e
        except KVTierError as e:
            err = click.ClickException(f"{type(e).__name__}: {e}")
            err.exit_code = EXIT_RUNTIME
            raise err from e
    return wrapper


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def load(model: str | None, quiet: bool = False) -> tuple[Any, Any]:
    """Load the named model (default: the packaged one); `quiet` hides the loading progress bars."""
    from transformers.utils import logging as hf_logging

    from ..models import load_default_model, load_model

    if not quiet:
        return load_default_model() if model is None else load_model(model)
    hf_logging.disable_progress_bar()
    try:  # some loaders (GGUF) draw plain tqdm bars on stderr: keep them out of machine-read output
        with contextlib.redirect_stderr(io.StringIO()):
            return load_default_model() if model is None else load_model(model)
    finally:
        hf_logging.enable_progress_bar()


def check_cache_options(device_budget: Any, host_budget: Any, disk_dir: str | None) -> None:
    """Fail on bad cache settings before spending time loading a model."""
    import shutil

    from ..integrations.hf import make_private_dir
    from ..placement import Budget

    Budget(device_budget, "device_budget")
    if host_budget is not None:
        Budget(host_budget, "host_budget", allow_zero=True)
    if disk_dir is not None:
        shutil.rmtree(make_private_dir(disk_dir), ignore_errors=True)
