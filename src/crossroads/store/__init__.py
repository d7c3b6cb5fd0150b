"""Shared state behind one small protocol: in memory by default, Redis to scale out."""

from crossroads.store.base import Store, Subscription, open_store

__all__ = ["Store", "Subscription", "open_store"]
