"""Typed configuration, built once from flags, environment and a TOML file.

Precedence is flag > ``CROSSROADS_*`` environment variable > TOML file > default.

Configuration is split in *sections*: ``core`` (bind host, HTTP port, store, the
set of services) and one section per service (``stun``, ``turn``, ...). A section
is a frozen dataclass whose fields are declared with :func:`setting`; from that one
declaration come the command-line flag, the environment variable, the TOML key,
the conversion and the validation, so a service adds its options in its own module
and nowhere else.

TOML layout::

    host = "0.0.0.0"          # core keys at the top level
    http_port = 8080
    [stun]
    port = 3478
    [turn]
    realm = "example.org"

A field named ``port`` in section ``stun`` is flag ``--stun-port``, environment
variable ``CROSSROADS_STUN_PORT`` and TOML key ``stun.port``; a field may choose
another flag name (``--relay-ports``), and the environment name follows the flag.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, TypeVar

from crossroads.errors import ConfigError
from crossroads.proto.policy import parse_networks
from crossroads.types import frozen

Kind = Literal["str", "int", "port", "float", "bool", "host", "list", "port_range"]

ENV_PREFIX = "CROSSROADS_"
_META_KEY = "crossroads"


@frozen
class SettingInfo:
    """How one configuration field is exposed and converted."""

    help: str
    kind: Kind
    flag: str | None = None
    #: Extra validation after conversion; raise ValueError with a short reason.
    check: Callable[[Any], None] | None = None
    #: Environment variable, when it should not follow the flag's name.
    env: str | None = None


#: The kind each field annotation implies, so that a declaration names its type
#: once; ``port``, ``host`` and ``port_range`` narrow a type and are declared.
_KIND_OF_TYPE: dict[str, Kind] = {
    "str": "str",
    "int": "int",
    "float": "float",
    "bool": "bool",
    "tuple[str, ...]": "list",
}
#: The annotation each kind takes, the narrowing ones included.
_TYPE_OF_KIND: dict[Kind, str] = {
    kind: name for name, kind in _KIND_OF_TYPE.items()
} | {
    "port": "int",
    "host": "str",
    "port_range": "tuple[int, int]",
}


def setting(
    default: Any,
    *,
    help: str,
    kind: Kind | None = None,
    flag: str | None = None,
    check: Callable[[Any], None] | None = None,
    env: str | None = None,
) -> Any:
    """Declare a configuration field (use as a dataclass field default).

    ``kind`` follows from the field's annotation (``int``, ``float``, ``bool``,
    ``str``, ``tuple[str, ...]`` is ``list``); name it only to narrow the type:
    ``port``, ``host`` or ``port_range``.
    """
    info = _Declared(help=help, kind=kind, flag=flag, check=check, env=env)
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={_META_KEY: info})


@frozen
class _Declared:
    """What :func:`setting` was given, before the annotation completes it."""

    help: str
    kind: Kind | None
    flag: str | None
    check: Callable[[Any], None] | None
    env: str | None


def _annotation(f: dataclasses.Field[Any]) -> str:
    declared = f.type
    if isinstance(declared, str):
        return declared.replace(" ", "").replace(",", ", ")
    return declared.__name__ if isinstance(declared, type) else str(declared)


def setting_info(f: dataclasses.Field[Any]) -> SettingInfo:
    declared = f.metadata.get(_META_KEY)
    if not isinstance(declared, _Declared):
        raise TypeError(f"config field {f.name} was not declared with setting()")
    annotation = _annotation(f)
    if declared.kind is None:
        kind = _KIND_OF_TYPE.get(annotation)
        if kind is None:
            raise TypeError(
                f"config field {f.name}: no kind for type {annotation}; declare one"
            )
    else:
        kind = declared.kind
        if _TYPE_OF_KIND[kind] != annotation:
            raise TypeError(
                f"config field {f.name}: kind {kind} does not fit type {annotation}"
            )
    return SettingInfo(
        help=declared.help,
        kind=kind,
        flag=declared.flag,
        check=declared.check,
        env=declared.env,
    )


# --------------------------------------------------------------------- conversions


def _to_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _to_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip(), 0)
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {value!r}")


def _to_port(value: object) -> int:
    try:
        port = _to_int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a port number (0-65535)") from None
    # 0 means "any free port", which tests and `--only` subsets rely on.
    if not 0 <= port <= 65535:
        raise ValueError(f"{port} is not a port number (0-65535)")
    return port


def _to_float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"expected a number, got {value!r}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _to_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


def _to_host(value: object) -> str:
    text = _to_str(value).strip()
    if text == "":
        return ""
    if text == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address") from None


def _to_list(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, list | tuple):
        return tuple(_to_str(v) for v in value)
    raise ValueError(f"expected a list of strings, got {value!r}")


def _to_port_range(value: object) -> tuple[int, int]:
    if isinstance(value, list | tuple) and len(value) == 2:
        low, high = _to_port(value[0]), _to_port(value[1])
    else:
        text = _to_str(value)
        low_text, sep, high_text = text.partition("-")
        if not sep:
            raise ValueError(f"{text!r} is not a port range like 49152-65535")
        low, high = _to_port(low_text), _to_port(high_text)
    if low == 0 or low > high:
        raise ValueError(f"{low}-{high} is not a port range (1 <= low <= high)")
    return low, high


CONVERTERS: dict[Kind, Callable[[object], Any]] = {
    "str": _to_str,
    "int": _to_int,
    "port": _to_port,
    "float": _to_float,
    "bool": _to_bool,
    "host": _to_host,
    "list": _to_list,
    "port_range": _to_port_range,
}


# ------------------------------------------------------------------ core section


# Checks shared by every section's ``setting(check=...)`` (the service modules
# use them too): one wording for one rule.


def check_positive(value: float) -> None:
    """A count, size or duration that must be above zero."""
    if value <= 0:
        raise ValueError("must be > 0")


def check_non_negative(value: float) -> None:
    """A limit or allowance where 0 is meaningful (usually: none)."""
    if value < 0:
        raise ValueError("must be >= 0")


def check_dataplane(value: str) -> None:
    """One of the relay data planes (crossroads.transport.planes)."""
    if value not in ("auto", "kernel", "c", "python"):
        raise ValueError("must be auto, kernel, c or python")


def check_kernel_hook(value: str) -> None:
    """Where the kernel plane's program runs (crossroads.transport.kernelplane)."""
    if value not in ("auto", "tc", "xdp"):
        raise ValueError("must be auto, tc or xdp")


def check_networks(values: tuple[str, ...]) -> None:
    """Addresses or CIDR networks, parsed as their consumers parse them."""
    parse_networks(values)


def _check_store(url: str) -> None:
    from crossroads.store.base import REDIS_SCHEMES

    if url != "memory" and not url.startswith(REDIS_SCHEMES):
        raise ValueError(
            f"{url!r} is neither 'memory' nor a redis://, rediss://, unix:// or "
            "redis+sentinel:// URL"
        )


def _check_log_format(value: str) -> None:
    if value not in {"text", "json"}:
        raise ValueError(f"{value!r} is not 'text' or 'json'")


def _check_port_or_off(value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError("must be a port (1-65535), or 0 for none")


#: A DNS name as a CA issues for it (RFC 1123 labels, a dot between them).
_DNS_NAME = re.compile(
    r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


def _check_acme_domains(names: tuple[str, ...]) -> None:
    for name in names:
        if name.startswith("*."):
            # HTTP-01 proves control of one host name; a CA validates a
            # wildcard only with DNS-01 (RFC 8555 §8.3, §7.1.3).
            raise ValueError(f"{name!r}: a wildcard needs DNS-01, not HTTP-01")
        if not _DNS_NAME.match(name.lower()) or name.replace(".", "").isdigit():
            raise ValueError(f"{name!r} is not a DNS name")


def _check_https_url(url: str) -> None:
    if not url.startswith("https://"):
        # RFC 8555 §6.1: ACME is spoken over HTTPS only.
        raise ValueError(f"{url!r} is not an https:// URL")


def _check_log_level(level: str) -> None:
    if level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError(f"{level!r} is not one of debug, info, warning, error")


@frozen
class CoreConfig:
    """Settings that apply to the whole process."""

    host: str = setting("0.0.0.0", kind="host", help="Bind address for every service.")
    http_port: int = setting(
        8080, kind="port", help="HTTP port: REST APIs, pages, /metrics, /healthz."
    )
    store: str = setting(
        "memory",
        check=_check_store,
        help="Shared state: 'memory' (one process) or a Redis URL: redis://, "
        "rediss:// (TLS), unix://, redis+sentinel://host:26379,host2:26379/mymaster/0.",
    )
    only: tuple[str, ...] = setting(
        (),
        help="Run only these services (comma separated); HTTP always runs.",
    )
    log_level: str = setting(
        "info", check=_check_log_level, help="debug, info, warning or error."
    )
    log_format: str = setting(
        "text",
        check=_check_log_format,
        help="Log lines as 'text' or 'json' (one object per line: time, level, "
        "logger, message, exception).",
    )
    public_host: str = setting(
        "",
        kind="host",
        help="Address clients should use to reach this host, when it differs from --host.",
    )
    state_dir: str = setting(
        "",
        help="Where this installation keeps its development credentials and admin "
        "token (default: $XDG_STATE_HOME/crossroads, else ~/.local/state/crossroads).",
    )
    admin_token: str = setting(
        "",
        help="Bearer token of the console's admin pages and API (default: the one "
        "created in --state-dir; with neither, admin pages are refused).",
    )
    api_docs: bool = setting(
        False,
        help="Serve the interactive API documentation (/docs, /redoc and "
        "/openapi.json). Off by default: it lists every route and schema to "
        "anyone, from a page that loads scripts from a CDN.",
    )
    # crossroads.transport.planes: which relay data plane runs (docs/architecture.md).
    dataplane: str = setting(
        "auto",
        check=check_dataplane,
        help="Relay data plane: kernel (eBPF, needs root or CAP_BPF+CAP_NET_ADMIN), "
        "c (recvmmsg/sendmmsg), python, or auto (kernel where the eBPF program "
        "loads, else c, else python).",
    )
    # crossroads.transport.kernelplane xdp_policy: XDP (driver mode) in front
    # of tc per device (docs/architecture.md "Which hook, per device").
    kernel_hook: str = setting(
        "auto",
        check=check_kernel_hook,
        help="Kernel plane hook per device: tc (tc ingress only), xdp (also XDP "
        "in driver mode on every device whose driver has it), or auto (XDP on "
        "NIC drivers, tc on veth and other virtual devices). XDP passes what it "
        "cannot finish to tc; a device another process's XDP holds gets tc.",
    )
    # The C data plane sends a burst to one destination as one UDP GSO message
    # (UDP_SEGMENT, Linux >= 4.18; crossroads.transport._turnfast "UDP GSO").
    udp_gso: bool = setting(
        True,
        help="Send bursts of relayed datagrams to one destination as one UDP GSO "
        "message on the C data plane (falls back per socket when the kernel "
        "refuses; off: one datagram per message).",
    )
    # Reflection budget (docs/security.md "Reflection budget",
    # crossroads.proto.reflection): per source IP and service, unauthenticated
    # UDP replies may exceed what that IP sent by at most the allowance per 10 s.
    reflection_budget: bool = setting(
        True,
        help="Cap unauthenticated UDP replies per source IP at what it sent plus "
        "--reflection-allowance per 10 s (off: only for load tests on one source).",
    )
    reflection_allowance: int = setting(
        4096,
        check=check_non_negative,
        help="Bytes per 10 s a source IP may be sent beyond what it sent (per service).",
    )
    reflection_global_allowance: int = setting(
        16 * 1024 * 1024,
        check=check_non_negative,
        help="Bytes per 10 s all sources together may be sent beyond what they sent "
        "(per service): the most a flood of spoofed sources can be amplified.",
    )
    reflection_max_sources: int = setting(
        65_536,
        check=check_positive,
        help="Source IPs each service's reflection ledger tracks per 10 s.",
    )
    memory_budget: int = setting(
        0,
        check=check_non_negative,
        help="Bytes of memory the per-client tables share (TCP/TLS connections, "
        "handshakes, DTLS and RakNet sessions, buffered data); every table's cap "
        "is derived from it (docs/security.md). 0 = a quarter of the machine's "
        "(or cgroup's) memory, between 64 MiB and 2 GiB.",
    )
    http_max_connections: int = setting(
        10_000,
        check=check_positive,
        help="Concurrent HTTP connections, WebSockets included (also capped by "
        "the descriptor share of the port, see docs/security.md).",
    )
    http_max_connections_per_ip: int = setting(
        128,
        check=check_positive,
        help="Concurrent HTTP connections from one IPv4 address or IPv6 /64.",
    )
    http_request_timeout: float = setting(
        20.0,
        check=check_positive,
        help="Seconds a client has to send a whole request (headers and body) "
        "after connecting or after the previous response (slowloris).",
    )
    drain_timeout: float = setting(
        3600.0,
        check=check_positive,
        help="Seconds a draining instance (SIGTERM, `crossroads drain`) keeps "
        "its live sessions before it exits anyway; a second SIGTERM exits at "
        "once. One hour, like STUNner's default termination grace period.",
    )
    # Guessing budgets (proto/budget.py; arithmetic in docs/security.md): failed
    # join-code / invite-code lookups and failed API keys, each kind its own budget.
    guess_per_source: float = setting(
        30.0,
        check=check_non_negative,
        help="Failed code lookups or API keys per minute per source IP (IPv6: per "
        "/64), a minute's worth in a row (0 = no limit).",
    )
    guess_global: float = setting(
        10.0,
        check=check_non_negative,
        help="Failed code lookups or API keys per second for this whole instance, "
        "ten seconds' worth in a row (0 = no limit).",
    )
    https_port: int = setting(
        0,
        check=_check_port_or_off,
        help="HTTPS port of the HTTP app (REST APIs, pages, p2p WebSocket), "
        "served with --tls-cert; 0 = none. Equal to --turn-tls-port: one TLS "
        "port for both, each connection sorted by ALPN or its first bytes.",
    )
    trusted_proxies: tuple[str, ...] = setting(
        (),
        flag="--trusted-proxy",
        env="CROSSROADS_TRUSTED_PROXIES",
        check=check_networks,
        help="Address or CIDR of a reverse proxy in front of the HTTP port "
        "(repeatable). Only from these is X-Forwarded-For believed: the client "
        "is its rightmost address that is not a trusted proxy (per-IP limits, "
        "logs). Their connections skip the per-IP connection cap.",
    )
    tls_cert: str = setting(
        "",
        help="PEM certificate chain (leaf first) for the TLS listeners "
        "(TURN over TLS); reloaded on SIGHUP.",
    )
    tls_key: str = setting("", help="PEM private key of --tls-cert.")
    tls_dev_cert_dir: str = setting(
        "",
        help="Without --tls-cert, on a loopback --host: make (once) a self-signed "
        "development certificate in this directory and serve TLS with it.",
    )

    # Automatic certificates (crossroads.acme, README "Automatic certificates").
    acme_domain: tuple[str, ...] = setting(
        (),
        flag="--acme-domain",
        env="CROSSROADS_ACME_DOMAINS",
        check=_check_acme_domains,
        help="Obtain and renew the TLS certificate for this DNS name with ACME "
        "(HTTP-01 on --acme-http-port; repeatable, the first names the "
        "certificate). Replaces --tls-cert; kept in --state-dir/acme.",
    )
    acme_directory: str = setting(
        "https://acme-v02.api.letsencrypt.org/directory",
        check=_check_https_url,
        help="ACME directory URL of the certificate authority (default: Let's "
        "Encrypt production; its staging directory for trials).",
    )
    acme_email: str = setting(
        "",
        help="Contact address given to the ACME CA (expiry and policy mail); "
        "empty: none.",
    )
    acme_ca_bundle: str = setting(
        "",
        help="PEM file of the CA certificates that the ACME directory's own "
        "HTTPS is checked against (a private or test CA); default: the "
        "system's trust store.",
    )
    acme_http_port: int = setting(
        80,
        check=_check_port_or_off,
        help="Port of the HTTP-01 challenge listener (the CA connects to port 80 "
        "of the domain; another port only behind a forward to it). It answers "
        "/.well-known/acme-challenge/ only; 0 = none (the HTTP port serves the "
        "challenges too).",
    )
    acme_renew_days: float = setting(
        30.0,
        check=check_positive,
        help="Renew the ACME certificate when fewer than this many days of it "
        "remain (Let's Encrypt advises 30 days for its 90-day certificates).",
    )
    acme_check_interval: float = setting(
        43200.0,
        check=check_positive,
        help="Seconds between two checks of the ACME certificate's expiry "
        "(certbot checks twice a day); a failed attempt is retried sooner.",
    )

    # crossroads.workers and docs/architecture.md "Workers": extra processes on
    # SO_REUSEPORT STUN/TURN UDP ports (and their own relay nodes with Redis).
    workers: int = setting(
        0,
        check=check_non_negative,
        help="Worker processes (0 = auto: one per core with a Redis --store and "
        "a fixed --stun-port, else 1). Extra workers serve STUN/TURN over UDP, "
        "and a relay node each with Redis; the rest stays in worker 0.",
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert: --tls-cert and --tls-key go together")
        if self.acme_domain and self.tls_cert:
            raise ValueError(
                "acme_domain: --acme-domain obtains the certificate; "
                "drop --tls-cert/--tls-key or --acme-domain"
            )


# --------------------------------------------------------------------- sections

#: Section name -> dataclass. Services register theirs with :func:`register_section`.
SECTIONS: dict[str, type[Any]] = {"core": CoreConfig}

T = TypeVar("T")


def register_section(name: str, cls: type[T]) -> type[T]:
    """Make ``cls`` the configuration section ``name``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"config section {name} must be a dataclass")
    for f in dataclasses.fields(cls):
        setting_info(f)
    SECTIONS[name] = cls
    return cls


def flag_name(section: str, f: dataclasses.Field[Any]) -> str:
    info = setting_info(f)
    if info.flag:
        return info.flag
    stem = f.name.replace("_", "-")
    return f"--{stem}" if section == "core" else f"--{section}-{stem}"


def env_name(section: str, f: dataclasses.Field[Any]) -> str:
    info = setting_info(f)
    if info.env:
        return info.env
    return ENV_PREFIX + flag_name(section, f).lstrip("-").replace("-", "_").upper()


@frozen
class Config:
    """The whole validated configuration: the core section plus one per service."""

    core: CoreConfig
    sections: Mapping[str, Any]

    def section(self, name: str, cls: type[T]) -> T:
        value = self.sections[name]
        if not isinstance(value, cls):
            raise TypeError(f"section {name} is {type(value).__name__}")
        return value

    def enabled(self, service: str) -> bool:
        return not self.core.only or service in self.core.only


def convert_setting(
    section: str, f: dataclasses.Field[Any], raw: object, source: str
) -> Any:
    """``raw`` (a flag's text, an environment variable, a TOML or JSON value)
    converted and checked as the setting ``f`` of ``section`` declares.

    Raises:
        ConfigError: naming the key and ``source``.
    """
    info = setting_info(f)
    key = f.name if section == "core" else f"{section}.{f.name}"
    try:
        value = CONVERTERS[info.kind](raw)
        if info.check is not None:
            info.check(value)
    except ValueError as exc:
        raise ConfigError(f"{key} ({source}): {exc}") from None
    return value


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def build_config(
    *,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file_data: Mapping[str, Any] | None = None,
    file_name: str = "config file",
    sections: Mapping[str, type[Any]] | None = None,
) -> Config:
    """Build and validate a :class:`Config`.

    Args:
        flags: values given on the command line, keyed ``section.field``
            (``core.host``, ``stun.port``); only keys the user actually gave.
        env: the process environment (``os.environ`` when None).
        file_data: parsed TOML.
        file_name: used in error messages.
        sections: the section registry (defaults to :data:`SECTIONS`).

    Raises:
        ConfigError: one line naming the key at fault.
    """
    flags = flags or {}
    env = os.environ if env is None else env
    file_data = dict(file_data or {})
    sections = SECTIONS if sections is None else sections
    core_fields = {f.name for f in dataclasses.fields(CoreConfig)}

    # Reject unknown keys in the file before anything else: a typo must not be
    # silently ignored.
    for key, value in file_data.items():
        if key in core_fields:
            continue
        if key in sections and key != "core":
            if not isinstance(value, dict):
                raise ConfigError(f"{key} ({file_name}): expected a [{key}] table")
            known = {f.name for f in dataclasses.fields(sections[key])}
            for sub in value:
                if sub not in known:
                    raise ConfigError(f"unknown key {key}.{sub} in {file_name}")
            continue
        raise ConfigError(f"unknown key {key} in {file_name}")

    built: dict[str, Any] = {}
    for name, cls in sections.items():
        file_section = (
            {k: v for k, v in file_data.items() if k in core_fields}
            if name == "core"
            else file_data.get(name, {})
        )
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            if key in flags:
                kwargs[f.name] = convert_setting(
                    name, f, flags[key], flag_name(name, f)
                )
            elif env_name(name, f) in env:
                variable = env_name(name, f)
                kwargs[f.name] = convert_setting(name, f, env[variable], variable)
            elif f.name in file_section:
                kwargs[f.name] = convert_setting(
                    name, f, file_section[f.name], file_name
                )
        try:
            built[name] = cls(**kwargs)
        except ValueError as exc:
            # Cross-field checks in __post_init__ raise ValueError("key: reason").
            raise ConfigError(f"{name}: {exc}") from None

    core = built.pop("core")
    config = Config(core=core, sections=built)
    known_services = set(sections) - {"core"}
    for service in config.core.only:
        if service not in known_services:
            names = ", ".join(sorted(known_services))
            raise ConfigError(f"only: unknown service {service!r} (known: {names})")
    return config


def iter_settings(
    sections: Mapping[str, type[Any]] | None = None,
) -> Iterable[tuple[str, dataclasses.Field[Any], SettingInfo]]:
    """Every (section, field, info), in registry order, for building a CLI."""
    for name, cls in (SECTIONS if sections is None else sections).items():
        for f in dataclasses.fields(cls):
            yield name, f, setting_info(f)


def default_config(overrides: Mapping[str, Any] | None = None) -> Config:
    """A config from defaults plus ``section.field`` overrides (for tests and embedding).

    The environment is ignored, so a test is not changed by the shell it runs in.
    """
    return build_config(flags=dict(overrides or {}), env={})
