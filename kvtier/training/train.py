"""Train the KVP agents of every (layer, KV head) together, in batched tensors (behind `kvtier train`)."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from ..errors import ConfigError
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
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective={self.objective!r}; allowed: {', '.join(OBJECTIVES)}")
        if self.samples < 2:
            raise ConfigError(f"samples={self.samples}; allowed: >= 2 (the leave-one-out baseline needs two)")


def ranking(agents: KVPAgents, features: torch.Tensor, ages: torch.Tensor) -> torch.Tensor:
    """What the cache ranks by: the network's score plus the recency term at the entries' ages."""
    return agents(features) + agents.age_bias(ages)


def mean_reward(agents: KVPAgents, traces: list[TraceTensors]) -> float:
    """Reward of the deterministic ranking (argsort of scores), averaged over agents and traces."""
    with torch.no_grad():
        values = [reward(t.importance, torch.argsort(ranking(agents, t.features, t.ages), dim=-1,
                                                     descending=True)).mean() for t in traces]
    return float(torch.stack(values).mean())


def _normalisation(traces: list[TraceTensors]) -> tuple[torch.Tensor, torch.Tensor]:
    feats = torch.cat([t.features for t in traces], dim=1)
    return feats.mean(dim=1, keepdim=True), feats.std(dim=1, keepdim=True).clamp_min(1e-4)


def train_agents(traces: list[TraceTensors], head_dim: int, settings: TrainSettings,
                 progress: Callable[[range], Any] = iter) -> tuple[KVPAgents, dict[str, Any]]:
    """Train on `traces` (a held-out share picks the best checkpoint); returns the agents and a report."""
    if len(traces) < 2:
        raise ConfigError(f"{len(traces)} trace(s) given; training needs at least 2 (one held out)")
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    order = list(range(len(traces)))
    rng.shuffle(order)
    n_val = max(1, int(round(len(traces) * settings.val_share)))
    val, train = [traces[i] for i in order[:n_val]], [traces[i] for i in order[n_val:]]
    agents = KVPAgents(traces[0].features.shape[0], head_dim, settings.hidden)
    agents.mean.copy_(_normalisation(train)[0])
    agents.std.copy_(_normalisation(train)[1])
    network = [p for name, p in agents.named_parameters() if name != "age"]
    opt = torch.optim.AdamW([{"params": network},
                             {"params": [agents.age], "lr": settings.lr * settings.age_lr_scale, "weight_decay": 0.0}],
                            lr=settings.lr, weight_decay=settings.weight_decay)

    def schedule(step: int) -> float:
        if step < settings.warmup:
            return 0.01 + 0.99 * step / settings.warmup
        t = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
        return 0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    best = {"reward": mean_reward(agents, val), "step": 0, "state": copy.deepcopy(agents.state_dict())}
    history = [{"step": 0, "val_reward": best["reward"]}]
    for step in progress(range(1, settings.steps + 1)):
        batch = [train[rng.randrange(len(train))] for _ in range(settings.batch_traces)]
        xs, cs, ages = [], [], []
        for t in batch:
            n = t.features.shape[1]
            idx = torch.randperm(n, generator=gen)[: settings.tokens_per_trace]
            xs.append(t.features[:, idx])
            cs.append(t.importance[:, idx])
            ages.append(t.ages[idx])
        m = min(x.shape[1] for x in xs)
        x = torch.cat([x[:, :m] for x in xs], dim=1)                     # [agents, batch * m, d]
        c = torch.stack([c[:, :m] for c in cs], dim=1)                   # [agents, batch, m]
        scores = ranking(agents, x, torch.cat([a[:m] for a in ages])).view(c.shape)
        if settings.objective == "reinforce":
            loss, train_reward = reinforce_loss(scores, c, settings.samples, gen)
        else:
            loss = listwise_loss(scores, c)
            train_reward = reward(c, torch.argsort(scores.detach(), dim=-1, descending=True)).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agents.parameters(), 5.0)
        opt.step()
        sched.step()
        if step % settings.eval_every == 0 or step == settings.steps:
            value = mean_reward(agents, val)
            history.append({"step": step, "val_reward": value, "train_reward": float(train_reward),
                            "loss": float(loss.detach())})
            if value > best["reward"]:
                best = {"reward": value, "step": step, "state": copy.deepcopy(agents.state_dict())}
    agents.load_state_dict(best["state"])
    agents.eval()
    report = {"settings": asdict(settings), "best_step": best["step"], "best_val_reward": best["reward"],
              "train_traces": len(train), "val_traces": len(val), "history": history}
    return agents, report
