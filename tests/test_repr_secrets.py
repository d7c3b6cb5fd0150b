"""No key, password or master secret shows in the repr of the records that hold
one: a repr ends up in logs and tracebacks."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from crossroads.client.relay import Allocation as RelayAllocation
from crossroads.proto.dtls.crypto import SessionKeys
from crossroads.proto.dtls.server import _Handshake
from crossroads.proto.turn.allocation import Allocation as TurnAllocation
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.proto.turn.server import Auth
from crossroads.services.relay_allocations import Grant

SECRET = b"\x13\x37-do-not-log-\x13\x37"

HOLDERS = [
    (LongTermSession, "password"),
    (SessionKeys, "master"),
    (_Handshake, "master"),
    (TurnAllocation, "key"),
    (Auth, "key"),
    (Grant, "key"),
    (RelayAllocation, "key"),
]


def build(cls: type[Any], secret_field: str) -> Any:
    """An instance with the secret in ``secret_field`` and a plain marker in
    every other field (records: no validation runs)."""
    values = {
        f.name: SECRET if f.name == secret_field else f"<{f.name}>"
        for f in dataclasses.fields(cls)
        if f.init
    }
    if secret_field == "password":
        values[secret_field] = SECRET.decode("latin-1")
    return cls(**values)


@pytest.mark.parametrize(("cls", "secret_field"), HOLDERS)
def test_repr_leaves_the_secret_out(cls: type[Any], secret_field: str) -> None:
    record = build(cls, secret_field)
    text = repr(record)
    assert "do-not-log" not in text
    assert (
        f"<{next(f.name for f in dataclasses.fields(cls) if f.init and f.name != secret_field)}>"
        in text
    )
