"""Many parked conversations within a host-memory budget; when it fills, the coldest go on to disk."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

from ..errors import CapacityError, ConfigError, call_each
from .hf import TieredCache


class SessionStore:
    """Parks caches by name, host memory first, least recently parked pushed to disk beyond `host_bytes`.

    Parameters
    ----------
    host_bytes
        Host memory the parked sessions may hold together: what their tiers allocated there (host pages' slabs
        whole, key codes, the parked device entries), their windows, and their reads ahead.
    disk_bytes
        Disk the parked sessions may hold together (their files); beyond it the coldest sessions holding disk are
        closed and their names listed in `dropped`. ``None``: no limit.
    """

    def __init__(self, host_bytes: int, disk_bytes: int | None = None) -> None:
        for name, value in (("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
            if value is None and name == "disk_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r}; allowed: a whole number of bytes >= 0")
        self.host_bytes, self.disk_bytes = host_bytes, disk_bytes
        self._parked: OrderedDict[str, TieredCache] = OrderedDict()
        self.dropped: list[str] = []
        self._dropped_under: dict[str, int] = {}   # the disk budget each name in `dropped` was closed under

    def park(self, name: str, cache: TieredCache) -> None:
        """Park `cache` under `name` in host memory, then push the coldest sessions to disk as needed (the reads
        ahead of parked sessions, coldest first, go before any session is pushed).

        A session already parked under `name` (another cache) is closed: the name now means `cache`, and leaves
        `dropped` if it was there. If pushing a
        session to disk fails, every session stays whole where it was (each park is all or nothing), `cache` is
        parked and kept, and a `CapacityError` says how far the host budget is exceeded. A session left broken
        cannot move and is passed over (it says why when resumed). Where `cache` alone holds more disk than
        `disk_bytes`, it is parked and kept, no other session is closed, and a `CapacityError` says so.
        """
        if not isinstance(cache, TieredCache):
            raise ConfigError(f"park({name!r}, ...) was given a {type(cache).__name__}; allowed: a TieredCache")
        other = next((n for n, c in self._parked.items() if c is cache and n != name), None)
        if other is not None:   # counted twice, and closed or pushed under one name while in use under the other
            raise ConfigError(f"this cache is parked already, as {other!r}; allowed: one name a cache (resume "
                              f"{other!r} first, or park it again under {other!r})")
        cache.park("host")
        replaced = self._parked.get(name)
        self._parked[name] = cache
        self._parked.move_to_end(name)
        if self._dropped_under.pop(name, None) is not None:   # the name means this session now, not the one closed
            with contextlib.suppress(ValueError):   # `dropped` is the caller's too: it may have been cleared
                self.dropped.remove(name)
        try:
            self._make_room(name)
        finally:
            if replaced is not None and replaced is not cache:   # the name's earlier session: nobody can reach it now
                replaced.close()

    def _make_room(self, name: str) -> None:
        """Past `host_bytes`, let the coldest sessions' reads ahead go, then push the coldest sessions holding host
        memory to disk; then close the coldest past `disk_bytes` (never `name`, just parked). Reads ahead go first:
        without them a session's return costs its restore, where a session pushed to disk costs a read of it all
        (and a session parked on the host whose new slabs are being filled ahead holds whole slabs meanwhile)."""
        for parked in list(self._parked.values()):   # coldest first
            if self.host_bytes_used() <= self.host_bytes:
                break
            if not parked.closed and parked.broken is None:
                parked._state.drop_reads()
        for other, parked in list(self._parked.items()):  # coldest first
            if self.host_bytes_used() <= self.host_bytes:
                break
            if parked.closed or parked.broken is not None:   # says why when resumed; it cannot move meanwhile
                continue
            if _host_bytes(parked):   # layers parked on the host (all, or those a failed restore had brought
                try:                  # back before the session was parked again), or reads ahead, which this drops
                    parked.park("disk")
                except CapacityError as e:
                    over = self.host_bytes_used() - self.host_bytes
                    raise CapacityError(f"session {name!r} is parked in host memory, but moving session {other!r} "
                                        f"to disk failed ({e}); the store is {over:,} bytes over its host budget "
                                        "until a later park or resume makes room") from e
        if self.disk_bytes is None or self.disk_bytes_used() <= self.disk_bytes:
            return
        mine = _disk_bytes(self._parked[name])
        if mine > self.disk_bytes:   # closing every other session would not bring the store within its budget
            raise CapacityError(f"session {name!r} is parked, but it holds {mine:,} bytes of disk, over the store's "
                                f"disk_bytes={self.disk_bytes:,} by itself; no other session was closed for it")
        for other, parked in list(self._parked.items()):   # coldest first, those holding disk only
            if self.disk_bytes_used() <= self.disk_bytes:
                break
            if other == name or not _disk_bytes(parked):   # closing it would free no disk
                continue
            self._parked.pop(other).close()
            self.dropped.append(other)
            self._dropped_under[other] = self.disk_bytes

    def resume(self, name: str) -> TieredCache:
        """Take a session back; its layers return to the device at its next step (or `resume()`). Layers parked on
        disk start being read back at once (`TieredCache.prefetch_parked`; on the host, their new host slabs filled),
        while the caller prepares the next turn."""
        cache = self._parked.pop(self._known(name))
        if not cache.closed and cache.broken is None:   # such a cache says why at its next use
            cache.prefetch_parked()
        return cache

    def prefetch(self, name: str) -> bool:
        """Start reading a session parked on disk back into host memory while it stays here (parked on the host:
        filling its layers' new host slabs; `TieredCache.prefetch_parked`): for a conversation about to come back,
        so that `resume` and its next step wait for less. The reads count in `host_bytes_used` until the session
        is resumed; parking it again, or a later park that must make room in host memory and comes to it, lets
        them go. Returns whether reads started."""
        return self._parked[self._known(name)].prefetch_parked()

    def _known(self, name: str) -> str:
        if name not in self._parked:
            why = (f" (a session {name!r} was closed to keep the parked sessions within disk_bytes="
                   f"{self._dropped_under[name]:,}: see `dropped`)" if name in self._dropped_under else "")
            raise KeyError(f"no parked session {name!r}{why}; parked: {', '.join(self._parked) or 'none'}")
        return name

    def host_bytes_used(self) -> int:
        """Host memory of the sessions parked there, and what the reads of sessions being prefetched hold."""
        return sum(_host_bytes(cache) for cache in self._parked.values())

    def disk_bytes_used(self) -> int:
        """Disk the parked sessions hold: their files (page files, free slots inside them included, parked layers'
        and windows' files)."""
        return sum(_disk_bytes(cache) for cache in self._parked.values())

    def where(self) -> dict[str, str | None]:
        """Each parked session and where it is."""
        return {name: cache.parked for name, cache in self._parked.items()}

    def close(self) -> None:
        """Close every parked session (each one, even where closing another failed; the first failure is raised)."""
        parked, self._parked = list(self._parked.values()), OrderedDict()
        call_each(cache.close for cache in parked)


def _host_bytes(cache: TieredCache) -> int:
    """Host memory a parked session holds: what its tiers allocated there (the slabs of its host pages and key codes,
    a copy of layers parked on the host: their entries, index and positions), its sliding-window layers parked
    there, and what reads ahead of its return hold."""
    stats = cache.stats()
    return stats["host"]["reserved_bytes"] + stats["window"]["bytes"] + stats["resume_prefetch"]["held_bytes"]


def _disk_bytes(cache: TieredCache) -> int:
    """Disk a parked session holds: its page file (free slots included, but for those at its end), its parked
    layers' files and its windows' files."""
    stats = cache.stats()
    return stats["disk"]["reserved_bytes"] + stats["window"]["disk_bytes"]
