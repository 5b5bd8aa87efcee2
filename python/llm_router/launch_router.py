"""`python -m llm_router.launch_router`: llm-router with sglang-router's
command line.

    python -m llm_router.launch_router --worker-urls http://10.0.0.1:30000 \\
        http://10.0.0.2:30000 --policy cache_aware --port 30000

Each sglang-router flag is mapped onto this router's configuration (the
table is in the package's README); a flag with no meaning here, or a value
this router cannot honour, is refused by name with exit code 2. Then the
process becomes the wheel's `router` binary (exec), so signals, exit codes
and the process id are the router's own.
"""

import sys
from typing import Optional, Sequence

from ._binary import BinaryNotFoundError
from ._mapping import FlagError
from ._process import launch

PROG = "python -m llm_router.launch_router"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the launcher; returns an exit code only when it does not exec."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return launch(argv)
    except FlagError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except BinaryNotFoundError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"{PROG}: error: could not run the router: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
