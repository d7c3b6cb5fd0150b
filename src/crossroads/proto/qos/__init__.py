"""The Unity/Multiplay QoS protocol: codec and server core (docs/qos.md)."""
