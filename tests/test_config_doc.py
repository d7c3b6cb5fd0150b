"""docs/configuration.md is what the code declares (every flag, variable, key)."""

from __future__ import annotations

from pathlib import Path

from crossroads.config import env_name, flag_name, iter_settings
from crossroads.config_doc import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_reference_matches_the_code() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: crossroads config-reference > "
        "docs/configuration.md"
    )


def test_every_setting_is_in_the_reference() -> None:
    text = render()
    for section, f, _info in iter_settings():
        key = f.name if section == "core" else f"{section}.{f.name}"
        assert f"`{key}`" in text
        assert f"`{env_name(section, f)}`" in text
        assert flag_name(section, f) in text
