"""The figures of the bench scripts' JSON results: one line per result, and the A/B table of two trees.

    python scripts/bench_summary.py --line SUITE RESULT.json [LABEL]   one line for one result
    python scripts/bench_summary.py OUT                                 the table of OUT/results.tsv

OUT/results.tsv, written by scripts/gpu_check.sh, has one result per line: suite, case, tree, round
and the JSON file (relative to OUT). The table gives each figure per tree, as the median over its
rounds with every round in brackets, and the first tree's figure over each other tree's. SUITE is
latency, offline, serving, prefix or sampler (the JSON of bench_latency.py, bench_offline.py,
bench_serving.py, bench_prefix.py, bench_sampler.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def figures(suite: str, r: dict) -> list[tuple[str, str, float, str]]:
    """(what, unit, value, detail) for each figure of one result; tok/s higher is better, ms and s lower."""
    if suite == "latency":
        return [("engine decode, batch 1", "tok/s", r["decode_tok_s"],
                 f"{r['decode_step_ms_median']:.3f} ms/step, {100 * r['fraction_of_bandwidth_roofline']:.1f}% of the "
                 f"bandwidth roofline, TTFT {r['ttft_ms']:.1f} ms")]
    if suite == "offline":
        return [("output", "tok/s", r["output_tok_s"],
                 f"{r['output_tokens']} tokens in {r['wall_s']:.1f} s, {100 * r['fraction_of_step_roofline']:.1f}% "
                 f"of the step roofline, {r['preemptions']} preemptions")]
    if suite == "serving":
        rows = [(f"C={lv['concurrency']}", "tok/s", lv["output_tok_s"],
                 f"TTFT {lv['ttft_ms_median']:.0f} ms, " + (
                     f"ITL p50 {lv['itl_ms_median']:.2f} / p99 {lv['itl_ms_p99']:.1f} ms"
                     if lv.get("itl_ms_median") is not None else "not streamed") + (
                     f", server process CPU {100 * lv['server_cpu_fraction_of_wall']:.0f}% of the wall "
                     f"({lv['server_cpu_us_per_output_token']:.0f} us/token)" if "server_cpu_s" in lv else "") + (
                     f", engine process CPU {100 * lv['engine_cpu_fraction_of_wall']:.0f}%"
                     if "engine_cpu_fraction_of_wall" in lv else "") + (
                     f", engine {lv['engine_steps_per_s']:.0f} steps/s of {lv['engine_tokens_per_step']:.1f} tokens"
                     if lv.get("engine_tokens_per_step") else ""))
                for lv in r["levels"]]
        if r.get("startup_s") is not None:
            rows.append(("startup", "s", r["startup_s"], f"launch to healthy; the worker's own ready line "
                                                          f"{r.get('worker_ready_s')} s"))
        return rows
    if suite == "prefix":
        on, off = r["results"]["enable-prefix-caching"], r["results"]["no-enable-prefix-caching"]
        return [("TTFT, cache on", "ms", on["ttft_ms_median"],
                 f"off {off['ttft_ms_median']:.0f} ms; {100 * on['prefill_tokens_saved']:.1f}% of prefill saved"),
                ("wall, cache on", "s", on["wall_s"], f"off {off['wall_s']:.1f} s")]
    if suite == "sampler":
        return [(f"{run['backend']} {run['config']}", "ms", run["ms_per_step"],
                 f"{run['ratio_to_read_once']:.1f}x reading the logits once") for run in r["runs"]]
    if suite == "speculative":
        rows = [(f"width {row.get('draft_tokens', r.get('draft_tokens'))} accept {row['accept_forced']:g} batch "
                 f"{row['batch']}", "tok/s", row["speculative"]["output_tok_s"],
                 f"x{row['speedup']:.2f} of {row['plain']['output_tok_s']:.0f} plain, acceptance "
                 f"{row['speculative']['acceptance']}, same output {row['same_output']}")
                for row in r.get("oracle", {}).get("rows", [])]
        text = r.get("text")
        if text:
            rows += [(f"text {i}", "x", speedup, f"NGRAM acceptance {run['acceptance']}, same output {same}")
                     for i, (speedup, run, same) in enumerate(zip(text["speedup"], text["ngram"], text["same_output"]))]
        return rows
    if suite == "window":  # scripts/bench_window.py: per variant and context, the decode rate and the KV held
        return [(f"{name} ctx {row['context']}", "tok/s", row["decode_tok_s"],
                 f"KV held {row['kv_tokens_held_max']} tokens decoding "
                 f"({row.get('kv_tokens_held_prefill_max', '?')} in prefill), ITL p50 {row['itl_ms_p50']:.2f} ms, "
                 f"TTFT {row['ttft_ms']:.0f} ms")
                for name, rows in r["variants"].items() for row in rows]
    if suite == "startup" and "models" in r:  # scripts/bench_startup.py: launch to healthy, cold then warm
        return [(f"{model} {kind}", "s", run["healthy_s"],
                 f"first request {run['first_request_s']:.2f} s; phases {run['phases']}")
                for model, runs in r["models"].items() for kind, run in runs.items()]
    if suite == "startup":  # scripts/startup_probe.py: each step's median over the repeats, per mode
        return [(f"{mode} {step}", "s", statistics.median(run[step] for run in runs), f"{len(runs)} fresh processes")
                for mode, runs in r["runs"].items() if runs
                for step in runs[0] if all(step in run for run in runs)]
    if suite == "graphmem":  # scripts/bench_graph_memory.py: what each kind of capture took, by pool
        return [(f"{kind} graphs' pool", "MiB", t["private"],
                 f"ordinary cache {t['ordinary']:+.0f} MiB, device {t['used']:+.0f} MiB")
                for kind, t in r["by_kind_mib"].items()]
    raise SystemExit(f"unknown suite {suite!r}")


def fmt(value: float) -> str:
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def line(suite: str, path: Path, label: str) -> str:
    try:
        rows = figures(suite, json.loads(path.read_text()))
    except KeyError as missing:
        return f"{label}: {path} has no {missing}"
    if len(rows) == 1:
        what, unit, value, detail = rows[0]
        return f"{label}: {fmt(value)} {unit} {what} ({detail})"
    return f"{label}: " + "; ".join(f"{what} {fmt(value)} {unit} ({detail})" for what, unit, value, detail in rows)


def table(out: Path) -> str:
    values: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    trees: list[str] = []
    notes = []
    for entry in (out / "results.tsv").read_text().splitlines():
        suite, case, tree, _round, file = entry.split("\t")
        if tree not in trees:
            trees.append(tree)
        try:
            rows = figures(suite, json.loads((out / file).read_text()))
        except KeyError as missing:
            notes.append(f"{file} has no {missing}: left out")
            continue
        for what, unit, value, _detail in rows:
            values[(suite, case, what, unit)][tree].append(value)
    if not values:
        return "\n".join(["no results", *notes])
    header = ["suite", "case", "figure", *trees, *(f"{trees[0]}/{t}" for t in trees[1:])]
    body = []
    for (suite, case, what, unit), by_tree in values.items():
        cells = [suite, case, f"{what} ({unit})"]
        for tree in trees:
            runs = by_tree.get(tree, [])
            cells.append(f"{fmt(statistics.median(runs))} ({', '.join(fmt(v) for v in runs)})" if runs else "-")
        for tree in trees[1:]:
            a, b = by_tree.get(trees[0]), by_tree.get(tree)
            cells.append(f"{statistics.median(a) / statistics.median(b):.4f}" if a and b else "-")
        body.append(cells)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *body]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], *notes,
                      "(median over rounds, each round in brackets; tok/s: higher is better, ms and s: lower)"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--line", nargs="+", metavar=("SUITE", "RESULT"), help="SUITE RESULT.json [LABEL]: one line")
    ap.add_argument("out", nargs="?", help="the folder holding results.tsv")
    args = ap.parse_args()
    if args.line:
        suite, path = args.line[0], Path(args.line[1])
        print(line(suite, path, args.line[2] if len(args.line) > 2 else f"{suite} {path.stem}"))
    elif args.out:
        print(table(Path(args.out)))
    else:
        ap.error("give --line SUITE RESULT.json or OUT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
