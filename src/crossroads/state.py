"""The state directory: what one crossroads installation keeps between runs.

``--state-dir`` (default ``$XDG_STATE_HOME/crossroads``, else
``~/.local/state/crossroads``, as the XDG Base Directory specification puts
"state data that should persist between restarts") holds:

- ``results/``: what ``crossroads lab matrix`` writes (``nat-matrix.md``), which
  the web console shows.
- ``credentials.json``: the development TURN secret and relay API key that
  ``crossroads serve`` creates on a first run without credentials, and the admin
  token of the console and the admin CLI. Created once, mode 0600 in a 0700
  directory, then reused: the printed test command keeps working after a restart.

Nothing here is shared between machines; what several instances share lives in
the store.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields
from pathlib import Path

from crossroads.errors import ConfigError
from crossroads.types import frozen

CREDENTIALS_FILE = "credentials.json"
#: 32 random bytes per secret: 256 bits, the size of the HMAC-SHA256 key the
#: relay uses, and well beyond what brute force against HMAC-SHA1 (TURN REST
#: credentials) could reach.
SECRET_BYTES = 32


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/crossroads``, else ``~/.local/state/crossroads``."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME", "")
    # The XDG specification: a relative path in the variable is invalid and
    # must be ignored.
    if base and Path(base).is_absolute():
        return Path(base) / "crossroads"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "state" / "crossroads"


def resolve_state_dir(configured: str, env: Mapping[str, str] | None = None) -> Path:
    """The configured ``--state-dir``, or the default one."""
    return Path(configured).expanduser() if configured else default_state_dir(env)


def results_dir(state_dir: Path) -> Path:
    """Where generated results go (``crossroads lab matrix``), read by the console."""
    return state_dir / "results"


#: The NAT-lab matrix file name in :func:`results_dir`.
MATRIX_FILE = "nat-matrix.md"


@frozen
class LocalCredentials:
    """Secrets created once per installation (see the module docstring)."""

    turn_secret: str
    relay_api_key: str
    admin_token: str


def _new_secret(random: Callable[[int], bytes]) -> str:
    # URL-safe base64 without padding: no character a shell, a TOML string or an
    # HTTP header would need quoted.
    return base64.urlsafe_b64encode(random(SECRET_BYTES)).rstrip(b"=").decode()


def load_or_create_credentials(
    directory: Path,
    *,
    random: Callable[[int], bytes] = secrets.token_bytes,
) -> tuple[LocalCredentials, bool]:
    """Read ``credentials.json`` in ``directory``, creating it when absent.

    Returns the credentials and whether they were created now.

    Raises:
        ConfigError: the directory cannot be created or the file is unreadable
            (a damaged file is never replaced silently: clients may use it).
    """
    path = directory / CREDENTIALS_FILE
    try:
        raw = path.read_text()
    except FileNotFoundError:
        raw = None
    except OSError as exc:
        raise ConfigError(f"state_dir: cannot read {path}: {exc.strerror}") from None
    if raw is not None:
        return _parse(path, raw), False
    credentials = LocalCredentials(
        turn_secret=_new_secret(random),
        relay_api_key=_new_secret(random),
        admin_token=_new_secret(random),
    )
    temporary = directory / f".{CREDENTIALS_FILE}.{os.getpid()}"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Written to a private temporary file, then linked into place: a reader
        # never sees half a file, the secrets are never readable by others, and
        # of two first runs at once only one file wins (link fails if it exists).
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(credentials), handle, indent=2)
            handle.write("\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            return _parse(path, path.read_text()), False
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"state_dir: cannot write {path}: {exc.strerror} "
            "(choose another with --state-dir)"
        ) from None
    return credentials, True


def _parse(path: Path, raw: str) -> LocalCredentials:
    try:
        data = json.loads(raw)
        values = {f.name: data[f.name] for f in fields(LocalCredentials)}
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"state_dir: {path} is damaged; repair it or delete it to create new "
            "development credentials"
        ) from None
    if not all(isinstance(v, str) and v for v in values.values()):
        raise ConfigError(f"state_dir: {path} has an empty or non-string secret")
    return LocalCredentials(**values)
