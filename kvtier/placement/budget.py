"""Budgets: how many tokens of one KV head a tier may hold, given how many tokens were seen."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..errors import ConfigError

MAX_TOKENS = 2**40   # a token budget above this (about 10^12 tokens per KV head) is a mistake, not a setting


@dataclass(frozen=True)
class Budget:
    """A per-KV-head token budget.

    Parameters
    ----------
    value
        A float in (0, 1] is a fraction of the tokens seen so far; an int is an absolute token count.
    name
        The keyword the user set (used in error messages).
    allow_zero
        Whether 0 (hold nothing) is allowed: true for the host tier, false for the device tier.
    """

    value: float | int
    name: str = "budget"
    allow_zero: bool = False

    def __post_init__(self) -> None:
        v = self.value
        allowed = (f"a fraction in {'[0, 1]' if self.allow_zero else '(0, 1]'} of the tokens seen, "
                   f"or a whole number of tokens >= {0 if self.allow_zero else 1}")
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ConfigError(f"{self.name}={v!r} is not a number; allowed: {allowed}")
        if isinstance(v, numbers.Integral):
            if v < 0 or (v == 0 and not self.allow_zero) or v > MAX_TOKENS:
                raise ConfigError(f"{self.name}={v!r} is out of range; allowed: {allowed} (at most "
                                  f"{MAX_TOKENS:,} tokens)")
            object.__setattr__(self, "value", int(v))
            return
        v = float(v)
        if math.isnan(v) or v < 0.0 or v > 1.0 or (v == 0.0 and not self.allow_zero):
            raise ConfigError(f"{self.name}={self.value!r} is out of range; allowed: {allowed}")
        object.__setattr__(self, "value", v)

    @property
    def is_fraction(self) -> bool:
        return isinstance(self.value, float)

    def tokens(self, seen: int) -> int:
        """The budget in tokens once `seen` tokens have been written."""
        if self.is_fraction:
            return min(seen, ceil_share(self.value, seen))
        return int(self.value)


def ceil_share(fraction: float, n: int) -> int:
    """`fraction` of `n`, rounded up; a product a rounding error away from a whole number is that number (7% of 100
    is 7 tokens, where the float product 7.000000000000001 rounded up is 8), and a share above 0 is a token at
    least.

    The rounding error allowed is a few units in the last place of the product: the fraction's own (0.07 is not
    7/100 exactly) and the product's. A margin of 1e-9 of the product had taken half of an odd count above 10^9
    tokens down, and a fraction below 1e-9 of a few tokens to none."""
    share = fraction * n
    if share <= 0:
        return 0
    whole = round(share)
    if whole >= 1 and abs(share - whole) <= 4 * math.ulp(share):
        return int(whole)
    return math.ceil(share)
