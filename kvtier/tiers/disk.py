"""The disk tier: one file of page records for a whole cache, addressed by slot.

Record ``slot`` lies at ``slot * record_size`` and is the raw payload (a page's keys, then its values)
zero-padded to a multiple of 4 KiB, so records never share a file-system block and a run of consecutive
slots is one ``preadv``/``pwritev``. There is no header on disk: the store keeps a CRC-32 and a write
generation per slot in memory, and seeds each CRC with ``crc32(slot, generation)``, so a record read from
the wrong slot, or a stale earlier write at a reused slot, fails the check instead of being returned.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import os
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from ..errors import CapacityError, CorruptPageError, check_whole
from .base import slot_numbers

ALIGN = 4096  # records start and end on 4 KiB boundaries
CHUNK = 4096  # slots per chunk of the in-memory per-slot arrays
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_SEED = struct.Struct("<QI")
_MIN_TASK_BYTES = 1 << 20  # I/O is split across threads in pieces of at least this much
_RUN_RECORDS = 256  # records read at most by one call (into a scratch buffer of that many)
_SCRATCH_RECORDS = 1024  # records read into one scratch buffer before they are checked and copied out
_READ_GAP = 3  # pages to read are read in one call when at most this many records apart (dropping those between)
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_FLAGS = (os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") and os.sysconf("SC_IOV_MAX") > 0 else 16


def _seed(slot: int, gen: int) -> int:
    return zlib.crc32(_SEED.pack(slot, gen))


def _oserr(e: OSError) -> str:
    if e.errno is None:
        return str(e)
    return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror or os.strerror(e.errno)}"


def _transfer(op, fd: int, bufs: list, offset: int) -> int:
    """Repeat ``op`` (``os.preadv``/``os.pwritev``) until `bufs` are done or no progress; returns bytes done."""
    views = [memoryview(b).cast("B") for b in bufs]
    done, total, i = 0, sum(len(b) for b in views), 0
    while done < total:
        n = op(fd, views[i:i + _IOV_MAX], offset + done)
        if n <= 0:
            break
        done += n
        while i < len(views) and n >= len(views[i]):
            n, i = n - len(views[i]), i + 1
        if n:
            views[i] = views[i][n:]
    return done


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read ``len(view)`` bytes at `offset` into `view` (bytes), again after a short read; returns bytes read."""
    done = os.preadv(fd, [view], offset)
    while 0 < done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


# what the store keeps of a slot: its record's CRC, the write's generation and the CRC's seed (`_seed` of the slot
# and generation, kept so that a read checks a page with one CRC call)
_META = np.dtype([("crc", np.uint32), ("gen", np.uint32), ("seed", np.uint32), ("used", np.bool_)])


def _batches(runs: list, s: np.ndarray, records: int) -> list:
    """`runs` ``(lo, hi)`` of sorted slots `s` in consecutive batches spanning about `records` records each."""
    out, batch, size = [], [], 0
    for lo, hi in runs:
        batch.append((lo, hi))
        size += int(s[hi - 1] - s[lo]) + 1
        if size >= records:
            out.append(batch)
            batch, size = [], 0
    return out + [batch] if batch else out


class _SlotMeta:
    """Each slot's CRC, write generation and use, in chunks of `CHUNK` slots (grown, never reallocated or
    copied); one lookup reads all three."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []

    def grow(self, slots: int) -> None:
        self.chunks += [np.zeros(CHUNK, _META) for _ in range(len(self.chunks), -(-slots // CHUNK))]

    def _parts(self, slots: np.ndarray) -> list:
        c, o = np.divmod(slots, CHUNK)
        if len(c) and c.min() == c.max():   # the usual case: a layer's pages lie close together
            return [(self.chunks[int(c[0])], slice(None), o)]
        return [(self.chunks[i], c == i, o[c == i]) for i in np.unique(c)]

    def get(self, slots: np.ndarray) -> np.ndarray:
        out = np.empty(len(slots), _META)
        for chunk, m, o in self._parts(slots):
            out[m] = chunk[o]
        return out

    def set(self, slots: np.ndarray, **fields) -> None:
        for chunk, m, o in self._parts(slots):
            for name, values in fields.items():
                values = np.broadcast_to(np.asarray(values, _META[name]), slots.shape)
                chunk[name][o] = values[m]


def _wait_through_interrupts(futures: list) -> None:
    """Wait until every future has finished, whatever interrupts arrive meanwhile (disk I/O ends on its own)."""
    while True:
        try:
            wait(futures)
            return
        except KeyboardInterrupt:
            continue


class DiskStore:
    """One file of page records for a whole cache (all layers, and parked layers too).

    Parameters
    ----------
    directory : str
        Existing folder; ``<directory>/<name>.kvtp`` must not exist yet (it is never reused or followed).
    page_size, head_dim : int
        A page is keys ``[page_size, head_dim]``, then values of the same shape.
    dtype : torch.dtype
        float32, float16, bfloat16 or float64.
    io_threads, name : int, str
        Threads that read, write and checksum (started on first use); stem of the file name.

    Methods may be called from several threads, but not concurrently with `close`.
    """

    name = "disk"   # the tier's name (the file is named by the `name` argument)

    def __init__(self, directory: str, page_size: int, head_dim: int, dtype: torch.dtype,
                 io_threads: int = 4, name: str = "pages") -> None:
        self._fd: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.path = os.path.join(directory, f"{name}.kvtp")
        if dtype not in _DTYPES:
            raise CapacityError(f"dtype {dtype} cannot be stored on disk; allowed: "
                                "torch.float32, torch.float16, torch.bfloat16, torch.float64")
        for name, size in (("page_size", page_size), ("head_dim", head_dim), ("io_threads", io_threads)):
            check_whole(name, size, 1)
        self.page_size, self.head_dim, self.dtype, self.io_threads = page_size, head_dim, dtype, io_threads
        self._kv_bytes = page_size * head_dim * torch.empty((), dtype=dtype).element_size()
        self.payload_size = 2 * self._kv_bytes
        self.record_size = -(-self.payload_size // ALIGN) * ALIGN
        self._meta = _SlotMeta()
        self._free: list[int] = []  # heap of freed slots below `_next`; slots >= `_next` were never handed out
        self._next = self._count = 0
        self._storing = 0   # stores between their slots' allocation and bookkeeping (their slots look free)
        try:
            self._fd = os.open(self.path, _FLAGS, 0o600)
        except OSError as e:
            what = "a symlink" if os.path.islink(self.path) else "something"
            why = (f"{what} already exists there; refusing to reuse or follow it"
                   if e.errno in (errno.EEXIST, errno.ELOOP) else _oserr(e))
            raise CapacityError(f"cannot create page file {self.path}: {why}") from e

    def _check_open(self) -> int:
        if self._fd is None:
            raise CorruptPageError(f"disk store {self.path} is closed")
        return self._fd

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="kvtier-disk")
            return self._pool

    def _check_used(self, slots: np.ndarray) -> np.ndarray:
        """What the store keeps of `slots` (`_META`); raises unless every slot holds a page (call with the lock
        held)."""
        bad = (slots < 0) | (slots >= self._next)
        if bad.any() or (bad := ~(meta := self._meta.get(slots))["used"]).any():
            raise CorruptPageError(f"slot {int(slots[np.flatnonzero(bad)[0]])} of {self.path} holds no page")
        return meta

    def _plan(self, slots: np.ndarray, cap: int, gap: int = 0) -> tuple[np.ndarray, np.ndarray, list]:
        """Sort `slots`; cut them into one task per thread, each a list of runs ``(lo, hi)`` of sorted
        positions (one syscall each) whose slots are consecutive, or (reads: `gap` > 0) at most `gap` records
        apart, the records between them read and dropped; a run spans at most `cap` records."""
        order = np.argsort(slots, kind="stable")
        s, n = slots[order], len(slots)
        step = max(-(-n // self.io_threads), -(-_MIN_TASK_BYTES // self.record_size))
        tasks = []
        for a in range(0, n, step):
            b = min(a + step, n)
            part = s[a:b]
            d = np.diff(part)
            apart = d > 1 + gap if gap else d != 1
            if part[-1] - part[0] >= cap:   # a run whose span passes `cap` records is cut where it does
                first = np.concatenate(([0], np.flatnonzero(apart) + 1))
                piece = (part - part[first][np.concatenate(([0], np.cumsum(apart)))]) // cap
                apart |= np.diff(piece) != 0
            cuts = (np.flatnonzero(apart) + (a + 1)).tolist()
            tasks.append(list(zip([a, *cuts], [*cuts, b])))
        return order, s, tasks

    def _run(self, fn, tasks: list) -> None:
        """Run ``fn(task)`` for each task (on the I/O threads if several); all finish before any error is raised.

        Interrupted (Ctrl-C), it returns only once no I/O thread reads or writes for it any more: the caller's
        rollback then frees slots and hands buffers back safely. No task starts its I/O before every task is
        submitted (a submit cut short by the interrupt leaves a task its caller never saw: it does nothing)."""
        if len(tasks) == 1:
            return fn(tasks[0])
        go, stop = threading.Event(), threading.Event()

        def gated(task) -> None:
            go.wait()
            if not stop.is_set():
                fn(task)

        futures: list = []
        try:
            for t in tasks:
                futures.append(self._executor().submit(gated, t))
            go.set()
            wait(futures)
        except BaseException:
            stop.set()
            go.set()
            for f in futures:
                f.cancel()
            _wait_through_interrupts(futures)
            raise
        for f in futures:
            f.result()

    def store(self, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
        """Write pages ``k, v`` ``[n, page_size, head_dim]`` (store's dtype, any device) to free slots, lowest
        first (the file grows by appending); returns their slots, int64 ``[n]``.

        Raises `CapacityError` on a wrong shape or dtype, a full disk, a file too large, any other write
        error or a short write. The store is then left as it was: the slots taken by this call are free
        again, no other slot's CRC or generation changed, and the pages stored before still load.
        """
        fd = self._check_open()
        P, D, kb, rs, pay = self.page_size, self.head_dim, self._kv_bytes, self.record_size, self.payload_size
        if k.dim() != 3 or tuple(k.shape[1:]) != (P, D) or k.shape != v.shape or {k.dtype, v.dtype} != {self.dtype}:
            raise CapacityError(f"{self.path} holds [n, {P}, {D}] {self.dtype} pages; got k {tuple(k.shape)} "
                                f"{k.dtype}, v {tuple(v.shape)} {v.dtype}")
        n = k.shape[0]
        if n == 0:
            return np.empty(0, np.int64)
        buf = np.empty((n, rs), np.uint8)  # record r = keys, values, zero padding
        buf[:, pay:] = 0
        for t, a in ((k, 0), (v, kb)):
            torch.from_numpy(buf)[:, a:a + kb].view(self.dtype).view(n, P, D).copy_(t.detach())
        taken = False   # set with `_storing`: from then on the `try` below gives the slots back whatever happens
        try:   # from the slots' allocation to their bookkeeping: a failure (or Ctrl-C) anywhere gives them back
            with self._lock:
                reused: list[int] = []
                try:
                    while len(reused) < n and self._free:
                        reused.append(heapq.heappop(self._free))
                    lo, hi = self._next, self._next + n - len(reused)
                    self._meta.grow(hi)
                    slots = np.array(reused + list(range(lo, hi)), dtype=np.int64)
                    gens = self._meta.get(slots)["gen"] + np.uint32(1)
                except BaseException:   # interrupted among the pops, or no memory: the slots taken go back
                    for slot in reused:
                        heapq.heappush(self._free, slot)
                    raise
                self._next = hi
                self._storing += 1
                taken = True
            crcs = np.empty(n, np.uint32)

            def write(runs: list) -> None:
                for a, b in runs:
                    idx = order[a:b]
                    for r in idx:
                        crcs[r] = zlib.crc32(buf[r, :pay], seeds[r])
                    try:
                        done = _transfer(os.pwritev, fd, [buf[r] for r in idx], int(s[a]) * rs)
                    except OSError as e:
                        kind = "disk full" if e.errno in _FULL else "could not write"
                        raise CapacityError(f"{kind}: writing {b - a} page(s) to {self.path} failed: "
                                            f"{_oserr(e)}") from e
                    if done != (b - a) * rs:
                        raise CapacityError(f"short write to {self.path}: {done} of {(b - a) * rs} bytes "
                                            "(disk full?)")

            seeds = [_seed(slot, gen) for slot, gen in zip(slots.tolist(), gens.tolist())]
            order, s, tasks = self._plan(slots, _IOV_MAX)
            self._run(write, tasks)
            with self._lock:
                count = self._count
                try:
                    self._meta.set(slots, crc=crcs, gen=gens, seed=seeds, used=True)
                    self._count = count + n
                except BaseException:   # interrupted between the two: the slots go back (below), uncounted
                    self._meta.set(slots, used=False)
                    self._count = count
                    raise
        except BaseException:
            if taken:
                with self._lock:
                    if not self._meta.get(slots)["used"].all():   # the bookkeeping was not made (else: kept)
                        self._give_back(fd, reused, lo, hi)
            raise
        finally:
            if taken:
                with self._lock:
                    self._storing -= 1
                    if not self._storing:   # a free meanwhile, or stores that failed while others wrote above them
                        self._trim_quietly(fd)
        return slots

    def _give_back(self, fd: int, reused: list[int], lo: int, hi: int) -> None:
        """Free the slots a failed `store` took: `reused` from the heap, ``lo..hi`` new ones (lock held)."""
        back = reused if self._next == hi else reused + list(range(lo, hi))
        if self._next == hi:  # nothing was allocated after us: give the file its old length back
            self._next = lo
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_size > lo * self.record_size:
                    os.ftruncate(fd, lo * self.record_size)
        for slot in back:
            heapq.heappush(self._free, slot)

    def free(self, slots: np.ndarray) -> None:
        """Give slots ``[m]`` back; their records can no longer be loaded and later `store` calls reuse them.
        Raises `CorruptPageError` (freeing nothing) if a slot holds no page or is given twice."""
        self._check_open()
        slots = slot_numbers(slots, f"slots of {self.path}", CorruptPageError)
        with self._lock:
            self._check_used(slots)
            if len(np.unique(slots)) != len(slots):
                raise CorruptPageError(f"a slot is freed twice in one call to {self.path}")
            count = self._count
            try:
                for slot in slots.tolist():
                    heapq.heappush(self._free, slot)
                self._meta.set(slots, used=False)
                self._count = count - len(slots)
            except BaseException:   # interrupted (Ctrl-C) or out of memory: every slot as it was
                gone = set(slots.tolist())
                self._free = [slot for slot in self._free if slot not in gone]
                heapq.heapify(self._free)
                self._meta.set(slots, used=True)
                self._count = count
                raise
            self._trim_quietly(self._check_open())

    def _trim_quietly(self, fd: int) -> None:
        """`_trim`, whose failure (no memory for the heap's copy) leaves the file as long as it was: what called it
        (a free, a store) is done, and a later one trims."""
        with contextlib.suppress(Exception):
            self._trim(fd)

    def _trim(self, fd: int) -> None:
        """Give the disk back the free slots at the file's end (lock held): a conversation read back from disk
        leaves its file as large as it was parked otherwise, until close. Not while a store writes (its slots
        look free until its bookkeeping is made). No read is under way there: the slots past the last one in use
        are free, and a slot's reads are waited for before it is freed. Skipped meanwhile, the last store trims."""
        if self._storing or not self._next or self._meta.get(np.array([self._next - 1]))["used"][0]:
            return
        end = 0
        for i in range((self._next - 1) // CHUNK, -1, -1):   # the last slot in use, a chunk at a time from the end
            used = np.flatnonzero(self._meta.chunks[i]["used"])
            if used.size:
                end = i * CHUNK + int(used[-1]) + 1
                break
        self._free = [slot for slot in self._free if slot < end]
        heapq.heapify(self._free)
        self._next = end
        with contextlib.suppress(OSError):   # a file left longer holds only free slots, rewritten when reused
            os.ftruncate(fd, end * self.record_size)

    def _start_read(self, slots: np.ndarray, out, rows: np.ndarray | None = None):
        """Check `slots` and plan their reads: ``(tasks, read, finish)``; ``finish()`` returns ``(k, v)``."""
        fd = self._check_open()
        slots = slot_numbers(slots, f"slots of {self.path}", CorruptPageError)
        n, P, D, kb, rs = len(slots), self.page_size, self.head_dim, self._kv_bytes, self.record_size
        with self._lock:
            meta = self._check_used(slots)
        m = n
        if rows is not None:   # page i goes to out[rows[i]]
            if out is None or len(out) != 2:
                raise CapacityError("rows needs out, the two tensors the pages are placed in")
            rows = slot_numbers(rows, f"rows of {self.path}", CorruptPageError)
            m = len(out[0])
            if len(rows) != n or (n and (rows.min() < 0 or rows.max() >= m)):
                raise CapacityError(f"rows must place each of the {n} pages in out; got {len(rows)} rows "
                                    f"for an out of {m} pages")
        if out is not None and (len(out) != 2 or any(tuple(t.shape) != (m, P, D) for t in out)):
            raise CapacityError(f"out must be two tensors [{m}, {P}, {D}]; got {[tuple(t.shape) for t in out]}")
        # (an empty tensor calls itself contiguous whatever its strides, which its byte view then refuses)
        direct = out is not None and all(t.device.type == "cpu" and t.dtype == self.dtype and t.is_contiguous()
                                         and t.numel() for t in out)
        kv = out if direct else [torch.empty((n, P, D), dtype=self.dtype) for _ in range(2)]
        placed, rows = rows, rows if direct else None   # read into `out` at `rows`, or in order, then placed
        kn, vn = (t.detach().view(torch.uint8).reshape(len(t), kb).numpy() for t in kv)  # the reads land in `kv`
        pay = self.payload_size
        order, s, tasks = self._plan(slots, _RUN_RECORDS, _READ_GAP)
        at, want, seeds = slots.tolist(), meta["crc"].tolist(), meta["seed"].tolist()

        def read(runs: list) -> None:
            # each run is one read into scratch (records whole, padding and gaps and all); a batch of runs is
            # checked, then copied out at once, so a bad page leaves its batch's pages in `kv` as they were
            for batch in _batches(runs, s, _SCRATCH_RECORDS):
                lo, hi = batch[0][0], batch[-1][1]
                ends = np.array(batch)
                firsts, sizes = s[ends[:, 0]], ends[:, 1] - ends[:, 0]
                spans = s[ends[:, 1] - 1] - firsts + 1
                bases = np.cumsum(spans) - spans
                scratch = np.empty((int(spans.sum()), rs), np.uint8)
                flat = memoryview(scratch).cast("B")
                for (a, b), first, span, base in zip(batch, firsts.tolist(), spans.tolist(), bases.tolist()):
                    try:
                        done = _pread_into(fd, flat[base * rs:(base + span) * rs], first * rs)
                    except OSError as e:
                        raise CorruptPageError(f"could not read slots {first}..{first + span - 1} of {self.path}: "
                                               f"{_oserr(e)}") from e
                    if done != span * rs:
                        raise self._truncated(fd, s[a:b], (first * rs + done) // rs)
                row = s[lo:hi] + np.repeat(bases - firsts, sizes)   # each page's record in scratch
                idx = order[lo:hi]
                for j, r in zip((row * rs).tolist(), idx.tolist()):
                    got = zlib.crc32(flat[j:j + pay], seeds[r])
                    if got != want[r]:
                        raise CorruptPageError(f"checksum mismatch in {self.path} at slot {at[r]}: "
                                               f"expected {want[r]:#010x}, read {got:#010x}")
                to = idx if rows is None else rows[idx]
                kn[to] = scratch[row, :kb]
                vn[to] = scratch[row, kb:pay]

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            if out is None or direct:
                return kv[0], kv[1]
            if placed is None:
                return out[0].copy_(kv[0]), out[1].copy_(kv[1])
            at = torch.from_numpy(placed).to(out[0].device)
            return out[0].index_copy_(0, at, kv[0].to(out[0])), out[1].index_copy_(0, at, kv[1].to(out[1]))

        return tasks, read, finish

    def _truncated(self, fd: int, wanted: np.ndarray, whole: int) -> CorruptPageError:
        """The error for a read that came back short: the first of the `wanted` slots (sorted) past the `whole`
        records the file holds from the read's start (a slot read only as a gap is none of the caller's)."""
        slot = int(wanted[min(int(np.searchsorted(wanted, whole)), len(wanted) - 1)])
        try:
            end = f"the file ends at byte {os.fstat(fd).st_size}"
        except OSError as e:
            end = f"its size unknown: {_oserr(e)}"
        return CorruptPageError(f"page missing or truncated in {self.path} at slot {slot} ({end})")

    def load(self, slots: np.ndarray, out: tuple[torch.Tensor, torch.Tensor] | None = None,
             rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Read pages back, verified, in the order of `slots` ``[n]``.

        Returns ``(k, v)``, each ``[n, page_size, head_dim]``: `out` when given (filled in place; read into
        directly when it is contiguous CPU memory of the store's dtype, e.g. pinned staging), else new CPU
        tensors of `dtype`. With `rows` ``[n]``, page ``i`` goes to ``out[rows[i]]`` instead (the other pages of
        `out` are left as they are). Raises `CorruptPageError` naming the file and slot when a slot holds no
        page, the file is short or unreadable, or a CRC does not match (`out` then holds garbage).
        """
        tasks, read, finish = self._start_read(slots, out, rows)
        self._run(read, tasks)
        return finish()

    def load_async(self, slots: np.ndarray, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                   cpu: list | None = None) -> Future:
        """`load` on one I/O thread, checks and planning included (the caller's thread only queues it), for
        reading ahead: a future of ``(k, v)`` or of the error. `out` must not be read or written until the
        future is done. The thread's CPU seconds for the read join `cpu`, where given."""
        slots = slot_numbers(slots, f"slots of {self.path}", CorruptPageError).copy()   # the caller may reuse its array
        self._check_open()

        def load() -> tuple[torch.Tensor, torch.Tensor]:
            t0 = time.thread_time()
            try:
                tasks, read, finish = self._start_read(slots, out)
                for task in tasks:   # in this thread: a task waiting for others on the same threads could starve
                    read(task)
                return finish()
            finally:
                if cpu is not None:
                    cpu.append(time.thread_time() - t0)

        return self._executor().submit(load)

    def drop_cached(self) -> None:
        """Write the file back and drop its pages from the operating system's page cache, so that the next
        reads come from the device (for measuring a cold disk; the data stays). Raises `CapacityError` where
        the system cannot drop them."""
        fd = self._check_open()
        if not hasattr(os, "posix_fadvise"):
            raise CapacityError("dropping the page file from the page cache needs posix_fadvise (Linux); "
                                "not available here")
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise CapacityError(f"could not drop {self.path} from the page cache: {_oserr(e)}") from e

    def pages(self) -> int:
        """Slots in use."""
        return self._count

    def nbytes(self) -> int:
        """``pages() * payload_size``."""
        return self._count * self.payload_size

    def file_bytes(self) -> int:
        """Size of the file on disk (0 once closed)."""
        return os.fstat(self._fd).st_size if self._fd is not None else 0

    def close(self) -> None:
        """Wait for in-flight I/O, stop the I/O threads, close and delete the file. Safe to call again."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True)
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            with contextlib.suppress(OSError):   # EIO from a network file system, say: the file goes anyway
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
