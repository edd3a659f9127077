"""The parameter tables of docs/parameters.md, generated from `ServerArgs` (`render_markdown`).

`python -m tokenspeed_worker.config` prints them; scripts/gen_parameters_doc.py writes them into
the page, and tests/test_cli.py fails when the page drifts from the table.
"""

from __future__ import annotations

import json

from tokenspeed_worker.config.parameters import GROUP_DESCRIPTIONS, GROUPS, OPTIONS, Option



def _md_flags(option: Option) -> str:
    flags = ", ".join(f"`{flag}`" for flag in option.flags)
    if option.kind is bool and option.spec.negatable:
        flags += f" / `--no-{option.flag[2:]}`"
    if option.dest == "model":
        flags = "positional `model`, " + flags
    return flags


def _md_status(option: Option) -> str:
    status = option.spec.status.value
    if option.spec.unsupported_values:
        shown = ", ".join(f"`{v}`" for v in option.spec.unsupported_values)
        status += f"; not supported yet: {shown}"
    if option.spec.harmless:
        shown = ", ".join(f"`{json.dumps(v)}`" for v in option.spec.harmless)
        status += f"; also accepted (no effect): {shown}"
    return status


def render_markdown() -> str:
    """The parameter tables of docs/parameters.md, generated from `ServerArgs`."""
    lines: list[str] = []
    for group in GROUPS:
        lines += [f"### {group}", ""]
        if group in GROUP_DESCRIPTIONS:
            lines += [GROUP_DESCRIPTIONS[group], ""]
        lines += ["| Parameter | Default | Status | Meaning |", "| --- | --- | --- | --- |"]
        for option in OPTIONS:
            if option.spec.group != group:
                continue
            meaning = option.spec.help
            if option.spec.choices:
                meaning += " Choices: " + ", ".join(f"`{c}`" for c in option.spec.choices) + "."
            meaning = meaning.replace("|", "\\|")
            lines.append(f"| {_md_flags(option)} | {option.default_text()} | {_md_status(option)} | {meaning} |")
        lines.append("")
    return "\n".join(lines)
