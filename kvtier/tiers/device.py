"""The device tier of one layer: the entries attention reads every step, in slabs of `slab_tokens`.

Every head holds the same number of entries (budgets are per head and equal), so the tier is rectangular:
entries ``[0, count)`` are committed and a step's new tokens are staged at ``[count, count + q)`` while
attention runs. Order inside the tier carries no meaning once entries have been demoted: a demotion fills
the holes it leaves with the last entries (it moves at most as many entries as it demotes, never the whole
tier). Slabs are added as the tier grows and are never copied.

Shapes per slab: ``k``, ``v`` ``[1, heads, slab_tokens, head_dim]``; ``pos`` ``[heads, slab_tokens]`` int64;
``score`` ``[heads, slab_tokens]`` float32.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError


class DevicePool:
    """Slabs of K/V on the compute device (GPU, or plain memory on a CPU-only machine)."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 slab_tokens: int) -> None:
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        self.slab_tokens = max(1, int(slab_tokens))
        self.count = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []
        self.score: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        return len(self.k) * self.slab_tokens

    def _ensure(self, n: int) -> None:
        S, H = self.slab_tokens, self.heads
        while self.capacity < n:
            try:
                self.k.append(torch.empty(1, H, S, self.head_dim, dtype=self.dtype, device=self.device))
                self.v.append(torch.empty_like(self.k[-1]))
                self.pos.append(torch.empty(H, S, dtype=torch.int64, device=self.device))
                self.score.append(torch.empty(H, S, dtype=torch.float32, device=self.device))
            except RuntimeError as e:
                raise CapacityError(f"could not allocate a device slab of {S} tokens x {H} heads on "
                                    f"{self.device}: {e}") from e

    def _write(self, start: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write entries ``k, v`` ``[1, heads, q, dim]`` and ``pos`` ``[heads, q]`` at ``[start, start + q)``."""
        q, S, done = k.shape[2], self.slab_tokens, 0
        while done < q:
            s, off = divmod(start + done, S)
            n = min(q - done, S - off)
            self.k[s][:, :, off:off + n].copy_(k[:, :, done:done + n])
            self.v[s][:, :, off:off + n].copy_(v[:, :, done:done + n])
            self.pos[s][:, off:off + n].copy_(pos[:, done:done + n])
            done += n

    def stage(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Put a step's new tokens after the committed entries (not committed yet)."""
        self._ensure(self.count + k.shape[2])
        self._write(self.count, k, v, pos)

    def commit(self, q: int, score: torch.Tensor) -> None:
        """Make the `q` staged tokens committed entries, with their scores ``[heads, q]``."""
        S, done = self.slab_tokens, 0
        while done < q:
            s, off = divmod(self.count + done, S)
            n = min(q - done, S - off)
            self.score[s][:, off:off + n].copy_(score[:, done:done + n])
            done += n
        self.count += q

    def spans(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views ``(k, v)`` ``[1, heads, m, dim]`` of the slabs covering entries ``[0, n)``."""
        out, S = [], self.slab_tokens
        for s in range(-(-n // S)):
            m = min(S, n - s * S)
            out.append((self.k[s][:, :, :m], self.v[s][:, :, :m]))
        return out

    def contiguous(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries ``[0, n)`` as ``[1, heads, n, dim]`` (views when one slab holds them, else a copy)."""
        parts = self.spans(n)
        if len(parts) == 1:
            return parts[0]
        if not parts:
            empty = torch.empty(1, self.heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)

    def meta(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and scores ``[heads, n]`` of entries ``[0, n)`` (default: the committed ones)."""
        n = self.count if n is None else n
        S, parts = self.slab_tokens, -(-n // self.slab_tokens)
        cut = [min(S, n - s * S) for s in range(parts)]
        if parts == 1:
            return self.pos[0][:, :n], self.score[0][:, :n]
        if parts == 0:
            return (torch.empty(self.heads, 0, dtype=torch.int64, device=self.device),
                    torch.empty(self.heads, 0, device=self.device))
        return (torch.cat([p[:, :c] for p, c in zip(self.pos, cut)], dim=1),
                torch.cat([p[:, :c] for p, c in zip(self.score, cut)], dim=1))

    def take(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of entries ``idx`` ``[heads, m]``: ``[heads, m, dim]`` each."""
        S = self.slab_tokens
        if len(self.k) == 1:
            ix = idx[..., None].expand(-1, -1, self.head_dim)
            return torch.gather(self.k[0][0], 1, ix), torch.gather(self.v[0][0], 1, ix)
        slab, off = torch.div(idx, S, rounding_mode="floor"), idx % S
        heads = torch.arange(self.heads, device=idx.device)[:, None].expand_as(idx)
        k = torch.empty(*idx.shape, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        for s in torch.unique(slab).tolist():
            sel = slab == s
            k[sel] = self.k[s][0][heads[sel], off[sel]]
            v[sel] = self.v[s][0][heads[sel], off[sel]]
        return k, v

    def remove(self, idx: torch.Tensor) -> None:
        """Drop committed entries ``idx`` ``[heads, m]`` (ascending per head); the last entries fill the holes."""
        m = idx.shape[1]
        new = self.count - m
        for h in range(self.heads):
            gone = idx[h]
            holes = gone[gone < new]
            if holes.numel() == 0:
                continue
            tail = torch.ones(m, dtype=torch.bool, device=self.device)
            tail[gone[gone >= new] - new] = False
            movers = torch.arange(new, self.count, device=self.device)[tail]
            self._move(h, movers, holes)
        self.count = new

    def _move(self, h: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy head `h`'s entries at `src` over those at `dst` (same length)."""
        S = self.slab_tokens
        for kind in (self.k, self.v, self.pos, self.score):
            rows = [t[0, h] if t.dim() == 4 else t[h] for t in kind]
            if len(rows) == 1:
                rows[0][dst] = rows[0][src]
                continue
            s_slab, s_off = torch.div(src, S, rounding_mode="floor"), src % S
            vals = torch.empty((len(src), *rows[0].shape[1:]), dtype=rows[0].dtype, device=self.device)
            for s in torch.unique(s_slab).tolist():
                sel = s_slab == s
                vals[sel] = rows[s][s_off[sel]]
            d_slab, d_off = torch.div(dst, S, rounding_mode="floor"), dst % S
            for s in torch.unique(d_slab).tolist():
                sel = d_slab == s
                rows[s][d_off[sel]] = vals[sel]

    def trim(self) -> None:
        """Release the slabs past the committed entries (those a long step's staging added)."""
        keep = max(1, -(-self.count // self.slab_tokens))
        for kind in (self.k, self.v, self.pos, self.score):
            del kind[keep:]

    def replace(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Make ``k, v`` ``[heads, n, dim]`` (with ``pos, score`` ``[heads, n]``) the committed entries."""
        n = k.shape[1]
        self._ensure(n)
        self._write(0, k[None], v[None], pos)
        self.count = 0
        self.commit(n, score)

    def entry_bytes(self) -> int:
        """Bytes of one entry of one head: key, value, position and score."""
        return 2 * self.head_dim * torch.empty((), dtype=self.dtype).element_size() + 8 + 4

    def reserved_bytes(self) -> int:
        return self.capacity * self.heads * self.entry_bytes()

    def clear(self) -> None:
        """Forget every entry and release the slabs."""
        self.count = 0
        self.k, self.v, self.pos, self.score = [], [], [], []
