"""A first run that works: development credentials when none are given.

Theory of operation. ``crossroads serve`` calls :func:`prepare` on the validated
configuration before anything binds:

1. The state directory's ``credentials.json`` is read, or created once
   (:mod:`crossroads.state`): a TURN shared secret, a relay API key, an admin token.
2. If a service that needs credentials runs without any — TURN with no
   ``--turn-secret``/``--turn-user``/``--turn-users-file`` (and not
   ``--turn-allow-unauthenticated``), the relay allocations API with no
   ``--api-key`` — the stored development one is filled in. This is *development
   mode*: the server then also accepts loopback peers for clients on this
   machine's loopback (TURN; a remote client still gets 403) and loopback/private
   clients (relay), because without a public address the addresses it hands out
   are this machine's own (127.0.0.1 or a LAN address), and the printed test
   command could not work otherwise. The secrets are random and known only to
   whoever reads the console output or the 0600 state file.
3. If the server is reachable from the Internet — ``--public-host``,
   ``--host``, ``--turn-external-ip`` or ``--relay-public-host`` names a global
   address (RFC 6890 "Globally Reachable") — development mode is refused: start-up
   fails with a message naming the flags to add. Production needs real
   credentials, and never the loopback relaxations.

Explicit credentials always win; nothing in the configuration the operator gave
is replaced.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import shlex
from collections.abc import Mapping
from pathlib import Path

from crossroads.config import Config
from crossroads.errors import ConfigError
from crossroads.services.relay import Config as RelayConfig
from crossroads.services.turn import Config as TurnConfig
from crossroads.state import LocalCredentials, load_or_create_credentials
from crossroads.state import resolve_state_dir as _resolve_state_dir
from crossroads.types import Address, frozen

log = logging.getLogger("crossroads")

#: The TURN user name the printed test command asks uclient to sign with; any
#: name works with a shared secret (coturn use-auth-secret: "<expiry>:<name>").
DEV_TURN_USER = "dev"


@frozen
class FirstRun:
    """What :func:`prepare` decided."""

    #: The configuration to run: the operator's, with development credentials
    #: filled in where they were missing.
    config: Config
    state_dir: Path
    #: None when the state directory was not needed or not usable.
    credentials: LocalCredentials | None
    #: Whether ``credentials.json`` was created by this start.
    created: bool
    #: True when the TURN secret is the development one.
    dev_turn: bool
    #: True when the relay API key is the development one.
    dev_relay: bool

    @property
    def development(self) -> bool:
        return self.dev_turn or self.dev_relay


def turn_needs_credentials(config: Config) -> bool:
    """TURN runs and refuses every Allocate: no user, no secret."""
    if not config.enabled("turn") or "turn" not in config.sections:
        return False
    turn = config.section("turn", TurnConfig)
    return not (
        turn.user or turn.users_file or turn.secret or turn.allow_unauthenticated
    )


def relay_needs_api_key(config: Config) -> bool:
    """The relay allocations API runs and refuses every request: no API key."""
    if not config.enabled("relay") or "relay" not in config.sections:
        return False
    relay = config.section("relay", RelayConfig)
    return not relay.node_only and not relay.api_keys


def _global_addresses(config: Config) -> list[tuple[str, str]]:
    """(flag, address) of every configured address that is globally reachable."""
    candidates = [
        ("--public-host", config.core.public_host),
        ("--host", config.core.host),
    ]
    if "turn" in config.sections:
        candidates.append(
            ("--turn-external-ip", config.section("turn", TurnConfig).external_ip)
        )
    if "relay" in config.sections:
        candidates.append(
            ("--relay-public-host", config.section("relay", RelayConfig).public_host)
        )
    found = []
    for flag, text in candidates:
        if text and ipaddress.ip_address(text).is_global:
            found.append((flag, text))
    return found


def prepare(config: Config, env: Mapping[str, str] | None = None) -> FirstRun:
    """Apply the first-run rules (module docstring) to ``config``.

    Raises:
        ConfigError: credentials are missing on a globally reachable server, or
            the state directory cannot be used.
    """
    dev_turn = turn_needs_credentials(config)
    dev_relay = relay_needs_api_key(config)
    exposed = _global_addresses(config)
    if exposed and (dev_turn or dev_relay):
        flag, address = exposed[0]
        missing = []
        if dev_turn:
            missing.append("--turn-secret SECRET (or --turn-user NAME:PASSWORD)")
        if dev_relay:
            missing.append("--api-key KEY")
        raise ConfigError(
            f"{flag} {address} is a public address: refusing to run with "
            f"generated development credentials; add {' and '.join(missing)} "
            "(or the CROSSROADS_* variables / TOML keys of the same names)"
        )
    state_dir = _resolve_state_dir(config.core.state_dir, env)
    if not (dev_turn or dev_relay or config.core.admin_token == ""):
        # Everything was given: the state directory is not needed (a read-only
        # container keeps working).
        return FirstRun(config, state_dir, None, False, False, False)
    try:
        credentials, created = load_or_create_credentials(state_dir)
    except ConfigError as exc:
        if dev_turn or dev_relay:
            raise
        # Only the admin token was missing: run without admin pages rather than
        # not at all.
        log.warning("%s; the admin pages and CLI stay closed", exc)
        return FirstRun(config, state_dir, None, False, False, False)
    sections = dict(config.sections)
    if dev_turn:
        sections["turn"] = dataclasses.replace(
            config.section("turn", TurnConfig),
            secret=(credentials.turn_secret,),
            same_host_loopback_peers=True,
        )
    if dev_relay:
        sections["relay"] = dataclasses.replace(
            config.section("relay", RelayConfig),
            api_keys=(credentials.relay_api_key,),
            allow_private_peers=True,
        )
    core = config.core
    if not core.admin_token:
        core = dataclasses.replace(core, admin_token=credentials.admin_token)
    return FirstRun(
        config=dataclasses.replace(config, core=core, sections=sections),
        state_dir=state_dir,
        credentials=credentials,
        created=created,
        dev_turn=dev_turn,
        dev_relay=dev_relay,
    )


def _client_host(bound: str) -> str:
    """The address a local test command should use for a bound address."""
    if bound in ("", "0.0.0.0"):
        return "127.0.0.1"
    if bound == "::":
        return "::1"
    return bound


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def turn_test_command(secret: str, stun: Address) -> str:
    """coturn's uclient in client-to-client mode (-y: two clients relay to each
    other through their own allocations, no peer to start), signing with the
    shared secret (-W) like a TURN REST client."""
    host = _client_host(stun[0])
    args = ["turnutils_uclient", "-y", "-m", "2", "-n", "10", "-W", secret]
    args += ["-u", DEV_TURN_USER, "-p", str(stun[1]), host]
    return shlex.join(args)


def relay_test_command(api_key: str, http: Address) -> str:
    """curl asking the Unity-compatible allocations API for an allocation."""
    url = f"http://{_url_host(_client_host(http[0]))}:{http[1]}/v1/allocate"
    return shlex.join(
        [
            "curl",
            "-sS",
            "-H",
            f"Authorization: Bearer {api_key}",
            "-H",
            "Content-Type: application/json",
            "-d",
            '{"maxConnections": 2}',
            url,
        ]
    )


def banner(first_run: FirstRun, *, stun: Address | None, http: Address) -> list[str]:
    """The lines ``crossroads serve`` prints in development mode (empty otherwise)."""
    if not first_run.development:
        return []
    credentials = first_run.credentials
    if credentials is None:
        return []
    where = first_run.state_dir / "credentials.json"
    verb = "created" if first_run.created else "kept"
    lines = [
        "=" * 72,
        f"crossroads: development credentials ({verb} in {where})",
    ]
    if first_run.dev_turn:
        lines.append(f"  TURN shared secret (--turn-secret): {credentials.turn_secret}")
    if first_run.dev_relay:
        lines.append(
            f"  relay API key (--api-key):          {credentials.relay_api_key}"
        )
    if first_run.config.core.admin_token == credentials.admin_token:
        lines.append(f"  admin token (console, admin CLI):   {credentials.admin_token}")
    lines.append("Try it from this machine:")
    if first_run.dev_turn and stun is not None:
        lines.append("  " + turn_test_command(credentials.turn_secret, stun))
    if first_run.dev_relay:
        lines.append("  " + relay_test_command(credentials.relay_api_key, http))
    lines += [
        "WARNING: development mode. These credentials are for trying crossroads on",
        "this machine; TURN clients on loopback may use loopback peers, and the",
        "relay serves loopback and private clients. Production needs real ones:",
        "--turn-secret (or --turn-user) and --api-key, and --public-host set to",
        "the server's public address.",
        "=" * 72,
    ]
    return lines
