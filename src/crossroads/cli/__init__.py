"""The ``crossroads`` command."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

import crossroads
from crossroads.cli.loop import run_async
from crossroads.config import Config, build_config, flag_name, iter_settings, read_toml
from crossroads.errors import ConfigError
from crossroads.logs import configure_logging
from crossroads.services import load_service_modules
from crossroads.transport import reuseport as transport_sharing

F = TypeVar("F", bound=Callable[..., Any])


def _param_name(section: str, field_name: str) -> str:
    return f"cfg__{section}__{field_name}"


def config_options(command: F) -> F:
    """Add one option per configuration setting to a click command."""
    load_service_modules()
    for section, f, info in reversed(list(iter_settings())):
        flag = flag_name(section, f)
        name = _param_name(section, f.name)
        help_text = f"{info.help} [{section}.{f.name}; default: {f.default!r}]"
        if info.kind == "bool":
            negative = "--no-" + flag[2:]
            option = click.option(
                f"{flag}/{negative}", name, default=None, help=help_text
            )
        elif info.kind == "list":
            option = click.option(
                flag, name, multiple=True, default=None, help=help_text
            )
        else:
            option = click.option(flag, name, default=None, help=help_text)
        command = option(command)
    return command


def config_from_cli(config_file: Path | None, params: dict[str, Any]) -> Config:
    flags: dict[str, Any] = {}
    for section, f, info in iter_settings():
        value = params.get(_param_name(section, f.name))
        if value is None or (info.kind == "list" and not value):
            continue
        if info.kind == "list":
            # Repeated flags and comma-separated values both work.
            value = [part for item in value for part in item.split(",") if part]
        flags[f"{section}.{f.name}"] = value
    file_data = read_toml(config_file) if config_file else {}
    return build_config(
        flags=flags,
        file_data=file_data,
        file_name=str(config_file) if config_file else "config file",
    )


def fail(message: str) -> None:
    click.echo(f"crossroads: {message}", err=True)
    sys.exit(2)


@click.group()
@click.version_option(crossroads.__version__, prog_name="crossroads")
def main() -> None:
    """Connectivity for multiplayer games: STUN, TURN, game coordinator, NAT
    negotiation and relays, in one process."""


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="CROSSROADS_CONFIG",
    help="TOML configuration file.",
)
@config_options
def serve(config_file: Path | None, **params: Any) -> None:
    """Run the services (all by default; see --only)."""
    try:
        config = config_from_cli(config_file, params)
    except ConfigError as exc:
        fail(f"config error: {exc}")
        return
    from crossroads import workers
    from crossroads.runtime import serve_forever

    try:
        slot = workers.current_worker()
        configure_logging(
            config.core.log_level,
            config.core.log_format,
            None if slot is None else slot.index,
        )
        plan = workers.plan_workers(config)
        if slot is None:
            if plan.reason:
                workers.log.info("%s", plan.reason)
            if plan.count > 1:
                from crossroads.firstrun import prepare

                # Development credentials are created once, here, before the
                # workers read them (no race between N first runs).
                prepare(config)
                supervisor = workers.Supervisor(
                    plan,
                    workers.worker_command(),
                    os.environ,
                    drain_timeout=config.core.drain_timeout,
                )
                sys.exit(run_async(supervisor.run()))
        else:
            transport_sharing.share_listening_ports(True, slot.index, slot.count)
            transport_sharing.set_sibling_ports(
                workers.sibling_ports(config, slot.index, plan)
            )
            config = workers.worker_config(config, slot.index, plan)

        def reread() -> Config:
            fresh = config_from_cli(config_file, params)
            if slot is None:
                return fresh
            return workers.worker_config(fresh, slot.index, plan)

        run_async(serve_forever(config, reread=reread, worker=slot))
    except OSError as exc:
        fail(f"cannot start: {exc}")
    except ConfigError as exc:
        fail(f"config error: {exc}")


from crossroads.lab.cli import lab as _lab_group  # noqa: E402

main.add_command(_lab_group)

from crossroads.cli.stun import stun as _stun_group  # noqa: E402

main.add_command(_stun_group)

from crossroads.cli.p2p_chat import host as _p2p_host  # noqa: E402
from crossroads.cli.p2p_chat import join as _p2p_join  # noqa: E402

main.add_command(_p2p_host)
main.add_command(_p2p_join)

from crossroads.admincli import COMMANDS as _admin_commands  # noqa: E402
from crossroads.config_doc import config_reference as _config_reference  # noqa: E402

for _command in _admin_commands:
    main.add_command(_command)
main.add_command(_config_reference)
