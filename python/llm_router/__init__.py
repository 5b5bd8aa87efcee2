"""llm-router from Python.

The wheel carries the release `router` binary (installing it needs no Rust
toolchain) and this package around it:

- `python -m llm_router.launch_router ...` starts the router with
  sglang-router's command line (`--worker-urls`, `--policy`, `--port`, ...);
  flags that mean nothing here are refused with exit code 2.
- `Router` runs one from Python, for tests and notebooks::

      with llm_router.Router(worker_urls=["http://127.0.0.1:30000"],
                             policy="least_load", port=0) as router:
          print(router.url)

- `binary_path()` is the installed binary, to run it yourself.
"""

from ._binary import BinaryNotFoundError, RouterError, binary_path
from ._mapping import FlagError, RouterCommand, parse
from ._process import PortInUseError, Router, RouterExitedError, RouterNotReadyError

__all__ = [
    "BinaryNotFoundError",
    "FlagError",
    "PortInUseError",
    "Router",
    "RouterCommand",
    "RouterError",
    "RouterExitedError",
    "RouterNotReadyError",
    "binary_path",
    "parse",
]
