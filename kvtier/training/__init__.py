"""Traces and KVP training. The engine never imports this package."""
