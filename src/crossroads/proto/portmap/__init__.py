"""Port-mapping protocols: NAT-PMP (RFC 6886) and PCP (RFC 6887), sans-I/O codecs.

No maintained Python library implements them (the PyPI packages ``nat-pmp`` and
``py-natpmp`` are synchronous, NAT-PMP-only and unmaintained since 2021/2023), so
crossroads carries these small codecs; UPnP-IGD uses async-upnp-client.
"""
