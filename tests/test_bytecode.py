"""Python bytecode kept in the cache folder for an install that has none and may not write it
(tokenspeed_worker/bytecode.py): a stand-in package installed without bytecode, Python started with
-B as PYTHONDONTWRITEBYTECODE=1 starts it, and a real spawned child, as the worker's engine is."""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
import textwrap

from worker_harness import REPO

PACKAGE = "tsw_no_bytecode_pkg"


def _install(site, with_bytecode=False):
    """A package in `site` as `pip install --no-compile` leaves one (or with its bytecode)."""
    pkg = site / PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "child_only.py").write_text("VALUE = 2\n")
    (pkg / "spawned.py").write_text(textwrap.dedent("""
        def child_main(queue):
            from tokenspeed_worker import bytecode

            bytecode.inherit()  # as the engine's entry point does first
            import sys
            from tsw_no_bytecode_pkg import child_only

            queue.put({"dont_write": sys.dont_write_bytecode, "prefix": sys.pycache_prefix, "value": child_only.VALUE})
    """))
    if with_bytecode:
        assert compileall.compile_dir(str(pkg), quiet=1)
    return pkg


def _run(site, cache, *flags, env_extra=None, spawn=False):
    """A fresh interpreter (with `flags`) that calls use_bytecode_cache(cache, probe=PACKAGE), imports
    the package, optionally spawns a child that imports the rest; returns what it saw."""
    cache_arg = repr(None if cache is None else str(cache))
    script = textwrap.dedent(f"""
        import json, multiprocessing, sys
        from tokenspeed_worker.bytecode import use_bytecode_cache

        folder = use_bytecode_cache({cache_arg}, probe={PACKAGE!r})
        import {PACKAGE}
        seen = {{"folder": folder, "dont_write": sys.dont_write_bytecode, "prefix": sys.pycache_prefix}}
        if {spawn!r}:
            from {PACKAGE}.spawned import child_main

            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child_main, args=(queue,))
            proc.start()
            seen["child"] = queue.get(timeout=60)
            proc.join(60)
        print(json.dumps(seen))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "TOKENSPEED_WORKER_PYCACHE",
                                                            "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, *flags, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         cwd=str(site))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _compiled_under(folder, pkg):
    """The package's modules that have bytecode under the prefix folder (Python mirrors the source's
    absolute path there)."""
    mirror = os.path.join(str(folder), str(pkg).lstrip(os.sep))
    return sorted(name.split(".")[0] for name in os.listdir(mirror)) if os.path.isdir(mirror) else []


def test_an_install_without_bytecode_under_b_keeps_it_in_the_cache_folder_for_every_process(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "cache"
    pkg = _install(site)
    seen = _run(site, cache, "-B", spawn=True)
    folder = str(cache / "pycache")
    assert seen["folder"] == folder and seen["prefix"] == folder and seen["dont_write"] is False
    # the spawned child got -B from multiprocessing and the folder from the environment; it writes there too
    assert seen["child"] == {"dont_write": False, "prefix": folder, "value": 2}
    assert _compiled_under(folder, pkg) == ["__init__", "child_only", "spawned"]
    assert not (pkg / "__pycache__").exists()  # nothing beside the sources: -B is kept for them

    again = _run(site, cache, "-B")  # the next start: the same folder
    assert again["folder"] == folder


def test_a_read_only_install_without_bytecode_needs_the_cache_folder(tmp_path, monkeypatch):
    """Without -B, a site-packages Python may not write to (a read-only image; the tests run as root,
    who writes anywhere, hence os.access stood in for)."""
    from tokenspeed_worker import bytecode

    site = tmp_path / "site"
    pkg = _install(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    real_access = os.access
    assert not bytecode._bytecode_missing(PACKAGE)  # writable: Python writes it beside the sources itself
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(pkg) else real_access(path, mode))
    assert bytecode._bytecode_missing(PACKAGE)
    compileall.compile_dir(str(pkg), quiet=1)
    assert not bytecode._bytecode_missing(PACKAGE)  # read-only but compiled at install: nothing to do


def test_an_install_with_bytecode_or_free_to_write_it_is_left_alone(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "cache"
    _install(site, with_bytecode=True)
    seen = _run(site, cache, "-B")  # pip's default install: bytecode beside the sources
    assert seen == {"folder": None, "dont_write": True, "prefix": None}

    bare_site = tmp_path / "bare"
    _install(bare_site)
    seen = _run(bare_site, cache)  # no -B and a writable folder: Python writes it there itself
    assert seen == {"folder": None, "dont_write": False, "prefix": None}
    assert not (cache / "pycache").exists()


def test_a_prefix_the_user_set_is_kept_and_so_is_their_b(tmp_path):
    site, cache, theirs = tmp_path / "site", tmp_path / "cache", tmp_path / "theirs"
    _install(site)
    seen = _run(site, cache, "-B", env_extra={"PYTHONPYCACHEPREFIX": str(theirs)})
    assert seen == {"folder": None, "dont_write": True, "prefix": str(theirs)}
    assert not (cache / "pycache").exists()


def test_no_cache_folder_or_an_unwritable_one_changes_nothing(tmp_path):
    site = tmp_path / "site"
    _install(site)
    assert _run(site, None, "-B")["folder"] is None
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder should be")
    assert _run(site, blocked, "-B") == {"folder": None, "dont_write": True, "prefix": None}
