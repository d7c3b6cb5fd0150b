"""crossroads: self-hostable connectivity for multiplayer games.

STUN and TURN, an OpenTTD-compatible game coordinator, GameSpy NAT negotiation,
and relays with join codes, in one package and one command (``crossroads serve``).
"""

__version__ = "0.1.0"
