"""Hatch build hook: compile the optional C data plane of the TURN relay.

``src/crossroads/transport/_turnfast.c`` is compiled in place (so an editable
install picks it up) and included in wheels. Without a C compiler or Python
headers the build goes on without it and crossroads uses the pure-Python data
plane (``crossroads.transport.turnplane``); set ``CROSSROADS_NO_C=1`` to skip it
on purpose.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("src/crossroads/transport/_turnfast.c")


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or os.environ.get("CROSSROADS_NO_C"):
            return
        root = Path(self.root)
        source = root / SOURCE
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        target = source.with_name("_turnfast" + suffix)
        compiler = shutil.which(os.environ.get("CC", "cc"))
        include = sysconfig.get_paths()["include"]
        if compiler is None or not (Path(include) / "Python.h").exists():
            print("crossroads: no C compiler or Python.h; pure-Python TURN data plane",
                  file=sys.stderr)
            return
        command = [
            compiler, "-O2", "-shared", "-fPIC", "-Wall",
            f"-I{include}", str(source), "-o", str(target),
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            print(f"crossroads: C data plane not built:\n{result.stderr}", file=sys.stderr)
            return
        if version != "editable":
            build_data["force_include"][str(target)] = (
                f"crossroads/transport/{target.name}"
            )
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
