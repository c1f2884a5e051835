"""2-bit key codes inside each page's bounds: a compact copy of every demoted key, kept on the device.

Each channel of a page is quantized to 4 levels between that page's per-channel key minimum and maximum
(per-channel groups, as KIVI does for keys, arXiv 2402.02750; the group is the page). Recall reads these
codes, never the host, to estimate how much attention each page would get: a far better guide than the
bounds alone, which only say what the single best key of a page could score.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F

from ..native.layout import CODE_LEVELS, CODES_PER_BYTE, pack_codes

LEVELS = CODE_LEVELS        # codes 0..3
PER_BYTE = CODES_PER_BYTE    # 2 bits each
_SHIFTS = (0, 2, 4, 6)


def code_width(dim: int) -> int:
    """Bytes of codes per key (4 channels a byte)."""
    return -(-dim // PER_BYTE)


def _step(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return ((hi.float() - lo.float()) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)


def encode(k_pages: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Codes of ``k_pages`` ``[..., page, dim]`` within ``lo, hi`` ``[..., dim]``: uint8 ``[..., page, ceil(dim/4)]``."""
    c = ((k_pages.float() - lo.float()[..., None, :]) / _step(lo, hi)[..., None, :]).round_().clamp_(0, LEVELS)
    return pack_codes(c.to(torch.uint8))


_TABLES: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    """byte -> its 4 codes as floats ``[256, 4]``: one lookup unpacks a byte (cheaper than shifts and masks)."""
    if device not in _TABLES:
        _TABLES[device] = _on(torch.tensor([[(b >> s) & LEVELS for s in _SHIFTS] for b in range(256)],
                                           dtype=torch.float32), device)
    return _TABLES[device]


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host-made table on `device`, copied from pinned memory without a wait on CUDA."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def decode(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Approximate keys ``[..., page, dim]`` float32 from `encode`'s codes and the same bounds."""
    dim = lo.shape[-1]
    c = F.embedding(codes.long(), _table(codes.device)).view(*codes.shape[:-1], -1)[..., :dim]
    return torch.addcmul(lo.float()[..., None, :], c, _step(lo, hi)[..., None, :])


_ORDERS: dict[tuple[int, torch.device], torch.Tensor] = {}
_WORD_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpacked(codes: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The codes of ``[..., dim/4]`` bytes as floats ``[..., dim]``, and the channel order they come in
    (None for the natural one): the cheapest unpacking for the device, measured.

    On the CPU numpy's row lookup in the byte table (natural order) takes a third of the word shifts' time,
    and spares the caller its permutation; elsewhere the word shifts (`shifted_words`) win over the lookup.
    """
    if codes.device.type == "cpu":
        table = _table(codes.device).numpy()
        c = torch.from_numpy(np.take(table, codes.numpy(), axis=0)).view(*codes.shape[:-1], -1)[..., :dim]
        return c, None
    if dim % 16 or sys.byteorder != "little" or not codes.is_contiguous():
        c = F.embedding(codes.long(), _table(codes.device)).view(*codes.shape[:-1], -1)[..., :dim]
        return c, None
    return shifted_words(codes, dim)


def shifted_words(codes: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`unpacked` by shifts of 32-bit words (contiguous codes, `dim` a multiple of 16, a little-endian host).

    With 16 channels to a word, four shifts and masks of the words unpack every code at once, but leave the
    channels of a word in the order ``4 * byte + shift``; the returned order (channel of each column) lets
    the caller permute its other operand instead of the codes.
    """
    words = codes.view(torch.int32)
    key = (dim, codes.device)
    if key not in _ORDERS:
        _ORDERS[key] = _on(torch.tensor([16 * g + 4 * b + j for g in range(dim // 16) for j in range(4)
                                         for b in range(4)]), codes.device)
        _WORD_SHIFTS[codes.device] = _on(torch.tensor([2 * j for j in range(PER_BYTE)], dtype=torch.int32),
                                         codes.device)
    c = (words[..., None] >> _WORD_SHIFTS[codes.device]).bitwise_and_(0x03030303)   # every shift in one op
    return c.view(torch.uint8).view(*codes.shape[:-1], dim).float(), _ORDERS[key]


def step(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The value of one code level per channel: ``[..., dim]`` float32."""
    return _step(lo, hi)
