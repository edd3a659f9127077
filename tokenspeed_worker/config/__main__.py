"""`python -m tokenspeed_worker.config` prints the generated tables of docs/parameters.md."""

from tokenspeed_worker.config.docs import render_markdown

print(render_markdown(), end="")
