"""The NAT lab: real kernel NAT of every RFC 4787 kind in Linux network namespaces,
and the connection-success matrix measured through it (``crossroads lab``)."""
