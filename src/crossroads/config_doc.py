"""docs/configuration.md, generated from the settings declared with
:func:`crossroads.config.setting` (one table per section: flag, environment
variable, TOML key, default, help). ``tests/test_config_doc.py`` checks that the
checked-in file matches; regenerate with ``crossroads config-reference >
docs/configuration.md``."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from crossroads.config import env_name, flag_name, iter_settings
from crossroads.services import load_service_modules

HEADER = """# Configuration reference

Generated from the code by `crossroads config-reference` (do not edit by hand;
`tests/test_config_doc.py` fails when this file and the code disagree).

Every setting has three forms; the strongest given wins: command-line flag >
`CROSSROADS_*` environment variable > TOML file (`--config FILE`) > default.
Core settings are top-level TOML keys; a service's settings live in its table
(`[turn]`, `[relay]`, ...). Boolean flags also have a `--no-` form; list
settings take a comma-separated string in flags and environment variables, or
repeated flags, or a TOML array.
"""


def _default(value: Any, kind: str) -> str:
    if kind == "bool":
        return "on" if value else "off"
    if kind == "port_range" and isinstance(value, tuple):
        return f"{value[0]}-{value[1]}"
    if isinstance(value, tuple):
        return ", ".join(str(v) for v in value) if value else "none"
    if value == "":
        return "none"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole Markdown document."""
    load_service_modules()
    lines = [HEADER]
    section = None
    for name, f, info in iter_settings():
        if name != section:
            section = name
            title = "Core (top-level keys)" if name == "core" else f"`[{name}]`"
            lines += [
                f"## {title}",
                "",
                "| flag | environment | TOML | default | meaning |",
                "|---|---|---|---|---|",
            ]
        flag = flag_name(name, f)
        if info.kind == "bool":
            flag = f"{flag} / --no-{flag[2:]}"
        key = f.name if name == "core" else f"{name}.{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else ""
        lines.append(
            f"| `{flag}` | `{env_name(name, f)}` | `{key}` | "
            f"{_cell(_default(default, info.kind))} | {_cell(info.help)} |"
        )
    lines.append("")
    out: list[str] = []
    for line in lines:
        # A blank line after each table, before the next heading.
        if line.startswith("## ") and out and out[-1] != "":
            out.append("")
        out.append(line)
    return "\n".join(out)


@click.command("config-reference")
def config_reference() -> None:
    """Print docs/configuration.md (every flag, variable and TOML key)."""
    click.echo(render(), nl=False)
