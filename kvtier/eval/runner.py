"""Run a suite: every example once through a shared prefill, then every policy and budget; results are
appended as JSON lines as they come, so an interrupted run resumes where it stopped."""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..integrations.hf import TieredCache, cache_kwargs
from ..scoring import BASELINES_ATTENTION_BASED, BASELINES_ATTENTION_FREE, make_scorer
from .policies import Policy
from .report import example_key, full_by_example, latest, same_prompt
from .shared_prefill import PromptScores, full_copy, load_prefill, shared_prefill
from .tasks import TASKS, Example, make_example

ATTENTION_FREE = ("kvp", *BASELINES_ATTENTION_FREE)
ATTENTION_BASED = BASELINES_ATTENTION_BASED


@dataclass(frozen=True)
class Suite:
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    policies: tuple[str, ...]
    budgets: tuple[float, ...]
    seeds: tuple[int, ...]


SUITES = {
    "quick": Suite(("niah_single", "variable_tracking", "perplexity"), (1024,),
                   ("full", "tier-all:kvp", "tier:kvp", "evict:kvp"), (0.1,), (0,)),
    "standard": Suite(TASKS, (2048, 4096), ("full", "tier:kvp", *(f"evict:{s}" for s in ATTENTION_FREE + ATTENTION_BASED)),
                      (0.05, 0.1, 0.25, 0.5), (0,)),
    "full": Suite(TASKS, (2048, 4096, 8192),
                  ("full", *(f"tier:{s}" for s in ("kvp", "keynorm", "recency")),
                   *(f"evict:{s}" for s in ATTENTION_FREE + ATTENTION_BASED)), (0.05, 0.1, 0.25, 0.5), (0, 1, 2)),
}


def _key(r: dict[str, Any]) -> tuple:
    return *example_key(r), r["policy"], r["budget"]


def read_results(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mend_last_line(path: str | Path) -> str | None:
    """Make `path` end with a whole line before rows are appended to it: a last line without its newline gets one
    where it is a whole record, and is cut off where it is not (a write cut short: its run is made again).
    Returns what was done, or None."""
    path = Path(path)
    if not path.is_file():
        return None
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return None
    start = data.rfind(b"\n") + 1
    try:
        json.loads(data[start:])
    except ValueError:
        with path.open("r+b") as f:
            f.truncate(start)
        return f"the last line of {path} was cut short; it is dropped and its run made again"
    with path.open("ab") as f:
        f.write(b"\n")
    return None


def model_name(model: Any) -> str:
    """What a results row names its model by: the path or id it was loaded from."""
    config = getattr(model, "config", None)
    return str(getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None) or type(model).__name__)


def check_same_model(results: list[dict[str, Any]], name: str, out: str | Path) -> None:
    """Refuse to resume a results file of another model: its rows would stand for this one's."""
    others = sorted({r["model"] for r in results if r.get("model") not in (None, name)})
    if others:
        raise ConfigError(f"{out} holds results of model {others[0]!r}; this run is of {name!r}; allowed: another "
                          "--out, or the model the file was written with")


@torch.no_grad()
def _greedy(model: Any, cache: Any, first_logits: torch.Tensor, max_new: int, eos: set[int]) -> list[int]:
    out = [int(first_logits.argmax())]
    while len(out) < max_new and out[-1] not in eos:
        logits = model(torch.tensor([[out[-1]]], device=first_logits.device), **cache_kwargs(cache)).logits[0, -1]
        out.append(int(logits.argmax()))
    return [t for t in out if t not in eos]


@torch.no_grad()
def continuation_nll(model: Any, cache: Any, first_logits: torch.Tensor, continuation: torch.Tensor,
                      chunk: int = 16) -> float:
    """Teacher-forced NLL of the continuation, fed in chunks of `chunk` tokens as a decode would see it."""
    continuation = continuation.to(first_logits.device)
    logits = [first_logits[None]]
    feed = continuation[:, :-1]
    for start in range(0, feed.shape[1], chunk):
        logits.append(model(feed[:, start:start + chunk], **cache_kwargs(cache)).logits[0])
    return float(F.cross_entropy(torch.cat(logits).float(), continuation[0]))


def _once(items: Any) -> tuple:
    """`items` in order, each once (a value given twice is run once)."""
    return tuple(dict.fromkeys(items))


def prompt_digest(input_ids: torch.Tensor) -> str:
    """What a row names its prompt by: rows are compared only where their prompts are the same tokens."""
    return hashlib.sha1(input_ids.detach().cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def _check_windows(model: Any, policies: list[Policy], budgets: tuple, lengths: tuple) -> None:
    """Refuse a recent window that holds more than its budget: the cache then keeps sinks and window whatever the
    budget (`TieredCacheConfig.device_tokens`), and a row named by the budget would hold more than it says."""
    for policy in policies:
        if policy.kind == "full" or not isinstance(policy.recent, int):
            continue
        for budget in budgets:
            cache = TieredCache(model.config, **{**policy.cache_settings(budget), "scorer": "keynorm"})
            try:
                for length in lengths:
                    kept, asked = cache.settings.device_tokens(length), cache.settings.device_budget.tokens(length)
                    if kept > asked:
                        raise ConfigError(
                            f"policy {policy.name!r} at budget {budget:g} of {length:,} tokens keeps {kept:,} tokens "
                            f"a KV head on the device (sinks and its recent window), over the budget's {asked:,}; "
                            "allowed: a recent window within the budget (a smaller one, or a share like @0.25)")
            finally:
                cache.close()


def run_suite(model: Any, tokenizer: Any, out: str | Path, suite: Suite,
              progress: Callable[[list], Any] = iter, name: str | None = None) -> list[dict[str, Any]]:
    """Run what `out` does not hold yet; returns every result (old and new). Rows name the model (`name`, else
    `model_name`), and a file of another model's rows is refused."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mended = mend_last_line(out)
    if mended:
        warnings.warn(mended, stacklevel=2)
    results = read_results(out)
    name = name or model_name(model)
    check_same_model(results, name, out)
    # one policy written two ways (evict:kvp@64, evict:kvp@064) is run once, by its name
    policies = list({p.name: p for p in map(Policy.parse, suite.policies)}.values())
    budgets = _once(suite.budgets)
    _check_windows(model, policies, budgets, _once(suite.lengths))
    eos = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if i is not None}
    examples = [(t, n, s) for t in _once(suite.tasks) for n in _once(suite.lengths) for s in _once(suite.seeds)]
    by_example: dict[tuple, list[dict[str, Any]]] = {}   # rows added below belong to the example just run
    for r in latest(results):
        by_example.setdefault(example_key(r), []).append(r)
    with out.open("a") as sink:
        for task, length, seed in progress(examples):
            ex: Example = make_example(tokenizer, task, length, seed)
            row0 = {"prompt_tokens": int(ex.input_ids.shape[1]), "prompt_sha": prompt_digest(ex.input_ids)}
            # rows of this example made on another prompt (the task's text has changed since) are made again
            done = {_key(r) for r in by_example.get((task, length, seed), ()) if same_prompt(r, row0)}
            jobs = [(p, b) for p in policies for b in ((1.0,) if p.kind == "full" else budgets)
                    if (task, length, seed, p.name, b) not in done]
            if not jobs:
                continue
            pre = shared_prefill(model, ex.input_ids)
            scorers: dict[str, PromptScores] = {}
            for policy, budget in jobs:
                start = time.perf_counter()
                cache = None
                try:   # a failure or an interruption closes the cache (its memory, files and threads go)
                    if policy.kind == "full":
                        cache = full_copy(pre)
                    else:
                        if policy.scorer not in scorers:
                            scorers[policy.scorer] = PromptScores(make_scorer(policy.scorer), ex.input_ids.shape[1])
                        settings = policy.cache_settings(budget)
                        settings["scorer"] = scorers[policy.scorer]
                        cache = TieredCache(model.config, **settings)
                        load_prefill(pre, cache)
                    row = {"task": task, "length": length, "seed": seed, "policy": policy.name, "budget": budget,
                           **row0, "model": name}
                    if ex.continuation is not None:
                        nll = continuation_nll(model, cache, pre.last_logits, ex.continuation)
                        row.update(nll=nll, ppl=math.exp(nll), score=None)
                    else:
                        ids = _greedy(model, cache, pre.last_logits, ex.max_new_tokens, eos)
                        text = tokenizer.decode(ids, skip_special_tokens=True)
                        row.update(output=text, answers=ex.answers, score=ex.score(text))
                    row["seconds"] = round(time.perf_counter() - start, 3)
                    if isinstance(cache, TieredCache):
                        s = cache.stats()
                        row["device_tokens_per_head"] = s["device"]["tokens"] // (s["layers"] * s["kv_heads"])
                finally:
                    if isinstance(cache, TieredCache):
                        cache.close()
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                results.append(row)
    return latest(results)


def full_recall_mismatches(results: list[dict[str, Any]], rel_tol: float = 1e-3) -> list[str]:
    """Where tier mode with every page recalled does not give the full cache's answer (or perplexity)."""
    full = full_by_example(results)
    bad = []
    for r in results:
        if not r["policy"].startswith("tier-all:"):
            continue
        ref = full.get(example_key(r))
        if ref is None or not same_prompt(r, ref):   # another prompt is another example
            continue
        if r.get("ppl") is not None:
            if abs(r["ppl"] - ref["ppl"]) > rel_tol * ref["ppl"]:
                bad.append(f"{r['task']}@{r['length']} budget {r['budget']}: ppl {r['ppl']:.4f} vs {ref['ppl']:.4f}")
        elif r["output"] != ref["output"]:
            bad.append(f"{r['task']}@{r['length']} budget {r['budget']}: {r['output']!r} vs {ref['output']!r}")
    return bad
