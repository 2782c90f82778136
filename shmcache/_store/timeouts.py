"""The ``timeout=`` a caller leaves out: a value of its own, so that the module functions
can name it as a default without importing the lock machinery (the open path of a fresh
process loads none of it)."""

from __future__ import annotations

from enum import Enum

__all__ = ["STORE_TIMEOUT", "StoreTimeout"]


class StoreTimeout(Enum):
    """``timeout=`` left out of ``cache()``: use the store's ``lock_timeout``."""

    STORE = "the store's lock_timeout"


STORE_TIMEOUT = StoreTimeout.STORE
