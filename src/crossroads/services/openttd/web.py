"""HTTP views of the OpenTTD server list.

- ``GET /openttd/servers``: JSON array of the public servers (public, reachable,
  with game info), as the coordinator lists them to OpenTTD clients.
- ``GET /openttd/servers/{invite_code}``: one server's record, public or
  invite-only (knowing the code is what invite-only means).
- ``GET /openttd``: the same list as a plain HTML page.
"""

from __future__ import annotations

import html
import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse

from crossroads.proto.openttd.record import ServerRecord
from crossroads.transport.httpapi import ApiError

LANDSCAPES = ("temperate", "arctic", "tropic", "toyland")


def _days_to_year(days: int) -> int:
    # Days since year 0 in OpenTTD's proleptic calendar: 365.2425 days a year.
    return int(days / 365.2425)


def make_router(
    all_records: Callable[[], Awaitable[list[ServerRecord]]],
    one_record: Callable[[str], Awaitable[ServerRecord | None]],
) -> APIRouter:
    router = APIRouter(prefix="/openttd", tags=["openttd"])

    @router.get("/servers")
    async def list_servers() -> JSONResponse:
        records = [r for r in await all_records() if r.public]
        return JSONResponse([r.to_api() for r in records])

    @router.get("/servers/{invite_code}")
    async def get_server(invite_code: str) -> JSONResponse:
        record = await one_record(invite_code)
        if record is None:
            raise ApiError(
                404, "not_found", f"no server with invite code {invite_code}"
            )
        return JSONResponse(record.to_api())

    @router.get("", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        records = [r for r in await all_records() if r.public]
        rows = []
        for r in records:
            info = r.info
            assert info is not None
            rows.append(
                "<tr>"
                f"<td>{html.escape(info.server_name)}</td>"
                f"<td><code>{html.escape(r.code)}</code></td>"
                f"<td>{html.escape(info.server_revision)}</td>"
                f"<td>{info.clients_on}/{info.clients_max}</td>"
                f"<td>{info.companies_on}/{info.companies_max}</td>"
                f"<td>{info.map_width}&times;{info.map_height} "
                f"{LANDSCAPES[info.landscape] if info.landscape < 4 else '?'}</td>"
                f"<td>{_days_to_year(info.game_date)}</td>"
                f"<td>{'yes' if info.use_password else 'no'}</td>"
                f"<td>{len(info.newgrfs)}</td>"
                f"<td>{r.to_api()['connection_type']}</td>"
                "</tr>"
            )
        body = "\n".join(rows) or '<tr><td colspan="10">No public servers.</td></tr>'
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        page_html = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>OpenTTD servers</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}</style></head>
<body><h1>OpenTTD servers</h1>
<p>{len(records)} public server(s), {stamp}. Join one from OpenTTD with its invite code
(Multiplayer &rarr; Join with invite code), or <code>openttd -n +CODE</code>.</p>
<table><tr><th>Name</th><th>Invite code</th><th>Version</th><th>Clients</th>
<th>Companies</th><th>Map</th><th>Year</th><th>Password</th><th>NewGRFs</th>
<th>Connection</th></tr>
{body}
</table></body></html>"""
        return HTMLResponse(page_html)

    return router
