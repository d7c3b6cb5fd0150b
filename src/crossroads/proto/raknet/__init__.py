"""RakNet 4 (protocol 6) wire protocol, sans-I/O (reference: raknet-wire.md)."""
