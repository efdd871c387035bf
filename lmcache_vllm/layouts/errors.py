"""The errors of the layouts package, apart so that modules the base layout builds on (`kernel_check`) can
raise them without importing the base layout back."""
from __future__ import annotations


class LayoutError(ValueError):
    """A KV cache, chunk or slot mapping does not fit the layout it is used with."""


class UnsupportedLayoutError(LayoutError):
    """`detect_layout` found a KV cache layout no adapter handles."""
