"""Integrations with inference frameworks (Hugging Face transformers today)."""
