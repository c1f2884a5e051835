"""The device tier of one layer: the entries attention reads every step, in slabs of `slab_tokens`.

Every head holds the same number of entries (budgets are per head and equal), so the tier is rectangular:
entries ``[0, count)`` are committed and a step's new tokens are staged at ``[count, count + q)`` while
attention runs. Order inside the tier carries no meaning once entries have been demoted: a demotion fills
the holes it leaves with the last entries (it moves at most as many entries as it demotes, never the whole
tier). Slabs are added as the tier grows and are never copied.

`take` and `remove` are tensor operations of fixed shape, a gather and a scatter per slab, with nothing read
back to the host: a GPU step that demotes queues them behind the attention that came before.

A decode step (one new token) writes its entry where a tensor on the device says (`at`: the count's place in
its slab), which the step's commit moves on by one, so its launches are the same from one decode step to the
next while the slab lasts (what a captured step needs); `attend_slabs` reads the count from there too.

Shapes per slab: ``k``, ``v`` ``[1, heads, slab_tokens, head_dim]``; ``pos`` ``[heads, slab_tokens]`` int64;
``score`` ``[heads, slab_tokens]`` float32.
"""

from __future__ import annotations

import torch

from .. import native
from ..errors import CapacityError, check_whole


class DevicePool:
    """Slabs of K/V on the compute device (GPU, or plain memory on a CPU-only machine)."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 slab_tokens: int) -> None:
        check_whole("head_dim", head_dim, 1)
        check_whole("heads", heads, 0)   # a pool of no head holds nothing (the kernels' grid checks make one)
        # indexed: the slabs' tensors say cuda:N, and the kernels' address tables are kept for the device named
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, native.indexed_device(device)
        self.slab_tokens = max(1, int(slab_tokens))
        self.count = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []
        self.score: list[torch.Tensor] = []
        self._addresses: tuple | None = None   # of the k, v, pos and score slabs, for the kernels
        self._kv: tuple | None = None          # (those tables, the k and v ones as `addresses` gives them)
        self._at: torch.Tensor | None = None   # int64 [1] on the device: count % slab_tokens, for a decode step
        self._at_holds: int | None = None      # what `_at` holds once the launches queued so far have run
        self._first: tuple | None = None       # (the first key slab, its first entry's key and value): `placeholder`

    @property
    def capacity(self) -> int:
        return len(self.k) * self.slab_tokens

    def ensure(self, n: int) -> None:
        """Room for `n` entries, slabs added as needed (a step whose staging is a captured launch makes its room
        first)."""
        S, H = self.slab_tokens, self.heads
        while self.capacity < n:
            try:   # all four first: a failure part way must not leave the lists of unequal lengths
                k = torch.empty(1, H, S, self.head_dim, dtype=self.dtype, device=self.device)
                v = torch.empty_like(k)
                pos = torch.empty(H, S, dtype=torch.int64, device=self.device)
                score = torch.empty(H, S, dtype=torch.float32, device=self.device)
            except RuntimeError as e:
                raise CapacityError(f"could not allocate a device slab of {S} tokens x {H} heads on "
                                    f"{self.device}: {e}") from e
            self.k.append(k)
            self.v.append(v)
            self.pos.append(pos)
            self.score.append(score)
            self._addresses = None

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
        self.ensure(self.count + k.shape[2])
        if k.shape[2] != 1:
            self._write(self.count, k, v, pos)
            return
        s, at = self.count // self.slab_tokens, self.at()
        self.k[s].index_copy_(2, at, k if k.dtype == self.dtype else k.to(self.dtype))
        self.v[s].index_copy_(2, at, v if v.dtype == self.dtype else v.to(self.dtype))
        self.pos[s].index_copy_(1, at, pos)

    def at(self) -> torch.Tensor:
        """``count % slab_tokens`` as an int64 ``[1]`` on the device (where a decode step's entry goes), the
        same tensor every step; written from the host only when it does not hold that already."""
        want = self.count % self.slab_tokens
        if self._at is None:
            self._at = torch.empty(1, dtype=torch.int64, device=self.device)
        if self._at_holds != want:
            self._at.fill_(want)
            self._at_holds = want
        return self._at

    def counted(self, extra: int) -> tuple[torch.Tensor, int]:
        """``count + extra`` as the device reads it, ``(at(), base)`` with ``base + at()[0]`` that sum
        (`kvtier.native.attend_slabs`' `counted`): `base` changes only with the slab the count is in."""
        return self.at(), self.count - self.count % self.slab_tokens + extra

    def commit(self, q: int, score: torch.Tensor) -> None:
        """Make the `q` staged tokens committed entries, with their scores ``[heads, q]``."""
        if q == 1:   # a decode step: at its place, then the place moves on, on the device, within the slab
            self.at()
            self.commit_launches(score)
            self.note_commit()
            return
        S, done = self.slab_tokens, 0
        while done < q:
            s, off = divmod(self.count + done, S)
            n = min(q - done, S - off)
            self.score[s][:, off:off + n].copy_(score[:, done:done + n])
            done += n
        self.count += q

    def commit_launches(self, score: torch.Tensor) -> None:
        """A decode step's commit on the device, launches only (a captured step replays them): its score
        ``[heads, 1]`` at its place, and the place moved on unless the step fills the slab. `at()` must hold the
        count already; `note_commit` then does the host's part."""
        self.score[self.count // self.slab_tokens].index_copy_(1, self._at, score.float())
        if (self.count + 1) % self.slab_tokens:
            self._at.add_(1)

    def note_commit(self) -> None:
        """The host's part of a decode step's commit, after `commit_launches`: the count, and what `_at` holds."""
        self.count += 1
        if self.count % self.slab_tokens:
            self._at_holds += 1

    def forget_at(self) -> None:
        """After a step that failed: its `commit_launches` may have moved the place on the device without
        `note_commit` on the host, so the next `at()` writes the place again rather than trust it."""
        self._at_holds = None

    def addresses(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The key and value slabs' addresses for `kvtier.native.attend_slabs`, kept until a slab is added
        or released (None where kernels cannot run)."""
        tables = self.tables()
        if self._kv is None or self._kv[0] is not tables:   # the same pair while the tables stand
            k, v = tables[:2]
            self._kv = (tables, None if k is None or v is None else (k, v))
        return self._kv[1]

    def tables(self) -> tuple[torch.Tensor | None, ...]:
        """The key, value, position and score slabs' address tables for the kernels (`native.slab_addresses`;
        None where kernels cannot run), kept until a slab is added or released."""
        if self._addresses is None:
            self._addresses = tuple(native.slab_addresses(kind, self.device) if kind else None
                                    for kind in (self.k, self.v, self.pos, self.score))
        return self._addresses

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

    def placeholder(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of the shape `contiguous(n)` has, ``[1, heads, n, dim]``, made of views of the first entry
        (no copy, no launch): for a caller that only needs the shape (a step whose attention reads the slabs)."""
        first = self._first
        if first is None or first[0] is not self.k[0]:   # the views kept while the first slab stands (two ops)
            first = self._first = (self.k[0], self.k[0][:, :, :1], self.v[0][:, :, :1])
        return (first[1].expand(1, self.heads, n, self.head_dim), first[2].expand(1, self.heads, n, self.head_dim))

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
        """Keys and values of entries ``idx`` ``[heads, m]``: ``[heads, m, dim]`` each (one launch each over
        every slab, `native.pack_entries`)."""
        k_at, v_at, _, _ = self.tables()
        return (native.pack_entries(self.k, idx, addresses=k_at, checked=False),
                native.pack_entries(self.v, idx, addresses=v_at, checked=False))

    def remove(self, idx: torch.Tensor) -> None:
        """Drop committed entries ``idx`` ``[heads, m]`` (distinct per head); the last entries fill the holes.

        Head by head, the tail entries that stay (the last `m`, less those dropped) move, in order, into the
        dropped entries below the tail, in the order `idx` gives them. Written with one fixed shape for every
        head: lane ``j`` of a head with fewer holes than `m` copies a tail entry onto itself, so no lane writes
        what another reads (one `native.move_entries` launch per kind of slab, whatever their number).
        """
        m = idx.shape[1]
        if m == 0:
            return
        new = self.count - m
        in_tail = idx >= new
        gone = torch.zeros(self.heads, m + 1, dtype=torch.bool, device=self.device)
        gone.scatter_(1, torch.where(in_tail, idx - new, m), True)
        gone = gone[:, :m]                                                   # tail entries dropped
        movers = new + torch.argsort(gone.to(torch.uint8), dim=1, stable=True)   # the staying ones first
        moves = (~gone).sum(dim=1, keepdim=True)                             # as many as holes below the tail
        holes = idx.gather(1, torch.argsort(in_tail.to(torch.uint8), dim=1, stable=True))   # below the tail first
        dst = torch.where(torch.arange(m, device=self.device)[None, :] < moves, holes, movers)
        for kind, at in zip((self.k, self.v, self.pos, self.score), self.tables()):
            native.move_entries(kind, movers, dst, addresses=at)
        self.count = new

    def trim(self) -> None:
        """Release the slabs past the committed entries (those a long step's staging added)."""
        keep = max(1, -(-self.count // self.slab_tokens))
        if len(self.k) > keep:
            self._addresses = None
        for kind in (self.k, self.v, self.pos, self.score):
            del kind[keep:]

    def replace(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Make ``k, v`` ``[heads, n, dim]`` (with ``pos, score`` ``[heads, n]``) the committed entries. Shapes are
        checked before anything is written (a write cut short would pair the new entries with the old positions)."""
        H, D = self.heads, self.head_dim
        n = k.shape[1] if k.dim() == 3 else -1
        if (n < 0 or tuple(k.shape) != (H, n, D) or v.shape != k.shape or tuple(pos.shape) != (H, n)
                or tuple(score.shape) != (H, n)):
            raise ValueError(f"the device pool takes k, v [{H}, n, {D}] and pos, score [{H}, n]; got k "
                             f"{tuple(k.shape)}, v {tuple(v.shape)}, pos {tuple(pos.shape)}, "
                             f"score {tuple(score.shape)}")
        self.ensure(n)
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
        self.forget_at()
        self.k, self.v, self.pos, self.score = [], [], [], []
        self._addresses = self._first = None
