"""Options and error handling shared by the commands.

Exit codes: 0 success; 2 a mistake in what was asked (a bad option value, a missing file, a missing model);
3 a failure while running that is not the caller's fault (a corrupt page, a full disk); 1 anything else (a
bug, shown with its traceback). A failure prints one line, ``kvtier: error: <message>``, on stderr; with
``--json`` it also prints ``{"error": "<message>", "exit_code": N}`` on stdout.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import click
import torch

from ..errors import (ConfigError, KVTierError, ModelNotInstalledError, UnsupportedError, is_out_of_device_memory,
                      os_reason, short_of_resources)

EXIT_USAGE, EXIT_RUNTIME = 2, 3

# The longest prompt worth prefilling with a model on this machine (the default model was trained on 8K).
MAX_MODEL_CONTEXT = 32768
# torch CPU threads: at least one, and a number the thread pool can take
THREADS = click.IntRange(1, 1024)


class UserError(click.ClickException):
    """A mistake in what was asked: one line, exit 2."""

    exit_code = EXIT_USAGE


class RuntimeFailure(click.ClickException):
    """A failure while running that is not the caller's fault: one line, exit 3."""

    exit_code = EXIT_RUNTIME


def bad_option(option: str, value: Any, allowed: str, why: str = "") -> click.BadParameter:
    """``--option 'value' <why>; allowed: <allowed>`` as a click error (exit 2)."""
    return click.BadParameter(f"{value!r}{' ' + why if why else ''}; allowed: {allowed}", param_hint=f"'{option}'")


# ----------------------------------------------------------------------------------------------------- parsing

def parse_budget(value: str | None, option: str = "--device-budget") -> float | int | None:
    """'0.1' -> 0.1 (fraction), '512' -> 512 (tokens), 'none' -> None (the range is checked by `Budget`)."""
    if value is None or value.strip().lower() == "none":
        return None
    allowed = "a fraction like 0.1 or a token count like 512"
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        raise bad_option(option, value, allowed, "is not a number") from None
    if not math.isfinite(number):
        raise bad_option(option, value, allowed, "is not a finite number")
    return number


def split_list(text: str, option: str) -> list[str]:
    """'a,b' -> ['a', 'b']; an empty item is an error."""
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise bad_option(option, text, "a comma list without empty items, e.g. 0.1,0.25", "has an empty item")
    return items


def _item_why(text: str, item: str, why: str) -> str:
    return why if item == text.strip() else f"has {item!r}, which {why}"


def parse_fractions(text: str | None, option: str) -> tuple[float, ...] | None:
    """'0.1,0.25' -> (0.1, 0.25); each must be a fraction in (0, 1]."""
    if text is None:
        return None
    allowed = "a comma list of fractions in (0, 1], e.g. 0.1,0.25,0.5"
    out = []
    for item in split_list(text, option):
        try:
            value = float(item)
        except ValueError:
            raise bad_option(option, text, allowed, _item_why(text, item, "is not a number")) from None
        if not (0.0 < value <= 1.0):  # also false for NaN
            raise bad_option(option, text, allowed, _item_why(text, item, "is out of range"))
        out.append(value)
    return tuple(out)


def parse_ints(text: str | None, option: str, low: int | None = None,
               high: int | None = None) -> tuple[int, ...] | None:
    """'1,2' -> (1, 2); each a whole number in [low, high]."""
    if text is None:
        return None
    span = ("" if low is None and high is None else f" >= {low}" if high is None else f" from {low} to {high}")
    allowed = f"a comma list of whole numbers{span}"
    out = []
    for item in split_list(text, option):
        try:
            value = int(item)
        except ValueError:
            raise bad_option(option, text, allowed, _item_why(text, item, "is not a whole number")) from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise bad_option(option, text, allowed, _item_why(text, item, "is out of range"))
        out.append(value)
    return tuple(out)


def parse_tokens(text: str) -> int:
    """'1M' -> 1048576, '128K' -> 131072, '5000' -> 5000, as `kvtier.bench.synthetic.parse_tokens` reads them
    (without importing the engine); ValueError for anything else, 'inf' and 'nan' included."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    number = float(text[:-1] if scale > 1 else text)
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not a finite number")
    return int(number * scale)


def parse_context(text: str, option: str, low: int, high: int | None = None, allowed: str | None = None) -> int:
    """'3000' / '128K' / '1M' -> tokens, between `low` and `high`."""
    allowed = allowed or ("a token count like 3000, 128K or 1M, " +
                          (f"at least {low}" if high is None else f"from {low:,} to {high:,}"))
    try:
        tokens = parse_tokens(text)
    except (ValueError, OverflowError):  # 'abc', 'nan', 'inf'
        raise bad_option(option, text, allowed, "is not a token count") from None
    if tokens < low or (high is not None and tokens > high):
        raise bad_option(option, text, allowed, "is out of range")
    return tokens


# -------------------------------------------------------------------------------------------- checks before work

def check_scorer(scorer: str, option: str = "--scorer", allow_auto: bool = True) -> None:
    """An unknown scorer name fails here, before a model loads."""
    from ..scoring import available_scorers

    names = available_scorers()
    if scorer in names or (allow_auto and scorer == "auto"):
        return
    raise bad_option(option, scorer, ", ".join((["auto"] if allow_auto else []) + names), "is not a scorer")


def check_policies(policies: Iterable[str], option: str = "--policies") -> None:
    """'tier:kvp' and the like: the form and the scorer name."""
    from ..eval.policies import Policy
    from ..scoring import available_scorers

    allowed = "full, evict:<scorer>, tier:<scorer>, tier-all:<scorer>"
    names = available_scorers()
    for text in policies:
        try:
            policy = Policy.parse(text)
        except ConfigError as e:   # its own words: a bad recent window is named as such
            raise click.BadParameter(str(e), param_hint=f"'{option}'") from None
        if policy.scorer is not None and policy.scorer not in names:
            raise click.BadParameter(f"policy {text!r} names the unknown scorer {policy.scorer!r}; allowed: "
                                     f"{allowed}, with <scorer> one of {', '.join(names)}", param_hint=f"'{option}'")


def check_device(device: str, option: str = "--device", allowed: str = "cpu, cuda, cuda:N") -> None:
    """'cpu', 'cuda' or 'cuda:N', and a CUDA device only where there is one (`allowed` words the choices)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise bad_option(option, device, allowed, "is not a device") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise bad_option(option, device, allowed, "is not supported")
    from ..models import cuda_missing

    missing = cuda_missing(dev)
    if missing is not None:
        raise bad_option(option, device, missing[1], missing[0])


DEVICE_HELP = ("Where the model and the cache's device tier run: cpu, cuda or cuda:N (auto: the current GPU where "
               "there is one, else the CPU).")


def resolve_device(device: str, option: str = "--device") -> torch.device:
    """``auto``: the current CUDA device where there is one, else the CPU; else `device` checked. A CUDA device
    comes back with its index, as the tensors made on it name it."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device, option, allowed="auto, cpu, cuda, cuda:N")
    from ..native import indexed_device

    return indexed_device(device)


def check_writable_folder(folder: str, option: str, shown: str | None = None) -> str:
    """Fail now if `folder` cannot be written (or created) — without creating anything that stays behind; returns
    the folder with ``~`` expanded, the path to use (``--out=~/x`` reaches the program unexpanded).

    The probe is an anonymous temporary file in the folder, or in its closest existing parent when the
    folder does not exist yet; it is gone as soon as it is closed, even when writing to it fails (a full
    disk). `shown` is the value the message names (default: `folder`).
    """
    allowed = "a folder this process can create files in"
    value, what = (folder, "is not a writable folder") if shown is None else (shown, "is not in a writable folder")
    if not folder.strip():
        raise bad_option(option, value, allowed, "is empty")
    path = Path(folder).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise bad_option(option, value, allowed, f"{what} ({path} is a file)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise bad_option(option, value, allowed, f"{what} ({existing} is a file)")
    try:
        with tempfile.TemporaryFile(dir=existing) as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise bad_option(option, value, allowed,
                         f"{what} (cannot create files in {existing}: {e.strerror or e})") from None
    return str(Path(folder).expanduser())


def check_output_file(path: str, option: str) -> str:
    """A file to write: not a folder, and its folder writable (or creatable); returns the path with ``~``
    expanded, the one to write (``--out=~/x`` reaches the program unexpanded)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise bad_option(option, path, "a file path", "is a folder")
    check_writable_folder(str(p.absolute().parent), option, shown=path)
    return str(p)


def check_model(model: str | None, option: str = "--model") -> None:
    """Fail on a model that cannot be there, before the slow load (a Hub id is left to the loader)."""
    from ..models import default_model_path

    if model is None:
        default_model_path()  # ModelNotInstalledError (exit 2) with how to install it
        return
    allowed = "a model folder (config.json and weights), a .gguf file, or a Hugging Face id in the local cache"
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            hint = f"; pass the .gguf file itself, e.g. {ggufs[0]}" if ggufs else ""
            raise bad_option(option, model, allowed, f"is a folder with no model in it (no config.json{hint})")
    elif p.is_file():
        if p.suffix.lower() != ".gguf":
            raise bad_option(option, model, allowed, "is a file but not a .gguf model")
    elif model.startswith(("/", "./", "../", "~", ".\\")) or model.endswith(".gguf") or model.count("/") > 1:
        raise bad_option(option, model, allowed, "is neither a local path nor a Hugging Face id (no such file "
                         "or folder)")


def _parse_counts(value: str, option: str, least: int, example: str) -> list[int | None]:
    """'auto' -> [None] (the cache's default), else a comma list of whole numbers >= `least`: a setting per cache
    row, each once."""
    allowed = f"'auto' (the cache's default) or a comma list of whole numbers >= {least}, like {example}"
    out: list[int | None] = []
    for part in value.split(","):
        part = part.strip().lower()
        if part == "auto":
            out.append(None)
            continue
        try:
            n = int(part)
        except ValueError:
            raise bad_option(option, value, allowed, f"has {part!r}") from None
        if n < least:
            raise bad_option(option, value, allowed, f"has {n}")
        out.append(n)
    return list(dict.fromkeys(out))   # a setting given twice is one row


def parse_demote_pages(value: str, option: str = "--demote-pages") -> list[int | None]:
    """'auto' -> [None] (the cache's default), '1,4' -> [1, 4]: the `demote_pages` settings of cache rows."""
    return _parse_counts(value, option, 1, "1,4")


def parse_retain_pages(value: str, option: str = "--retain-pages") -> list[int | None]:
    """'auto' -> [None] (the cache's default), '0,32' -> [0, 32]: the `retain_pages` settings of cache rows."""
    return _parse_counts(value, option, 0, "0,32")


READ_AHEAD_SETTINGS = {"auto": None, "on": True, "off": False}
PROMOTE_SETTINGS = {"on": True, "off": False}
PLAN_RECALL_SETTINGS = {"device": "device", "host": "host"}


def _parse_words(value: str, option: str, words: dict) -> list:
    """'a,b' -> [words['a'], words['b']]: the settings of cache rows, one row each, in order."""
    allowed = "a comma list of " + ", ".join(map(repr, words)) + f", like {','.join(words)}"
    out = []
    for part in value.split(","):
        part = part.strip().lower()
        if part not in words:
            raise bad_option(option, value, allowed, f"has {part!r}")
        out.append(words[part])
    return list(dict.fromkeys(out))   # a setting given twice is one row


def parse_read_ahead(value: str, option: str = "--read-ahead") -> list[bool | None]:
    """'auto' -> [None], 'auto,off' -> [None, False]: the `read_ahead` settings of cache rows."""
    return _parse_words(value, option, READ_AHEAD_SETTINGS)


def read_ahead_name(setting: bool | None) -> str:
    """The `--read-ahead` word for a `read_ahead` setting."""
    return next(k for k, v in READ_AHEAD_SETTINGS.items() if v is setting)


def parse_promote(value: str, option: str = "--promote") -> list[bool]:
    """'on' -> [True], 'on,off' -> [True, False]: the `promote` settings of cache rows."""
    return _parse_words(value, option, PROMOTE_SETTINGS)


def parse_plan_recall(value: str, option: str = "--plan-recall") -> list[str]:
    """'device' -> ['device'], 'device,host' -> ['device', 'host']: where recall is planned, one cache row each."""
    return _parse_words(value, option, PLAN_RECALL_SETTINGS)


def promote_name(setting: bool) -> str:
    """The `--promote` word for a `promote` setting."""
    return "on" if setting else "off"


def tiered_row_name(demote_pages: int | None, rows: int, read_ahead: bool | None = None,
                    read_ahead_rows: int = 1, promote: bool = False, promote_rows: int = 1,
                    plan: str = "device", plan_rows: int = 1, retain: int | None = None,
                    retain_rows: int = 1) -> str:
    """A TieredCache row's name in a bench with `rows` `demote_pages` settings, `read_ahead_rows` `read_ahead`
    settings, `promote_rows` `promote` settings, `plan_rows` places recall is planned (`kvtier bench
    launches`) and `retain_rows` `retain_pages` settings (one row for each combination): the settings that vary
    between rows, and any other than the default."""
    name = "TieredCache"
    if rows > 1:
        name += f" d={'auto' if demote_pages is None else demote_pages}"
    if read_ahead_rows > 1 or read_ahead is not None:
        name += f" ra={read_ahead_name(read_ahead)}"
    if promote_rows > 1 or promote:
        name += f" promote={promote_name(promote)}"
    if plan_rows > 1 or plan != "device":
        name += f" plan={plan}"
    if retain_rows > 1 or retain is not None:
        name += f" retain={'auto' if retain is None else retain}"
    return name


def check_cache_options(device_budget: Any, host_budget: Any, disk_dir: str | None,
                        recall_pages: int = 0) -> str | None:
    """Fail on bad cache settings before spending time loading a model (and create no folder doing so); returns
    `disk_dir` with ``~`` expanded, the folder to use (``--disk-dir=~/x`` reaches the program unexpanded, and the
    folder checked must be the one written)."""
    from ..config import ModelShape, TieredCacheConfig
    from ..placement import Budget

    device = Budget(device_budget, "device_budget")
    host = None if host_budget is None else Budget(host_budget, "host_budget", allow_zero=True)
    TieredCacheConfig(shape=ModelShape(1, 1, 1), device_budget=device, host_budget=host, recall_pages=recall_pages)
    return None if disk_dir is None else check_writable_folder(disk_dir, "--disk-dir")


def check_chat_template(tokenizer: Any, model: str | None) -> None:
    """Refuse, right after its load, a model whose tokenizer has no chat template (a base model): a conversation
    is built with it, and transformers' own error would come at the first turn."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise click.BadParameter(f"{model!r} has no chat template (a base model); allowed: a chat (instruct) "
                                 "model", param_hint="'--model'")


def read_manifest(trace_dir: str, option: str = "--traces", split: str | None = None) -> dict[str, Any]:
    """The manifest of a folder written by `kvtier traces`, checked: it parses, its trace files are there, and
    (`split`) it was recorded from that split (a folder that records none is taken as it is)."""
    path = Path(trace_dir) / "manifest.json"
    allowed = "a folder written by `kvtier traces`" + (f" --split {split}" if split else "")
    if not path.is_file():
        raise bad_option(option, trace_dir, allowed, "holds no traces (no manifest.json)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_option(option, trace_dir, allowed, f"has an unreadable manifest.json ({e})") from None
    keys = ("model", "num_layers", "num_kv_heads", "head_dim", "traces")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys) or not isinstance(
            manifest["traces"], list) or not all(isinstance(t, dict) and "file" in t for t in manifest["traces"]):
        raise bad_option(option, trace_dir, allowed, f"has a manifest.json without {', '.join(keys)}")
    if not manifest["traces"]:
        raise bad_option(option, trace_dir, allowed, "holds no traces (manifest.json lists none)")
    if split is not None and manifest.get("split", split) != split:
        raise bad_option(option, trace_dir, allowed, f"was recorded from the {manifest['split']!r} split")
    missing = [t["file"] for t in manifest["traces"] if not (Path(trace_dir) / str(t["file"])).is_file()]
    if missing:
        raise bad_option(option, trace_dir, allowed,
                         f"misses {len(missing)} trace file(s) its manifest.json lists, e.g. {missing[0]}")
    return manifest


RESULT_KEYS = ("task", "length", "seed", "policy", "budget")


def read_result_lines(path: str, option: str) -> list[dict[str, Any]]:
    """The records of an evaluation's JSON lines file; a malformed line names the file and its line number."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise bad_option(option, path, "a JSON lines file written by `kvtier eval`",
                         f"cannot be read ({getattr(e, 'strerror', None) or e})") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}, line {number}: not valid JSON ({e.msg}, column {e.colno}); allowed: one "
                            "JSON object per line, as written by `kvtier eval`") from None
        missing = [k for k in RESULT_KEYS if k not in record] if isinstance(record, dict) else list(RESULT_KEYS)
        if not missing and record.get("ppl") is None and not isinstance(record.get("score"), (int, float)):
            missing = ["ppl or score"]
        if missing:
            raise UserError(f"{path}, line {number}: not an evaluation result (missing {', '.join(missing)}); "
                            "allowed: one JSON object per line, as written by `kvtier eval`")
        out.append(record)
    return out


# ------------------------------------------------------------------------------------------------------ errors

def one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip()) or "failed"


def classify(exc: BaseException) -> tuple[str, int] | None:
    """(message, exit code) for a failure kvtier explains in one line; None for a bug (shown with its traceback)."""
    if isinstance(exc, click.ClickException):
        return one_line(exc.format_message()), exc.exit_code
    if isinstance(exc, (ConfigError, ModelNotInstalledError, UnsupportedError)):
        return one_line(f"{type(exc).__name__}: {exc}"), EXIT_USAGE
    if isinstance(exc, KVTierError):
        return one_line(f"{type(exc).__name__}: {exc}"), EXIT_RUNTIME
    if isinstance(exc, (OSError, MemoryError)):  # a full disk, a failing device, out of memory while running
        return one_line(f"{type(exc).__name__}: {exc}"), EXIT_RUNTIME
    if is_out_of_device_memory(exc):   # torch out of GPU or CPU memory (the model's own steps included)
        return one_line(f"{type(exc).__name__}: {os_reason(exc)}"), EXIT_RUNTIME
    return None


def user_errors(fn: Callable) -> Callable:
    """Turn kvtier's own errors (and a full disk or out of memory while running) into one-line click errors:
    exit 2 for a mistake in what was asked, 3 for a failure while running (see the module's docstring)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, BrokenPipeError):   # a closed stdout is no failure of the command's
            raise
        except Exception as e:
            found = classify(e)
            if found is None:
                raise
            message, code = found
            raise (UserError if code == EXIT_USAGE else RuntimeFailure)(message) from e
    return wrapper


def report_failure(message: str, exit_code: int, as_json: bool) -> None:
    """The one line on stderr (and, with --json, the JSON object on stdout)."""
    if as_json:
        click.echo(json.dumps({"error": message, "exit_code": exit_code}))
    click.echo(f"kvtier: error: {message}", err=True)


def wants_json(argv: list[str]) -> bool:
    """Whether the command line asks for --json (before a `--`)."""
    if "--" in argv:
        argv = argv[:argv.index("--")]
    return "--json" in argv


def run_main(group_main: Callable[..., Any], args: list[str] | None, **kwargs: Any) -> None:
    """Run click's `main` without its own error display; every failure ends as described in the docstring."""
    argv = list(sys.argv[1:] if args is None else args)
    as_json = wants_json(argv)
    try:
        rv = group_main(args=argv, standalone_mode=False, **kwargs)
    except click.exceptions.NoArgsIsHelpError as e:  # `kvtier` or `kvtier bench` alone: the help, as click shows it
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        report_failure("aborted", 1, as_json)
        sys.exit(1)
    except BrokenPipeError:   # the reader stopped reading (`kvtier info | head`): nothing left to say to it
        with contextlib.suppress(OSError):   # and nothing for Python to flush into the closed pipe at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as e:
        found = classify(e)
        if found is None:
            if as_json:
                click.echo(json.dumps({"error": one_line(f"{type(e).__name__}: {e}"), "exit_code": 1}))
            raise
        message, code = found
        report_failure(message, code, as_json)
        sys.exit(code)
    sys.exit(rv if isinstance(rv, int) else 0)


# ------------------------------------------------------------------------------------------------------- work

def command_started() -> float | None:
    """When this process began (a `time.time()`), where it is the `kvtier` command itself (`kvtier ...` or
    ``python -m kvtier ...``); None where kvtier's commands run inside another program (a test runner, a notebook),
    whose age says nothing of the command's."""
    path = sys.argv[0] if sys.argv else ""
    name = os.path.basename(path)
    if name != "kvtier" and not (name == "__main__.py" and os.path.basename(os.path.dirname(path)) == "kvtier"):
        return None
    import psutil

    return psutil.Process().create_time()


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


class NoProgressBars(io.TextIOBase):
    """A stream that passes on what is written to it but tqdm's progress bars: a bar is redrawn in place, each
    draw starting with a carriage return (or moving the cursor, for stacked bars), and a lone newline closes it.
    Warnings (the model copy's "could not keep a converted copy") still reach the user."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self.stream = stream
        self.bar = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text.startswith("\r") or "\x1b[" in text:
            self.bar = True
        elif self.bar and not text.strip("\n"):   # the newline (or nothing) that closes a bar
            self.bar = False
        else:
            self.bar = False
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def not_the_models(e: Exception, what: str) -> None:
    """Raise `e` where it says nothing of the model (kvtier's own errors, as they are), or as a failure while
    running (exit 3) where the machine ran short of memory, open files or disk space; else return."""
    if isinstance(e, KVTierError):
        raise e
    if short_of_resources(e):
        raise RuntimeFailure(f"{what} could not be loaded: {os_reason(e)}") from e


def load(model: str | None, quiet: bool = False, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load the named model (default: the packaged one) onto `device`; `quiet` hides the loading progress bars.

    A model that cannot be read is a mistake in --model (exit 2); the packaged one failing to load is not the
    caller's fault (exit 3).
    """
    from transformers.utils import logging as hf_logging

    from ..models import load_default_model, load_model

    def go() -> tuple[Any, Any]:   # read on the CPU: a failure here is the file's; the move to `device` follows
        if model is None:
            return load_default_model()
        return load_model(os.path.expanduser(model))

    try:
        if not quiet:
            loaded = go()
        else:
            hf_logging.disable_progress_bar()
            try:  # some loaders (GGUF) draw plain tqdm bars on stderr: keep them out of machine-read output
                with contextlib.redirect_stderr(NoProgressBars(sys.stderr)):
                    loaded = go()
            finally:
                hf_logging.enable_progress_bar()
    except Exception as e:   # noqa: BLE001 - a broken file fails in any way its reader happens to (struct.error, ...)
        not_the_models(e, "the packaged default model" if model is None else f"model {model!r}")
        if model is None:
            raise RuntimeFailure(f"the packaged default model failed to load ({type(e).__name__}: "
                                 f"{one_line(e)})") from e
        raise UserError(f"Invalid value for '--model': {model!r} cannot be loaded ({type(e).__name__}: "
                        f"{one_line(e)}); allowed: a model folder (config.json and weights), a .gguf file, or a "
                        "Hugging Face id in the local cache") from e
    # the device's failures (out of memory, a driver error) are the run's, not the model file's: as any other
    loaded[0].to(device)
    return loaded
