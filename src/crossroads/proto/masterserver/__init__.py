"""RakNet MasterServer2-compatible game listing: request parsing and validation."""
