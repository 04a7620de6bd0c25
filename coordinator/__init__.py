"""GroupCoordinator, parallel state and the groupcoord command line."""

from __future__ import annotations

from .errors import AlreadyInitializedError, NotInitializedError

__all__ = ["AlreadyInitializedError", "NotInitializedError"]
