from __future__ import annotations

from crossroads.client.openttd import GameInfoResponder
from crossroads.proto.openttd.gameinfo import GameInfo
from crossroads.runtime import Runtime
from tests.services.openttd.helpers import http_get, register, until_listed, update


async def test_unknown_code_is_a_json_404(ottd: Runtime) -> None:
    response = await http_get(ottd, "/openttd/servers/+nothere")
    assert response.status_code == 404
    assert response.json()["code"] == "not_found"


async def test_empty_list(ottd: Runtime) -> None:
    assert (await http_get(ottd, "/openttd/servers")).json() == []
    page = await http_get(ottd, "/openttd")
    assert page.headers["content-type"].startswith("text/html")
    assert "No public servers" in page.text


async def test_page_escapes_server_names(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    server = await register(ottd, game_server.port)
    try:
        await update(
            server, GameInfo(server_name="<script>x</script>", server_revision="13.0")
        )
        await until_listed(ottd, "<script>x</script>")
        page = (await http_get(ottd, "/openttd")).text
        assert "<script>x" not in page
        assert "&lt;script&gt;x&lt;/script&gt;" in page
        [entry] = (await http_get(ottd, "/openttd/servers")).json()
        assert entry["info"]["server_name"] == "<script>x</script>"
        assert entry["connection_type"] == "direct"
    finally:
        await server.close()
