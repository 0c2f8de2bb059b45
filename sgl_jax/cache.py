"""The per-user cache directory: converted checkpoint metadata and compiled programs live here."""

from __future__ import annotations

import os
from pathlib import Path

# Least recently used programs are evicted past this size.
COMPILATION_CACHE_BYTES = 16 * 2**30


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/sgl-jax, or ~/.cache/sgl-jax."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sgl-jax"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Keep every compiled XLA program in `path` (default: <user cache>/xla), so the next
    process that compiles the same program loads it instead. Takes effect only if nothing
    was compiled in this process yet (JAX opens its cache once)."""
    import jax

    directory = Path(path) if path else user_cache_dir() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Every step program is worth keeping: the smallest still costs a second to compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A size limit makes JAX read and write entries under a file lock. Without it, a
    # process can read an entry another one (a replica, a test worker) is still writing,
    # and a torn executable aborts the reader.
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)
    date_undated_entries(directory)
    return directory


def date_undated_entries(directory: Path) -> None:
    """Give an access time to every entry written without one (by a process without the size
    limit, such as an older sgl-jax). JAX's eviction reads every entry's access time before
    it writes a new one, so one undated entry made every later write fail. Undated entries
    count as the oldest: they are evicted first."""
    if not directory.is_dir():
        return
    # Looking at thousands of entries costs a start 0.2 s: skip it while the directory is
    # as the last pass left it (an entry added or removed changes its mtime). The stamp
    # lives beside the directory, where JAX's cache never lists it.
    stamp = directory.with_name(directory.name + ".dated")
    if stamp.is_file() and stamp.read_text() == str(directory.stat().st_mtime_ns):
        return
    for entry in directory.glob("*-cache"):
        access_time = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
        if not access_time.exists():
            access_time.write_bytes((0).to_bytes(8, "little"))  # JAX's format: ns, LE
    stamp.write_text(str(directory.stat().st_mtime_ns))
