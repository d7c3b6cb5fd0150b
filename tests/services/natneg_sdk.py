"""The SDK-like natneg test client.

The client (``SdkNegotiator``, ``detect_nat``) is a re-implementation of the GameSpy
SDK client used only by tests and by the NAT lab's ``natneg`` matrix method; it lives
in :mod:`crossroads.lab.natneg_sdk` because the lab runs from the installed package.
This module is where the tests take it from.
"""

from crossroads.lab.natneg_sdk import (
    NatDetection,
    Outcome,
    SdkNegotiator,
    State,
    Timers,
    detect_nat,
    determine_nat_type,
    read_game_data,
)

__all__ = [
    "NatDetection",
    "Outcome",
    "SdkNegotiator",
    "State",
    "Timers",
    "detect_nat",
    "determine_nat_type",
    "read_game_data",
]
