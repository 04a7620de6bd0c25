"""``groupcoord demo``: the launcher (``launch``), one rank's work (``rank``), the
sharded model (``model``) and the per-step report (``report``)."""

from __future__ import annotations

from .launch import main

__all__ = ["main"]
