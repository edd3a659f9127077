"""`tokenspeed-worker` entry point: parse and check the parameters, set up logging, serve.

Heavy modules (torch, grpc, the engine) are imported only after the arguments are
accepted, so `tokenspeed-worker --help` and argument errors return at once.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

from tokenspeed_worker.config import PROG, ServerArgs, UnsupportedOptionError, check_supported, parse_args

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(processName)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def setup_logging(level: str) -> None:
    """Root logging for the worker process; child processes call it again with the same level."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT, force=True)


def prepare(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parsed, resolved and supported arguments; exits with status 2 on any problem."""
    args = parse_args(argv)
    try:
        check_supported(args)
    except UnsupportedOptionError as exc:
        # One line, like argparse's own errors, without repeating the long usage text.
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    launched = time.monotonic()
    args = prepare(argv)
    setup_logging(args.log_level)
    logging.getLogger(__name__).debug("server args: %s", args)

    from tokenspeed_worker.server.launch import run_server  # heavy: torch, grpc, engine

    sys.exit(run_server(args, launched))


if __name__ == "__main__":
    main()
