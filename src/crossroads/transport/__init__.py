"""Thin asyncio adapters between sockets and the sans-I/O cores in ``proto/``."""
