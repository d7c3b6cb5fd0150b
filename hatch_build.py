"""Hatch build hook: compile the optional C data plane of the TURN relay.

``src/crossroads/transport/_turnfast.c`` is compiled in place (so an editable
install picks it up) and included in wheels. Without a C compiler or Python
headers the build goes on without it and crossroads uses the pure-Python data
plane (``crossroads.transport.turnplane``); set ``CROSSROADS_NO_C=1`` to skip it
on purpose.

The kernel data plane's eBPF program (``src/crossroads/transport/bpf/relay.bpf.c``)
is compiled the same way, with clang's BPF target, into ``relay.bpf.o`` beside
it; without clang (Debian's clang, llvm and libbpf-dev: ``make install``) the
build goes on and ``--dataplane auto`` uses the C or Python plane.
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
BPF_SOURCE = Path("src/crossroads/transport/bpf/relay.bpf.c")


def build_bpf(root: Path) -> Path | None:
    """Compile the eBPF program; its object's path, or None (said on stderr)."""
    source = root / BPF_SOURCE
    target = source.with_suffix(".o")
    clang = shutil.which(os.environ.get("BPF_CLANG", "clang"))
    if clang is None:
        print("crossroads: no clang; no kernel data plane", file=sys.stderr)
        return None
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    command = [clang, "-O2", "-g", "-Wall", "-target", "bpf", "-c", str(source), "-o", str(target)]
    if arch:
        command[1:1] = [f"-I/usr/include/{arch}"]  # asm/types.h of Debian's multiarch layout
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(f"crossroads: kernel data plane not built:\n{result.stderr}", file=sys.stderr)
        return None
    return target


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or os.environ.get("CROSSROADS_NO_C"):
            return
        root = Path(self.root)
        bpf = build_bpf(root)
        if bpf is not None and version != "editable":
            build_data["force_include"][str(bpf)] = f"crossroads/transport/bpf/{bpf.name}"
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
