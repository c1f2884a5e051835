"""Native kernels for the hot paths, each with a torch twin that gives the same bits.

The lowest layer of kvtier: it imports nothing of the rest but `kvtier.errors`, and importing it imports
neither cupy nor anything CUDA. The CUDA sources live in the repository's top-level ``native/`` folder
(shipped in the package as ``kvtier/native/cuda``) and are compiled on first use with cupy's NVRTC:

- `gather_pages`: pages of a slab storage into a contiguous buffer; on CUDA the slabs may be pinned host
  memory, read by the kernel through its mapping (recall without staging or a copy call per page);
- `recall_pages`: the pages a device-side plan chose (rows and per-head counts on the device) into the
  recall buffer's slots, with nothing read back to the host;
- `plan_recall`: a recall step's plan (which wanted pages are missing, which slots they take, the copy's
  rows) and its bookkeeping (prefetch flags, counters), made on the device in one launch;
- `scatter_pages`: contiguous pages into distinct rows of a slab storage (the recall buffer's free slots);
- `index_pages`: the recall index of a demotion's pages (key bounds written in place, 2-bit key codes out);
- `pack_entries`: chosen entries of the device pool into contiguous pages (demotion staging);
- `move_entries`: entries of the device pool onto others of the same heads (filling a demotion's holes);
- `page_upper_bounds`: the key-bound upper bound of every demoted page for a block of queries;
- `code_logits`: the logits of short-listed pages estimated from their 2-bit key codes;
- `rank_pages`: the short list's estimated shares of attention and its ranking, in one launch;
- `kvp_score`: KVP's networks over a step's new entries, every head in one launch;
- `merge_parts`: attention over the union of key sets from each set's output and log-sum-exp;
- `attend_slabs`: a decoding step's attention over the device pool's slabs, split into chunks that fill the
  GPU, with its log-sum-exp;
- `attend_pages`: the same over the recalled pages where the recall buffer holds them (a page table, no
  gather), merged with the rest of the step's attention.

Each operation runs its kernel when it can (CUDA tensors, cupy importable, ``KVTIER_NATIVE`` not ``0``) and
its twin (`kvtier.native.twins`) otherwise, on whatever device the tensors are; `backend()` tells which ran.
"""

from .loader import backend, build_failed, indexed_device, reset_stats, sources
from .loader import status as kernel_status
from .ops import (attend_chunk, attend_pages, attend_slabs, code_logits, gather_pages, index_pages, kvp_score,
                  merge_parts, move_entries, pack_entries, page_upper_bounds, plan_recall, rank_pages,
                  rank_pages_tile, recall_pages, scatter_pages, slab_addresses)
from .twins import ATTEND_ROWS, MLPWeights, RecallPlan

__all__ = ["ATTEND_ROWS", "MLPWeights", "RecallPlan", "attend_chunk", "attend_pages", "attend_slabs", "backend",
           "build_failed", "code_logits", "gather_pages", "index_pages", "indexed_device", "kernel_status",
           "kvp_score", "merge_parts", "move_entries", "pack_entries", "page_upper_bounds", "plan_recall",
           "rank_pages", "rank_pages_tile", "recall_pages", "reset_stats", "scatter_pages", "slab_addresses",
           "sources"]
