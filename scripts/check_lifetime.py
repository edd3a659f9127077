"""Check on this machine that a child started through engine/lifetime.py ignores SIGTERM/SIGINT
(by signal.getsignal and by /proc's SigIgn) and dies with its parent. Prints one line per fact."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenspeed_worker.engine import lifetime  # noqa: E402


def _child(q) -> None:
    lifetime.guard()
    status = Path("/proc/self/status").read_text()
    sig_ign = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "?")
    q.put((signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, signal.getsignal(signal.SIGINT) == signal.SIG_IGN, sig_ign))
    time.sleep(60)


def main() -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,), daemon=True)
    lifetime.start(p)
    term, intr, sig_ign = q.get(timeout=60)
    print(f"child: SIGTERM ignored {term}, SIGINT ignored {intr}, /proc SigIgn {sig_ign}")
    os.kill(p.pid, signal.SIGTERM)
    time.sleep(0.5)
    print(f"child alive after SIGTERM: {p.is_alive()}")
    p.kill()
    p.join(5)
    return 0 if term and intr else 1


if __name__ == "__main__":
    sys.exit(main())
