"""Train the KVP agents of every (layer, KV head) together, in batched tensors (behind `kvtier train`)."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from ..errors import ConfigError, check_whole
from ..scoring.kvp import KVPAgents
from .dataset import TraceTensors
from .objective import listwise_loss, reinforce_loss, reward

OBJECTIVES = ("reinforce", "listwise")


@dataclass(frozen=True)
class TrainSettings:
    """Hyper-parameters of `train_agents` (all recorded in the weights file)."""

    objective: str = "reinforce"
    steps: int = 300
    batch_traces: int = 8
    tokens_per_trace: int = 384       # a random subset of each trace's tokens per step
    top_tokens: int = 0               # ... always including this many of its most important ones (`top_entries`)
    samples: int = 8                  # permutations per problem (reinforce)
    lr: float = 3e-3
    age_lr_scale: float = 10.0        # the recency term's table learns this much faster (scores span tens)
    weight_decay: float = 1e-3
    warmup: int = 20
    eval_every: int = 25
    hidden: int = 64
    val_share: float = 0.125
    seed: int = 0

    def __post_init__(self) -> None:
        whole = {"steps": 1, "batch_traces": 1, "tokens_per_trace": 1, "top_tokens": 0, "samples": 2, "warmup": 0,
                 "eval_every": 1, "hidden": 1, "seed": 0}
        for name, least in whole.items():
            check_whole(name, getattr(self, name), least)
        for name, low, high in (("lr", 0.0, None), ("age_lr_scale", 0.0, None), ("weight_decay", None, None),
                                ("val_share", 0.0, 1.0)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
                value >= 0 if low is None else value > low) and (high is None or value < high)
            if not ok:
                span = ">= 0" if low is None else f"> {low:g}" + (f" and < {high:g}" if high is not None else "")
                raise ConfigError(f"{name}={value!r}; allowed: a finite number {span}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective={self.objective!r}; allowed: {', '.join(OBJECTIVES)}")
        if not 0 <= self.top_tokens <= self.tokens_per_trace:
            raise ConfigError(f"top_tokens={self.top_tokens}; allowed: 0 to tokens_per_trace "
                              f"({self.tokens_per_trace})")
        if self.samples < 2:
            raise ConfigError(f"samples={self.samples}; allowed: >= 2 (the leave-one-out baseline needs two)")
        if self.seed >= 2**64:   # torch's generators take 64 bits
            raise ConfigError(f"seed={self.seed}; allowed: 0 to 2**64 - 1")


def ranking(agents: KVPAgents, features: torch.Tensor, ages: torch.Tensor) -> torch.Tensor:
    """What the cache ranks by: the network's score plus the recency term at the entries' ages."""
    return agents(features) + agents.age_bias(ages)


def flatten_untrained_ages(agents: KVPAgents, max_age: int) -> None:
    """Hold the recency term flat past the oldest age training saw: knots it never reached keep no
    meaning of their own (their initial zeros would make the term jump), so they take the last trained value.
    The last knot kept is the one above the oldest age (its interpolation reaches it), so the term is unchanged
    at every age training saw and the validated ranking is the one saved."""
    last = int(math.ceil(math.log2(1 + max(max_age, 0))))
    if last + 1 < agents.age.shape[1]:
        with torch.no_grad():
            agents.age[:, last + 1:] = agents.age[:, last:last + 1]


def mean_reward(agents: KVPAgents, traces: list[TraceTensors]) -> float:
    """Reward of the deterministic ranking (argsort of scores), averaged over agents and traces."""
    with torch.no_grad():
        values = [reward(t.importance, torch.argsort(ranking(agents, t.features, t.ages), dim=-1,
                                                     descending=True)).mean() for t in traces]
    return float(torch.stack(values).mean())


def top_entries(importance: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` entries that hold the largest share of some agent's importance (``[agents, n]`` in).

    A random subset of a long trace seldom holds the few tokens a retrieval head lives on (a 15-token
    needle in 7,680 tokens: under one token in 384), so a ranking problem would almost never ask about them.
    """
    share = importance / importance.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return share.amax(dim=0).topk(min(count, importance.shape[1])).indices


def _subset(t: TraceTensors, top: torch.Tensor | None, size: int, gen: torch.Generator) -> torch.Tensor:
    """Token indices of one ranking problem: `top` (if any), then random others, `size` in all."""
    n = t.features.shape[1]
    order = torch.randperm(n, generator=gen)
    if top is None or top.numel() == 0:
        return order[:size]
    rest = order[~torch.isin(order, top)]
    return torch.cat([top, rest[: max(0, size - top.numel())]])


def _normalisation(traces: list[TraceTensors]) -> tuple[torch.Tensor, torch.Tensor]:
    feats = torch.cat([t.features for t in traces], dim=1)
    return feats.mean(dim=1, keepdim=True), feats.std(dim=1, keepdim=True).clamp_min(1e-4)


def train_agents(traces: list[TraceTensors], head_dim: int, settings: TrainSettings,
                 progress: Callable[[range], Any] = iter,
                 age_only: KVPAgents | None = None) -> tuple[KVPAgents, dict[str, Any]]:
    """Train on `traces` (a held-out share picks the best checkpoint); returns the agents and a report.

    `age_only`: start from these agents and train their recency term alone, the network (and its input
    statistics) frozen, so what the network learned stays as it was.
    """
    if len(traces) < 2:
        raise ConfigError(f"{len(traces)} trace(s) given; training needs at least 2 (one held out)")
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    order = list(range(len(traces)))
    rng.shuffle(order)
    n_val = min(max(1, int(round(len(traces) * settings.val_share))), len(traces) - 1)   # one to train on, at least
    val, train = [traces[i] for i in order[:n_val]], [traces[i] for i in order[n_val:]]
    if age_only is not None:
        if age_only.agents != traces[0].features.shape[0] or age_only.head_dim != head_dim:
            raise ConfigError(f"the agents to continue have {age_only.agents} agents of head size {age_only.head_dim}; "
                              f"the traces need {traces[0].features.shape[0]} of {head_dim}")
        agents = copy.deepcopy(age_only).train()
        network = []
        for name, p in agents.named_parameters():
            p.requires_grad_(name == "age")
    else:
        agents = KVPAgents(traces[0].features.shape[0], head_dim, settings.hidden)
        agents.mean.copy_(_normalisation(train)[0])
        agents.std.copy_(_normalisation(train)[1])
        network = [p for name, p in agents.named_parameters() if name != "age"]
    groups = [{"params": [agents.age], "lr": settings.lr * settings.age_lr_scale, "weight_decay": 0.0}]
    if network:
        groups.insert(0, {"params": network})
    opt = torch.optim.AdamW(groups, lr=settings.lr, weight_decay=settings.weight_decay)

    def schedule(step: int) -> float:
        if step < settings.warmup:
            return 0.01 + 0.99 * step / settings.warmup
        t = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
        return 0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    best = {"reward": mean_reward(agents, val), "step": 0, "state": copy.deepcopy(agents.state_dict())}
    history = [{"step": 0, "val_reward": best["reward"]}]
    frozen: dict[int, torch.Tensor] = {}   # with the network frozen, its scores are computed once per trace
    if age_only is not None:
        with torch.no_grad():
            frozen = {id(t): agents(t.features) for t in train}
    tops = {id(t): top_entries(t.importance, settings.top_tokens) for t in train} if settings.top_tokens else {}
    for step in progress(range(1, settings.steps + 1)):
        batch = [train[rng.randrange(len(train))] for _ in range(settings.batch_traces)]
        xs, cs, ages = [], [], []
        for t in batch:
            idx = _subset(t, tops.get(id(t)), settings.tokens_per_trace, gen)
            xs.append(frozen[id(t)][:, idx] if frozen else t.features[:, idx])
            cs.append(t.importance[:, idx])
            ages.append(t.ages[idx])
        m = min(x.shape[1] for x in xs)
        # features [agents, batch * m, d]; with the network frozen, its scores [agents, batch * m]
        x = torch.cat([x[:, :m] for x in xs], dim=1)
        c = torch.stack([c[:, :m] for c in cs], dim=1)                   # [agents, batch, m]
        content = x if frozen else agents(x)
        scores = (content + agents.age_bias(torch.cat([a[:m] for a in ages]))).view(c.shape)
        if settings.objective == "reinforce":
            loss, train_reward = reinforce_loss(scores, c, settings.samples, gen)
        else:
            loss = listwise_loss(scores, c)
            train_reward = reward(c, torch.argsort(scores.detach(), dim=-1, descending=True)).mean()
        if not torch.isfinite(loss):
            raise ConfigError(f"training diverged at step {step} (loss {float(loss)}); allowed: a lower --lr "
                              f"(this run's {settings.lr:g}), or traces without infinite values")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agents.parameters(), 5.0)
        opt.step()
        sched.step()
        if not all(torch.isfinite(p).all() for p in agents.parameters()):
            raise ConfigError(f"training diverged at step {step} (a weight is no longer finite); allowed: a lower "
                              f"--lr (this run's {settings.lr:g})")
        if step % settings.eval_every == 0 or step == settings.steps:
            value = mean_reward(agents, val)
            history.append({"step": step, "val_reward": value, "train_reward": float(train_reward),
                            "loss": float(loss.detach())})
            if value > best["reward"]:
                best = {"reward": value, "step": step, "state": copy.deepcopy(agents.state_dict())}
    agents.load_state_dict(best["state"])
    flatten_untrained_ages(agents, max(int(t.ages.max()) for t in traces))
    agents.eval()
    report = {"settings": asdict(settings), "best_step": best["step"], "best_val_reward": best["reward"],
              "train_traces": len(train), "val_traces": len(val), "history": history}
    return agents, report
