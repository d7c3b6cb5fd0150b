"""What every HTTP router shares: the JSON error and the client-error log line.

Services define the routers of their own HTTP APIs (the relay allocations
API, OpenTTD's server list, MasterServer2) and the web app serves them with
its own pages; neither imports the other (tests/test_imports.py), so what both
need lives here, below them.
"""

from __future__ import annotations

import logging
import time

from fastapi import Request

log = logging.getLogger("crossroads.http")


class ApiError(Exception):
    """An HTTP error with the JSON body ``{"code": ..., "message": ...}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


#: Client-error log lines per second; beyond it lines are counted and the count
#: is logged with the next line, so a flood of bad requests cannot flood the log.
CLIENT_ERROR_LINES_PER_SECOND = 10
_client_error_window = [0.0, 0.0, 0.0]  # window start, lines in it, suppressed


def log_client_error(request: Request, status: int, message: str) -> None:
    """One log line (no traceback) for a request refused as the client's fault."""
    now = time.monotonic()
    window = _client_error_window
    if now - window[0] >= 1.0:
        window[0], window[1] = now, 0.0
    if window[1] >= CLIENT_ERROR_LINES_PER_SECOND:
        window[2] += 1
        return
    window[1] += 1
    suppressed, window[2] = int(window[2]), 0.0
    client = request.client.host if request.client else "?"
    log.info(
        "%s %s from %s: %d %s%s",
        request.method,
        request.url.path,
        client,
        status,
        message[:200],
        f" ({suppressed} similar lines suppressed)" if suppressed else "",
    )
