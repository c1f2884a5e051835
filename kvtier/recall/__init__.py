"""Recall: per-page key bounds and codes (the page index), and the query-aware choice of pages to bring back."""

from .bounds import page_bounds, round_outward, upper_bounds
from .codes import decode as decode_codes
from .codes import encode as encode_codes
from .index import PageIndex
from .selector import grouped, page_shares, select_pages

__all__ = ["PageIndex", "decode_codes", "encode_codes", "page_bounds", "page_shares", "round_outward",
           "grouped", "select_pages", "upper_bounds"]
