"""The recall index: what recall reads about every demoted page.

Per KV head and page: the elementwise key bounds (cache dtype, rounded outward) on the device, and 2-bit key
codes inside them in host memory. Every step reads the bounds of all pages (one number per page and query
comes out), but only the codes of a short list of candidates, so only the bounds need to sit beside the
device entries: ``2 * head_dim`` values per page, 1/16 of the page's keys and values at 16 entries a page.
Rows are page ids of the page table; both parts grow a slab at a time and are never copied.
"""

from __future__ import annotations

import torch

from .. import native
from ..tiers.slabs import SlabRows
from ..transfer.read_mark import ReadMark
from .bounds import page_bounds, round_outward
from .codes import code_width, encode

PAGES_PER_SLAB = 1024
_CHUNK_ELEMENTS = 1 << 22    # query rows x pages per bound product, bounds the working memory


class PageIndex:
    """Bounds (device) and codes (host) of a layer's demoted pages, by page id."""

    def __init__(self, heads: int, page_size: int, dim: int, dtype: torch.dtype, device: torch.device,
                 pin: bool = False, pages_per_slab: int = PAGES_PER_SLAB) -> None:
        self.heads, self.page_size, self.dim, self.dtype, self.device = heads, page_size, dim, dtype, device
        # one row per (page, head): row = page * heads + head, so a short list is one gather; a row is the
        # key maximum then the key minimum, so the bound of every page is one product with [q+, q-]
        self.bounds = SlabRows((2 * dim,), dtype, device, pages_per_slab * heads)
        self.codes = SlabRows((page_size, code_width(dim)), torch.uint8, "cpu", pages_per_slab * heads, pin)
        self.n = 0
        self._reads = ReadMark()   # the end of the last device read of the pinned codes
        self._head_rows: torch.Tensor | None = None   # [heads, 1]: 0 .. heads - 1, kept (one op fewer a step)
        # whether page choice runs the native kernels (`page_upper_bounds`, `code_logits`: one launch each
        # where the matrix products take several); None: where they can run (CUDA and cupy; their twins,
        # a long run of small ops, would cost more launches than they save). Their sums round in another
        # order than a matrix product's, as a GPU's products already do than a CPU's.
        self.native_select: bool | None = None
        self._kernels_here: bool | None = None

    @property
    def uses_kernels(self) -> bool:
        if self.native_select is not None:
            return self.native_select
        if self._kernels_here is None:
            self._kernels_here = self.device.type == "cuda" and native.kernel_status() is None
        return self._kernels_here and not native.build_failed(self.device, "page_select", "rank_pages", "merge_parts")

    def add(self, k_pages: torch.Tensor) -> None:
        """Index the next pages from their keys ``[heads, pages, page_size, dim]`` (all entries valid)."""
        codes = self._stage(k_pages)
        self.codes.scatter(torch.arange(self.n * self.heads, (self.n + k_pages.shape[1]) * self.heads), codes.cpu())
        self.commit(k_pages.shape[1])

    def stage(self, k_pages: torch.Tensor, transfer, jobs: list[int]) -> None:
        """`add`, split for a demotion that must not wait: the bounds are written on the device, the codes start
        their copy to host memory through `transfer` (job ids joining `jobs`), and the pages count once
        `commit` is called; readers of their rows wait for those copies."""
        codes = self._stage(k_pages)
        rows = range(self.n * self.heads, (self.n + k_pages.shape[1]) * self.heads)
        self.codes.write_from(rows, codes, transfer, jobs)

    def _stage(self, k_pages: torch.Tensor) -> torch.Tensor:
        """Write the bounds of the next pages past the indexed ones; return their codes ``[m * heads, ...]``
        (`kvtier.native.index_pages`: one launch where kernels run)."""
        m, H = k_pages.shape[1], self.heads
        for part in (self.bounds, self.codes):
            part.ensure((self.n + m) * H)
        if k_pages.dtype != self.dtype:   # keys of another dtype than the cache's: bounds rounded outward to it
            lo, hi = round_outward(*page_bounds(k_pages, torch.full(k_pages.shape[:2], self.page_size,
                                                                    device=k_pages.device)), self.dtype)
            self.bounds.write_range(self.n * H, torch.cat([hi, lo], dim=-1).transpose(0, 1).reshape(m * H, -1))
            return encode(k_pages, lo, hi).transpose(0, 1).reshape(m * H, self.page_size, -1)
        return native.index_pages(k_pages, self.bounds.slabs, self.bounds.rows_per_slab, self.n * H,
                                  addresses=self.bounds.addresses(self.device))

    def commit(self, pages: int) -> None:
        """Count `pages` staged pages as indexed."""
        self.n += pages

    def upper_bounds(self, q: torch.Tensor) -> torch.Tensor:
        """The largest logit any key of each page can give a KV head's queries ``q`` ``[heads, rows, dim]``.

        Returns ``[heads, n]`` float32, computed slab by slab and in blocks of query rows.
        """
        H = self.heads
        if self.uses_kernels:   # one launch over every slab, from the bounds rows as they are kept
            if self.n == 0:
                return torch.empty(H, 0, device=q.device)
            spans = [b for _, b in self.bounds.spans(self.n * H)]
            addresses = self.bounds.addresses(self.device)
            if addresses is None and len(spans) > 1:   # forced where no kernel runs: one twin call, as one launch
                spans = [torch.cat(spans)]
            return native.page_upper_bounds(q, spans, H, addresses=addresses, rows_per_slab=self.bounds.rows_per_slab)
        if q.shape[1] == 0:   # no query row bounds anything: -inf, as the kernel's maximum over none
            return torch.full((H, self.n), float("-inf"), device=q.device)
        q2 = torch.cat([q.float().clamp(min=0), q.float().clamp(max=0)], dim=-1)    # [heads, rows, 2 dim]
        out = []
        for _, b in self.bounds.spans(self.n * H):
            b_t = b.float().view(-1, H, 2 * self.dim).permute(1, 2, 0)             # [heads, 2 dim, pages]
            step = max(1, _CHUNK_ELEMENTS // (H * b_t.shape[2]))
            best = None
            for r in range(0, q2.shape[1], step):
                ub = torch.bmm(q2[:, r:r + step], b_t).amax(dim=1)
                best = ub if best is None else torch.maximum(best, ub)
            out.append(best)
        if not out:
            return torch.empty(H, 0, device=q.device)
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    def pick(self, ids: torch.Tensor, note: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bounds ``[heads, m, dim]`` and codes ``[heads, m, page_size, dim/4]`` of pages ``ids`` ``[heads, m]``,
        all on the device (`note` as for `rank`)."""
        heads, m = ids.shape
        head_rows = self._head_rows
        if head_rows is None or head_rows.device != ids.device:
            head_rows = torch.arange(heads, device=ids.device)[:, None]
            # kept unless made inside a CUDA graph capture: a tensor made there is written only by the graph's
            # replays (never, if the capture fails), and reading it outside them would read whatever is there
            if not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._head_rows = head_rows
        rows = (ids * heads + head_rows).reshape(-1)
        if self.device.type == "cuda":   # device ids read both storages in place: nothing comes back to the host
            bounds = _rows_by_device_ids(self.bounds, rows, self.device)
            codes = _rows_by_device_ids(self.codes, rows, self.device)
            if note:
                self.note_reads()
        else:
            bounds = self.bounds.gather(rows.to(self.device))
            codes = self.codes.gather(rows.cpu())
        bounds = bounds.view(heads, m, 2 * self.dim)
        return (bounds[..., self.dim:], bounds[..., :self.dim],
                codes.view(heads, m, self.page_size, -1).to(self.device, non_blocking=True))

    def rank(self, q: torch.Tensor, cand: torch.Tensor, keep: int, scaling: float,
             resident_lse: torch.Tensor | None = None, note: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages ``cand`` ``[heads, m]`` ranked by their estimated share of the queries' attention, read from
        both storages where they are, in one launch (`kvtier.native.rank_pages`): ``(the best `keep` in
        ascending id, all of them best first)``. Without `note` the caller calls `note_reads` after it (work
        captured in a CUDA graph records no event: the event is recorded after the graph's replay)."""
        chosen, ranked, _ = native.rank_pages(
            q, cand, self.n, (self.bounds.slabs, self.bounds.rows_per_slab),
            (self.codes.slabs, self.codes.rows_per_slab), self.page_size, scaling, keep, resident_lse,
            addresses=(self.bounds.addresses(self.device), self.codes.addresses(self.device)))
        if note:
            self.note_reads()
        return chosen, ranked

    def note_reads(self) -> None:
        """Note that work queued on the current stream reads the pinned codes: `release` waits for it before
        they go."""
        self._reads.note(self.device)

    def ranks_in_one_launch(self, candidates: int, rows: int) -> bool:
        """Whether `rank` takes `candidates` pages for `rows` query rows in one launch here: the kernels
        choose pages (`uses_kernels`) and the short list fits a block's shared memory."""
        return self.uses_kernels and native.rank_pages_tile(candidates, rows, self.page_size, self.dim) > 0

    def device_bytes(self) -> int:
        """Device bytes of the bounds of the indexed pages."""
        return 2 * self.n * self.heads * self.dim * torch.empty((), dtype=self.dtype).element_size()

    def host_bytes(self) -> int:
        """Host bytes of the codes of the indexed pages."""
        return self.n * self.heads * self.page_size * code_width(self.dim)

    def state(self) -> dict[str, torch.Tensor]:
        """The indexed pages as plain CPU tensors ``[n * heads, ...]`` (for parking)."""
        def rows(part: SlabRows) -> torch.Tensor:
            spans = [t for _, t in part.spans(self.n * self.heads)]
            return torch.cat(spans).cpu() if spans else torch.empty(0, *part.row_shape, dtype=part.dtype)
        return {"bounds": rows(self.bounds), "codes": rows(self.codes)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Make `state` (from `state()`) the indexed pages."""
        rows_n = state["bounds"].shape[0]
        for part in (self.bounds, self.codes):
            part.ensure(rows_n)
        self.bounds.write_range(0, state["bounds"].to(self.device, self.bounds.dtype))   # rows 0 .. : slab by slab
        self.codes.write_range(0, state["codes"].to(self.codes.dtype))
        self.n = rows_n // self.heads

    def release(self) -> None:
        """Forget every page and give the slabs back (after any device read of them is done)."""
        self._reads.synchronize()
        for part in (self.bounds, self.codes):
            part.close()
        self.n = 0


def _rows_by_device_ids(storage: SlabRows, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows ``rows`` (on `device`) of a slab storage on `device` or in pinned host memory, into device memory,
    through `kvtier.native.recall_pages` (one head, every entry real): the ids never go to the host."""
    n = rows.shape[0]
    out = torch.empty((n, *storage.row_shape), dtype=storage.dtype, device=device)
    native.recall_pages(storage.slabs, storage.rows_per_slab, rows[None], torch.arange(n, device=device)[None],
                        torch.full((1,), n, device=device), out, storage.addresses(device))
    return out
