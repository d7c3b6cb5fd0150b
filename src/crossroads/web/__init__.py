"""The HTTP app: REST APIs, pages, ``/metrics`` and ``/healthz``."""
