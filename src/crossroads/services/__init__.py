"""The registry of services.

Order matters: services start in this order (a service may use those before it),
and stop in reverse. Each entry is a module path; see :mod:`crossroads.services.base`
for what the module provides.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from crossroads.config import register_section

SERVICE_MODULES: dict[str, str] = {
    # name -> module. One line per service; keep names as in DESIGN.md.
    "stun": "crossroads.services.stun",
    "turn": "crossroads.services.turn",
    "openttd": "crossroads.services.openttd",
    "natneg": "crossroads.services.natneg",
    "qos": "crossroads.services.qos",
    "relay": "crossroads.services.relay",
    "p2p": "crossroads.services.p2p",
    "raknet": "crossroads.services.raknet",
}


def load_service_modules() -> dict[str, ModuleType]:
    """Import every service module and register its config section."""
    from crossroads import insight

    # Not a service: the recorder every service writes to (crossroads.insight).
    register_section(insight.NAME, insight.Config)
    modules: dict[str, ModuleType] = {}
    for name, path in SERVICE_MODULES.items():
        module = importlib.import_module(path)
        if getattr(module, "NAME", None) != name:
            raise RuntimeError(f"{path}.NAME must be {name!r}")
        register_section(name, module.Config)
        modules[name] = module
    return modules
