"""Device communicators: one per device kind, plus all-reduce and all2all back ends."""

from __future__ import annotations

from .errors import NotSupportedError

__all__ = ["NotSupportedError"]
