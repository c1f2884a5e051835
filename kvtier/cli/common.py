"""Options and error handling shared by the commands."""

from __future__ import annotations

import functools
from typing import Any, Callable

import click
import torch

from ..errors import KVTierError


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


def user_errors(fn: Callable) -> Callable:
    """Show kvtier's own errors as one line and exit 2, instead of a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVTierError as e:
            raise click.ClickException(f"{type(e).__name__}: {e}") from e
    return wrapper


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def load(model: str | None) -> tuple[Any, Any]:
    from ..models import load_default_model, load_model

    return load_default_model() if model is None else load_model(model)
