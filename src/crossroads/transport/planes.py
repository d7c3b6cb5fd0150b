"""Process-wide switches of the relay data plane, applied once at start.

The data plane's implementations are chosen per process (see
:mod:`crossroads.transport.dataplane`); this module holds the settings that
apply to all of them, so that the runtime has one call to make.
"""

from __future__ import annotations

import logging

log = logging.getLogger("crossroads.dataplane")


def set_udp_gso(enabled: bool) -> bool:
    """Turn UDP GSO on the C plane's sends on or off; False when there is no C plane."""
    try:
        from crossroads.transport import _turnfast
    except ImportError:  # pragma: no cover - built by `make install`
        return False
    _turnfast.set_gso(enabled)
    return True
