"""``crossroads lab``: build the NAT lab, run commands in it, run the matrix."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from crossroads.lab.kinds import KINDS, KINDS_BY_NAME
from crossroads.lab.topology import SERVER_IPS, Lab, LabError

if TYPE_CHECKING:
    from crossroads.lab.matrix import Result

PREFIX_HELP = "Name prefix of the lab's namespaces (several labs can coexist)."


def _lab(prefix: str) -> Lab:
    try:
        return Lab(prefix)
    except LabError as exc:
        raise click.ClickException(str(exc)) from exc


@click.group()
def lab() -> None:
    """The NAT lab: every RFC 4787 NAT kind in network namespaces (needs root)."""


@lab.command()
@click.option(
    "--prefix", default="xr", envvar="CROSSROADS_LAB_PREFIX", help=PREFIX_HELP
)
def up(prefix: str) -> None:
    """Build the lab (idempotent: a complete lab is left as it is)."""
    the_lab = _lab(prefix)
    started = time.monotonic()
    try:
        built = asyncio.run(the_lab.up())
    except LabError as exc:
        raise click.ClickException(str(exc)) from exc
    if not built:
        click.echo(f"lab {prefix} is already up")
        return
    click.echo(f"lab {prefix} up in {time.monotonic() - started:.1f} s")
    click.echo(f"  server {the_lab.server_ns}: {', '.join(SERVER_IPS)}")
    for site in the_lab.sites:
        click.echo(
            f"  {site.name:<24} host {site.host_ip:<15} public {site.public_ip}"
            f"  ({site.kind.summary})"
        )


@lab.command()
@click.option(
    "--prefix", default="xr", envvar="CROSSROADS_LAB_PREFIX", help=PREFIX_HELP
)
def down(prefix: str) -> None:
    """Stop every lab process and delete every lab namespace."""
    asyncio.run(_lab(prefix).down())
    click.echo(f"lab {prefix} is down")


@lab.command(
    "exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--prefix", default="xr", envvar="CROSSROADS_LAB_PREFIX", help=PREFIX_HELP
)
@click.argument("where")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(prefix: str, where: str, argv: tuple[str, ...]) -> None:
    """Run a command in a lab namespace: a kind (its host a), a site
    (full-cone-b), SITE-router, SITE-cgn, server or inet.

    Example: crossroads lab exec symmetric-random -- ip -4 addr
    """
    the_lab = _lab(prefix)
    try:
        ns = the_lab.resolve(where)
    except LabError as exc:
        raise click.ClickException(str(exc)) from exc
    if not the_lab.is_up():
        raise click.ClickException(f"lab {prefix} is not up (crossroads lab up)")
    command = list(argv[1:] if argv and argv[0] == "--" else argv)
    if not command:
        raise click.UsageError("no command given")
    os.execvp("ip", ["ip", "netns", "exec", ns, *command])


@lab.command()
@click.option(
    "--prefix", default="xr", envvar="CROSSROADS_LAB_PREFIX", help=PREFIX_HELP
)
def probe(prefix: str) -> None:
    """Measure every site's mapping, filtering and hairpinning (RFC 5780 style)."""
    from crossroads.lab.probe import Reflector, measure

    the_lab = _lab(prefix)

    async def main() -> int:
        built = await the_lab.up()
        bad = 0
        try:
            async with Reflector(the_lab) as reflector:
                for site in the_lab.sites:
                    got = await measure(the_lab, site, reflector)
                    k = site.kind
                    want = (k.udp, k.mapping, k.filtering, k.allocation, k.hairpin)
                    have = (
                        got.udp,
                        got.mapping,
                        got.filtering,
                        got.allocation,
                        got.hairpin,
                    )
                    ok = want == have or (not k.udp and not got.udp)
                    bad += not ok
                    click.echo(
                        f"{site.name:<24} {'ok ' if ok else 'BAD'} udp={got.udp} "
                        f"mapping={got.mapping} filtering={got.filtering} "
                        f"allocation={got.allocation} hairpin={got.hairpin}"
                    )
        finally:
            if built:
                await the_lab.down()
        return bad

    sys.exit(1 if asyncio.run(main()) else 0)


@lab.command()
@click.option(
    "--prefix", default="xr", envvar="CROSSROADS_LAB_PREFIX", help=PREFIX_HELP
)
@click.option(
    "--methods",
    default="",
    help="Comma-separated methods (default: all). A method named here runs every "
    "pair; by default slow ones (openttd) run a representative subset.",
)
@click.option("--kinds", default="", help="Comma-separated NAT kinds (default: all).")
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Directory for nat-matrix.md and nat-matrix.json (default: the "
    "results folder of the state directory, <state dir>/results, which the web "
    "console shows).",
)
@click.option(
    "--markdown",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also copy the Markdown table here (e.g. docs/nat-matrix.md to "
    "update the documentation on purpose).",
)
@click.option("--parallel", default=8, show_default=True, help="Attempts at once.")
@click.option(
    "--delay",
    default="",
    help="MIN-MAX milliseconds: each attempt's paths server-a, server-b and a-b get "
    "a one-way delay drawn uniformly from it (lab delay lines; e.g. 20-80).",
)
@click.option("--seed", default=1, show_default=True, help="Seed of the delays.")
@click.option(
    "--back-to-back",
    is_flag=True,
    help="Every cell one after another, no pause, all with one cookie (--cookie), "
    "as the SDK test program is run; default: attempts in parallel, each game "
    "with a random cookie.",
)
@click.option(
    "--cookie",
    default=666,
    show_default=True,
    help="The natneg cookie of a --back-to-back run (the SDK test program's).",
)
def matrix(
    prefix: str,
    methods: str,
    kinds: str,
    out: Path | None,
    markdown: Path | None,
    parallel: int,
    delay: str,
    seed: int,
    back_to_back: bool,
    cookie: int,
) -> None:
    """Run every pair of NAT kinds through each method; print, write the table."""
    from crossroads.lab.matrix import (
        load_methods,
        progress_line,
        run_matrix,
        to_markdown,
        unexpected,
    )

    registry = load_methods()
    names = [m for m in methods.split(",") if m] or list(registry)
    unknown = [m for m in names if m not in registry]
    if unknown:
        raise click.ClickException(
            f"unknown method(s) {', '.join(unknown)}; known: {', '.join(registry)}"
        )
    kind_names = [k for k in kinds.split(",") if k] or [k.name for k in KINDS]
    bad_kinds = [k for k in kind_names if k not in KINDS_BY_NAME]
    if bad_kinds:
        raise click.ClickException(f"unknown kind(s) {', '.join(bad_kinds)}")
    chosen = [KINDS_BY_NAME[k] for k in kind_names]
    delay_range: tuple[float, float] | None = None
    if delay:
        try:
            low, high = (float(part) / 1000 for part in delay.split("-", 1))
        except ValueError:
            raise click.ClickException(f"--delay {delay!r}: want MIN-MAX ms") from None
        if not 0 <= low <= high:
            raise click.ClickException(f"--delay {delay!r}: want 0 <= MIN <= MAX")
        delay_range = (low, high)
    the_lab = _lab(prefix)

    def progress(result: object, done: int, total: int) -> None:
        click.echo(progress_line(result, done, total))  # type: ignore[arg-type]

    async def main() -> list[object]:
        built = await the_lab.up()
        try:
            return list(
                await run_matrix(
                    the_lab,
                    [registry[n] for n in names],
                    kinds=chosen,
                    parallel=parallel,
                    progress=progress,
                    all_pairs=[m for m in methods.split(",") if m],
                    delay=delay_range,
                    seed=seed,
                    back_to_back=back_to_back,
                    cookie=cookie,
                )
            )
        finally:
            if built:
                await the_lab.down()

    started = time.monotonic()
    try:
        results = asyncio.run(main())
    except LabError as exc:
        raise click.ClickException(str(exc)) from exc
    wall = time.monotonic() - started
    from crossroads.lab.matrix import Result

    typed = [r for r in results if isinstance(r, Result)]
    command = "crossroads lab matrix" + (
        f" --methods {','.join(names)}" if methods else ""
    )
    if kinds:
        command += f" --kinds {','.join(kind_names)}"
    if delay:
        command += f" --delay {delay} --seed {seed}"
    if back_to_back:
        command += " --back-to-back" + (f" --cookie {cookie}" if cookie != 666 else "")
    written = write_results(
        typed,
        out if out is not None else default_results_dir(),
        markdown,
        to_markdown(typed, command=command, wall=wall),
    )
    wrong = unexpected(typed)
    for name in names:
        rows = [r for r in typed if r.method == name]
        ok = sum(r.connected for r in rows)
        click.echo(f"{name:<12} {ok}/{len(rows)} connected")
    click.echo(f"wrote {', '.join(map(str, written))} in {wall:.0f} s")
    if wrong:
        click.echo(f"{len(wrong)} outcome(s) differ from the prediction:", err=True)
        for r in wrong:
            click.echo(
                f"  {r.method} {r.a} <-> {r.b}: connected={r.connected} {r.detail}",
                err=True,
            )
        sys.exit(1)


def default_results_dir() -> Path:
    """``<state dir>/results`` (``CROSSROADS_STATE_DIR`` or the XDG default):
    never the checkout the command runs in."""
    from crossroads.state import resolve_state_dir, results_dir

    return results_dir(resolve_state_dir(os.environ.get("CROSSROADS_STATE_DIR", "")))


def write_results(
    results: list[Result], out: Path, markdown: Path | None, table: str
) -> list[Path]:
    """Write ``nat-matrix.md`` and ``nat-matrix.json`` in ``out`` (and the
    table to ``markdown`` when given); return the files written."""
    from crossroads.state import MATRIX_FILE

    out.mkdir(parents=True, exist_ok=True)
    table_path = out / MATRIX_FILE
    json_path = table_path.with_suffix(".json")
    table_path.write_text(table)
    json_path.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    written = [table_path, json_path]
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(table)
        written.append(markdown)
    return written


__all__ = ["lab"]
