"""Regenerate the parameter tables in docs/parameters.md from `ServerArgs` (tokenspeed_worker/config/parameters.py)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenspeed_worker.config import render_markdown  # noqa: E402

BEGIN, END = "<!-- BEGIN GENERATED PARAMETERS -->\n", "<!-- END GENERATED PARAMETERS -->"
path = REPO / "docs" / "parameters.md"
text = path.read_text()
head, rest = text.split(BEGIN, 1)
_, tail = rest.split(END, 1)
path.write_text(head + BEGIN + render_markdown() + END + tail)
print(f"regenerated {path}")
