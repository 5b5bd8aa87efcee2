"""Where the `router` binary this wheel carries is installed."""

import os
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional

#: The distribution whose wheel carries the binary.
DISTRIBUTION = "llm-router"
#: Overrides the lookup (a binary of your own build, or a custom router).
ENV_BINARY = "LLM_ROUTER_BINARY"
BINARY_NAME = "router.exe" if sys.platform == "win32" else "router"


class RouterError(Exception):
    """Why a router could not be started or did not become ready."""


class BinaryNotFoundError(RouterError, FileNotFoundError):
    """The `router` binary is not where the wheel installs it."""


def _from_distribution() -> Optional[Path]:
    """The binary recorded in the installed wheel's file list (RECORD)."""
    from importlib import metadata

    try:
        files = metadata.distribution(DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        # pip records the wheel's scripts as ../../../bin/router (or the
        # user scheme's equivalent); the package has no other file of that name.
        if file.name == BINARY_NAME:
            return Path(file.locate()).resolve()
    return None


def _candidates() -> List[Path]:
    found = _from_distribution()
    candidates = [found] if found is not None else []
    # The scripts directory of this interpreter's environment, and of the
    # user scheme (pip install --user), where pip puts the wheel's scripts.
    for scheme in (None, f"{os.name}_user"):
        try:
            scripts = sysconfig.get_path("scripts", scheme) if scheme else sysconfig.get_path("scripts")
        except KeyError:
            continue
        if scripts:
            candidates.append(Path(scripts) / BINARY_NAME)
    return candidates


def binary_path(binary: Optional[os.PathLike] = None) -> Path:
    """The `router` binary to run: `binary` if given, else `$LLM_ROUTER_BINARY`,
    else the one installed with the llm-router wheel. Never a `router` found
    on PATH, which could be any program of that name (or a development build).

    Raises BinaryNotFoundError, saying where it looked.
    """
    if binary is None:
        binary = os.environ.get(ENV_BINARY) or None
        source = f"${ENV_BINARY}"
    else:
        source = "binary="
    if binary is not None:
        path = Path(binary)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise BinaryNotFoundError(f"{source} {str(path)!r} is not an executable file")
    candidates = _candidates()
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    looked = ", ".join(str(path) for path in candidates) or "(no scripts directory)"
    raise BinaryNotFoundError(
        f"the router binary of the {DISTRIBUTION} wheel is not installed (looked in: {looked}); "
        f"install the wheel with pip into this interpreter's environment, or set {ENV_BINARY} "
        f"to a router binary"
    )
