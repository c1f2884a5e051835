"""KVP: a learned scorer, one tiny network per (layer, KV head), over key, value and position only.

Moschella, Manduchi, Sener, "Learning to Evict from Key-Value Cache", arXiv 2602.10238. The networks
of all heads of a layer run in one batched call (no loop over heads). Weights live in a safetensors file
whose metadata names the model shape they were trained for; loading them for another shape is an error.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .. import native
from ..errors import ConfigError
from ..outputs import save_tensors
from .base import check_one_sequence
from .features import AGE_KNOTS, POSITION_FEATURES, age_basis, entry_features, position_features

FORMAT_VERSION = 1
SHIPPED = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct.safetensors"}
# the sizes that tell one model from another, whatever name it was loaded under (recorded with traces and weights)
MODEL_SIGNATURE = ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")


class KVPAgents(torch.nn.Module):
    """``agents`` independent 2-hidden-layer MLPs, evaluated together with batched matrix products.

    Input ``[agents, tokens, 2 * head_dim + 8]``, output ``[agents, tokens]``. Inputs are standardised
    with per-agent statistics taken from the training traces.

    Each agent also has a recency term, ``age``: a piecewise-linear function of log2(1 + age) (`age_basis`)
    added to the network's score whenever entries are ranked. The network runs once per entry, when it is
    written; the age term is re-read at every placement, so an entry's rank falls as it ages unless its
    content holds it up. Absolute position alone cannot say this: a token at position 1,000 is the latest
    of a 1,000-token prompt and old in an 8,000-token one.
    """

    def __init__(self, agents: int, head_dim: int, hidden: int = 64) -> None:
        super().__init__()
        d_in = 2 * head_dim + POSITION_FEATURES
        self.agents, self.head_dim, self.hidden = agents, head_dim, hidden
        self.register_buffer("mean", torch.zeros(agents, 1, d_in))
        self.register_buffer("std", torch.ones(agents, 1, d_in))

        def init(*shape: int, fan_in: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape) / fan_in ** 0.5)

        self.w1, self.b1 = init(agents, d_in, hidden, fan_in=d_in), torch.nn.Parameter(torch.zeros(agents, 1, hidden))
        self.w2, self.b2 = init(agents, hidden, hidden, fan_in=hidden), torch.nn.Parameter(torch.zeros(agents, 1, hidden))
        self.w3, self.b3 = init(agents, hidden, 1, fan_in=hidden), torch.nn.Parameter(torch.zeros(agents, 1, 1))
        self.age = torch.nn.Parameter(torch.zeros(agents, AGE_KNOTS))

    def forward(self, x: torch.Tensor, agents: slice | None = None) -> torch.Tensor:
        sel = slice(None) if agents is None else agents
        x = (x - self.mean[sel]) / self.std[sel]
        h = F.silu(torch.baddbmm(self.b1[sel], x, self.w1[sel]))
        h = F.silu(torch.baddbmm(self.b2[sel], h, self.w2[sel]))
        return torch.baddbmm(self.b3[sel], h, self.w3[sel]).squeeze(-1)

    def weights(self) -> native.MLPWeights:
        """The networks' weights for `kvtier.native.kvp_score` (views of the parameters, without autograd)."""
        return native.MLPWeights(self.mean, self.std, *(p.detach() for p in (self.w1, self.b1, self.w2, self.b2,
                                                                             self.w3, self.b3)))

    def age_bias(self, ages: torch.Tensor, agents: slice | None = None) -> torch.Tensor:
        """The recency term for entries of age `ages` (``[tokens]`` or ``[agents, tokens]``): ``[agents, tokens]``."""
        table = self.age[slice(None) if agents is None else agents]
        lower, upper, w = age_basis(ages)
        shape = (table.shape[0], ages.shape[-1])
        lo = torch.gather(table, 1, lower.expand(shape))
        hi = torch.gather(table, 1, upper.expand(shape))
        return lo + (hi - lo) * w.expand(shape)


_KEPT_POSITIONS = 256   # the longest run of positions whose features a scorer keeps for the next layer


@dataclass
class KVPScorer:
    """Scores entries with the trained agents of their layer.

    Parameters
    ----------
    path
        A weights file made by ``kvtier train``; ``None`` loads the one shipped for `model`.
    model
        Name of a model with shipped weights (used when `path` is None).
    """

    path: str | None = None
    model: str = "SmolLM2-135M-Instruct"
    name: str = "kvp"
    # launches only (`scoring.capturable`): the position features it keeps are a memo, checked against the
    # positions tensor's version before use and written in place, so a replay that skips its Python reads or
    # rewrites the same tensor
    capturable: ClassVar[bool] = True
    agents: KVPAgents = field(init=False, repr=False)
    meta: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.agents, self.meta = load_agents(self.path if self.path is not None else shipped_path(self.model))
        self._fresh_caches()

    def _fresh_caches(self) -> None:
        """What the scorer keeps between calls: its agents (and their weights' views) per device, the last
        step's position features; and whether it scores through the native kernel (`native_score`: None,
        where the kernel runs, CUDA with cupy; one launch where the networks take a dozen)."""
        self._device_copies: dict[torch.device, tuple[KVPAgents, native.MLPWeights]] = {}
        # (positions, version, feats, made under a CUDA graph capture)
        self._last_positions: tuple[torch.Tensor, int, torch.Tensor, bool] | None = None
        # a decode step's features, kept per positions tensor (a cache keeps one for its decode steps; caches
        # sharing this scorer each get their own): id -> (a weak reference to the tensor, its features). Not a
        # WeakKeyDictionary: its lookups compare tensors with ==, which reads a device value back
        self._step_features: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.native_score: bool | None = None
        self._kernels_here: dict[torch.device, bool] = {}

    @classmethod
    def from_agents(cls, agents: KVPAgents, meta: dict[str, Any], name: str = "kvp") -> KVPScorer:
        """A scorer over agents held in memory (training and calibration), not read from a file."""
        scorer = cls.__new__(cls)
        scorer.path, scorer.model, scorer.name = None, str(meta.get("model", "")), name
        scorer.agents, scorer.meta = agents.eval(), dict(meta)
        scorer._fresh_caches()
        return scorer

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.meta["num_layers"], self.meta["num_kv_heads"], self.meta["head_dim"]

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Refuse a model whose shape differs from the one the weights were trained for (`ModelBound`)."""
        if (num_layers, num_kv_heads, head_dim) != self.shape:
            raise ConfigError(
                f"the KVP scorer {self.meta.get('model')!r} was trained for {self.shape[0]} layers x "
                f"{self.shape[1]} KV heads x head size {self.shape[2]}, but the model has {num_layers} x "
                f"{num_kv_heads} x {head_dim}; train one for this model (`kvtier traces` then `kvtier train`)")

    def check_sizes(self, hidden_size: int | None, vocab_size: int | None) -> None:
        """Refuse a model of the right shape whose hidden or vocabulary size differs from the one the weights were
        trained for (recorded with them): another model, whose keys and values the networks never saw. A size not
        known on either side is not compared."""
        for name, size in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            trained = self.meta.get(name)
            if size is not None and trained is not None and size != trained:
                raise ConfigError(
                    f"the KVP scorer {self.meta.get('model')!r} was trained for a model with {name}={trained}, but "
                    f"this model has {name}={size}: another model of the same KV shape; train one for this model "
                    "(`kvtier traces` then `kvtier train`)")

    def _on(self, device: torch.device) -> KVPAgents:
        return self._copy(device)[0]

    def _copy(self, device: torch.device) -> tuple[KVPAgents, native.MLPWeights]:
        if device not in self._device_copies:
            # Module.to moves in place: copy first so the CPU agents stay where they are
            agents = self.agents if device.type == "cpu" else copy.deepcopy(self.agents).to(device)
            self._device_copies[device] = (agents, agents.weights())
        return self._device_copies[device]

    def _kernel_scores(self, device: torch.device) -> bool:
        if self.native_score is not None:
            return self.native_score
        if device not in self._kernels_here:   # kernels on and cupy importable: asked once per device
            self._kernels_here[device] = device.type == "cuda" and native.kernel_status() is None
        return self._kernels_here[device] and not native.build_failed(device, "kvp_score")

    @torch.no_grad()
    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              layer_idx: int) -> torch.Tensor:
        check_one_sequence(keys, self.name)
        heads = keys.shape[1]
        agents, weights = self._copy(keys.device)
        feats = self._position_features(positions, keys.device)
        if self._kernel_scores(keys.device):
            return native.kvp_score(keys[0], values[0], feats, weights, layer_idx * heads).unsqueeze(0)
        x = entry_features(keys[0], values[0], positions, feats)
        out = agents(x, slice(layer_idx * heads, (layer_idx + 1) * heads))
        return out.unsqueeze(0)

    def _position_features(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`position_features` of `positions`, computed once for the very tensor every layer of a step passes
        (`SharedResources.positions`), not once per layer, and again once it was written to. Only short runs
        of positions are kept (a prefill chunk computes its own: it is one of many launches there). A decode
        step's features go into a tensor kept for them, so every decode step's launches read them at one
        address."""
        if positions.is_inference():   # it has no version to tell a rewrite by (the cache's own is made outside)
            return position_features(positions.to(device))
        last = self._last_positions
        version = positions._version
        # features computed under a CUDA graph's capture are only queued there (and lost if the capture fails):
        # a memo made during a capture serves that capture alone
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if last is not None and last[0] is positions and last[1] == version and last[2].device == device \
                and last[3] == capturing:
            return last[2]
        n = positions.numel()
        if n > _KEPT_POSITIONS:
            self._last_positions = None
            return position_features(positions.to(device))
        entry = self._step_features.get(id(positions)) if n == 1 else None
        kept = entry[1] if entry is not None and entry[0]() is positions and entry[1].device == device else None
        if n == 1 and kept is None:
            with torch.inference_mode(False):   # written in and out of inference mode alike
                kept = torch.empty(1, POSITION_FEATURES, device=device)
            self._step_features = {k: e for k, e in self._step_features.items() if e[0]() is not None}
            self._step_features[id(positions)] = (weakref.ref(positions), kept)
        feats = position_features(positions.to(device), out=kept)
        self._last_positions = (positions, version, feats, capturing)
        return feats

    @torch.no_grad()
    def age_bias(self, ages: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``ages`` ``[kv_heads, n]`` int -> ``[kv_heads, n]`` float32, added to the scores at every ranking."""
        heads = ages.shape[0]
        return self._on(ages.device).age_bias(ages, slice(layer_idx * heads, (layer_idx + 1) * heads))


def shipped_for(config: Any, head_dim: int) -> str | None:
    """The name of the shipped KVP weights trained for a model with this config and key head size (the model's
    shape's: the weights' networks take keys of that size), if any."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return shipped_matching({"num_layers": getattr(cfg, "num_hidden_layers", None),
                             "num_kv_heads": getattr(cfg, "num_key_value_heads", None), "head_dim": head_dim,
                             "hidden_size": getattr(cfg, "hidden_size", None),
                             "vocab_size": getattr(cfg, "vocab_size", None)})


def shipped_matching(signature: dict[str, Any]) -> str | None:
    """The name of the shipped KVP weights whose model has every size in `signature` (keys of `MODEL_SIGNATURE`,
    as the weights record them), if any: a model is known by its sizes, whatever name it was loaded under."""
    for model in SHIPPED:
        path = shipped_path(model)
        if not path.is_file():
            continue
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("kvtier", "{}"))
        if all(meta.get(k) == v for k, v in signature.items()):
            return model
    return None


def shipped_path(model: str) -> Path:
    """The packaged weights file for `model`."""
    if model not in SHIPPED:
        raise ConfigError(f"no KVP weights ship for model {model!r}; shipped: {', '.join(SHIPPED)}; make one "
                          "with `kvtier traces` and `kvtier train`, then pass scorer_kwargs={'path': FILE}")
    return Path(str(resources.files("kvtier.scoring").joinpath("weights", SHIPPED[model])))


def save_agents(agents: KVPAgents, path: str | Path, meta: dict[str, Any]) -> None:
    """Write weights and metadata (model, shape, training data, objective, version) to safetensors."""
    state = {k: v.detach().cpu().contiguous() for k, v in agents.state_dict().items()}
    info = {**meta, "format_version": FORMAT_VERSION, "hidden": agents.hidden, "head_dim": agents.head_dim}
    save_tensors(state, path, metadata={"kvtier": json.dumps(info)})


def load_agents(path: str | Path) -> tuple[KVPAgents, dict[str, Any]]:
    """Read a weights file written by `save_agents`."""
    from safetensors import safe_open

    path = str(path)
    try:
        with safe_open(path, framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("kvtier", "null"))
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise ConfigError(f"cannot read KVP weights from {path!r}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{path!r} is not a kvtier KVP weights file (format version {FORMAT_VERSION})")
    sizes = {k: meta.get(k) for k in ("num_layers", "num_kv_heads", "head_dim", "hidden")}
    bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ConfigError(f"{path!r} describes its agents with {', '.join(bad)}; allowed: whole numbers >= 1 for "
                          f"{', '.join(sizes)}")
    agents = KVPAgents(meta["num_layers"] * meta["num_kv_heads"], meta["head_dim"], meta["hidden"])
    state = load_file(path)
    state.setdefault("age", torch.zeros_like(agents.age))   # files written before the recency term rank by content
    try:
        agents.load_state_dict(state)
    except RuntimeError as e:
        raise ConfigError(f"{path!r} does not hold the KVP weights its metadata describes: {e}") from e
    agents.eval()
    return agents, meta
