"""`tokenspeed-worker` entry point: parse and check the parameters, set up logging, serve.

Heavy modules (torch, grpc, the engine) are imported only after the arguments are
accepted, so `tokenspeed-worker --help` and argument errors return at once.
"""

from __future__ import annotations

import logging
import os
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


def process_age() -> float | None:
    """Seconds since this process started (the kernel's record of it, so the interpreter's own start
    and the imports before any of our code ran are counted); None where /proc does not say."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's ")"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def stop_cleanly_until_served() -> None:
    """SIGTERM or SIGINT before the server installs its own handlers (parsing, the imports: the first
    few tenths of a second) exits 0 at once, as a stop during the rest of the startup does; without
    this, Python's defaults exit 143 or print a KeyboardInterrupt traceback. Main thread only."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame) -> None:  # nothing started yet: a clean stop
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def main(argv: Sequence[str] | None = None) -> None:
    age = process_age()  # the interpreter's start and the imports so far
    launched = time.monotonic() - (age or 0.0)
    if argv is None:  # the console script (tests call main with their own argv, in their own process)
        stop_cleanly_until_served()
    args = prepare(argv)
    setup_logging(args.log_level)
    logger = logging.getLogger(__name__)
    logger.debug("server args: %s", args)
    if age is not None:
        logger.info("startup: interpreter start %.1f s (Python and the entry point's imports)", age)

    from tokenspeed_worker.bytecode import use_bytecode_cache
    from tokenspeed_worker.kernel_cache import resolve_cache_dir

    pycache = use_bytecode_cache(resolve_cache_dir(args.cache_dir))  # before the heavy imports
    if pycache:
        logger.info("Python bytecode kept in %s (torch was installed without it and Python may not write it "
                    "beside the sources)", pycache)

    from tokenspeed_worker.server.launch import run_server  # heavy: torch, grpc, engine

    code = run_server(args, launched)
    # The last line of the log says how it ended (an operator reading a tail sees the code); at info
    # level whatever the code: the error line before it says why, and stays the one error line.
    logger.info("tokenspeed-worker exiting with code %d", code)
    sys.exit(code)


if __name__ == "__main__":
    main()
