"""docs/security.md's budget tables are what a full ``crossroads serve``
registers: every table, its derived caps at ``ulimit -n`` 1,024 and 65,536.

Regenerate with ``CROSSROADS_UPDATE_DOCS=1 pytest tests/test_budget_doc.py``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from crossroads.admincli import render_budget
from crossroads.config import default_config
from crossroads.runtime import start
from crossroads.transport.admission import MAX_DEFAULT_MEMORY_BUDGET
from crossroads.transport.tls import development_certificate
from tests.conftest import free_port, free_udp_tcp_port, loopback_config

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"
BLOCK = re.compile(r"(<!-- budget-table -->\n).*?(<!-- /budget-table -->)", re.S)
#: The descriptor limits the table is printed for: a distribution's default
#: soft limit, and a typical server's.
LIMITS = (1024, 65_536)


def full_config_values(directory: Path) -> dict[str, object]:
    """Every service on, TLS, DTLS and the relay WebSocket too: the largest
    set of listeners ``crossroads serve`` can have on one host."""
    cert, key = development_certificate(directory)
    return {
        "core__tls_cert": str(cert),
        "core__tls_key": str(key),
        "core__https_port": free_port(),
        "turn__tls_port": free_udp_tcp_port(),
        "relay__dtls": True,
        "relay__websocket": True,
    }


async def rendered(directory: Path) -> str:
    runtime = await start(
        default_config(loopback_config(**full_config_values(directory)))
    )
    try:
        budget = runtime.resources
        parts = []
        for limit in LIMITS:
            budget.fd_limit = limit
            budget.memory = MAX_DEFAULT_MEMORY_BUDGET
            parts.append(
                f"At `ulimit -n {limit:,}`:\n\n"
                + render_budget(budget.snapshot(), markdown=True, ports=False)
            )
        return "\n\n".join(parts) + "\n"
    finally:
        await runtime.close()


async def test_the_budget_tables_in_security_md_are_what_serve_registers(
    tmp_path: Path,
) -> None:
    text = DOC.read_text()
    match = BLOCK.search(text)
    assert match is not None, "docs/security.md lost its budget-table markers"
    fresh = await rendered(tmp_path)
    if os.environ.get("CROSSROADS_UPDATE_DOCS"):
        DOC.write_text(text[: match.end(1)] + fresh + text[match.start(2) :])
        return
    assert text[match.end(1) : match.start(2)] == fresh, (
        "docs/security.md budget tables are stale: "
        "CROSSROADS_UPDATE_DOCS=1 pytest tests/test_budget_doc.py"
    )


async def test_every_service_gives_its_tables_back_when_it_stops(
    tmp_path: Path,
) -> None:
    """A stopped service's tables leave the budget (their shares go back to
    the others); only the runtime's own HTTP and HTTPS tables stay."""
    runtime = await start(
        default_config(loopback_config(**full_config_values(tmp_path)))
    )
    registered = set(runtime.resources.admissions)
    await runtime.close()
    left = set(runtime.resources.admissions)
    assert left == {"http", "https", "tls-connections:https", "tls-handshakes:https"}
    assert len(registered) > 20, registered
