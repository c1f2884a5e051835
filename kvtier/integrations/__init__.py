"""Integrations with inference frameworks (Hugging Face transformers today)."""

import transformers as _transformers

from .requirement import check_transformers

check_transformers(_transformers.__version__)
