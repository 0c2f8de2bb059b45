"""Compiled programs by key, kept between processes, and built in the background.

JAX's persistent compilation cache keeps what XLA compiled but not the tracing and lowering
before it: about half a second a step program of the demo model on a CPU, every start.
`ExecutableStore` keeps the compiled executables themselves (serialized), in a directory
named by everything that changes a program but its inputs' shapes (`fingerprint`: the
flags, the model's config, the devices, the JAX and sgl_jax versions, sgl_jax's source);
each executable is named by its inputs' shapes, dtypes and shardings. A start that finds a
program there loads it without tracing anything.

`Programs` holds one jitted function's executables by a key the caller names (a bucket's
shape), building what is missing: loaded from the store, else traced, lowered, compiled and
stored. `BackgroundBuilder` builds on its own thread, smallest key first, so a server can
answer while its larger buckets compile; the serving thread asks `Programs.get` and uses
only what is built.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import heapq
import itertools
import json
import logging
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

# Least recently used fingerprints' directories go past this size.
STORE_BYTES = 8 * 2**30
_PACKAGE = Path(__file__).resolve().parents[1]
# An executable JAX loaded from its own persistent cache serializes without the machine code
# of some of its functions on XLA:CPU ("Function ... not found" when the copy runs), so only
# executables compiled here are stored. A program found in JAX's cache (compiled by another
# fingerprint: another flag, an older sgl_jax, the store off) is used, and the store notes
# it; the next build of that program for this store compiles under a JAX cache key of its
# own (_install_store_key_hook), neither reading nor writing JAX's cache, and stores it. So
# engines that share programs share JAX's cache (the test suite builds hundreds), and a
# start never keeps tracing a program the store could hold.
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_compiling = threading.local()


def _note_cache_hit(event: str, **_) -> None:
    if event == _CACHE_HIT:
        _compiling.cache_hit = True


jax.monitoring.register_event_listener(_note_cache_hit)


def _install_store_key_hook() -> None:
    """JAX hashes its cache key hook's string into every key: this thread's compiles for
    the store add a mark of their own. Where JAX's internals differ, the hit check above
    still keeps unstorable executables out."""
    try:
        from jax._src import cache_key
    except ImportError:
        return
    previous = getattr(cache_key, "custom_hook", None)
    if previous is None:
        return

    def hook() -> str:
        return previous() + ("sgl-jax executable store"
                             if getattr(_compiling, "for_store", False) else "")

    cache_key.custom_hook = hook


_install_store_key_hook()


@contextlib.contextmanager
def outside_jax_cache() -> Iterator[None]:
    """This thread's compiles under a key of their own, so JAX's cache has nothing for them,
    and not written to it (its minimum compile time raised past any)."""
    try:
        from jax._src import config as jax_config

        no_writes = jax_config.persistent_cache_min_compile_time_secs(float("inf"))
    except (ImportError, AttributeError, TypeError):
        no_writes = contextlib.nullcontext()
    _compiling.for_store = True
    try:
        with no_writes:
            yield
    finally:
        _compiling.for_store = False


def source_digest() -> str:
    """A digest of sgl_jax's Python source: a changed line may change any program."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What every program of a process depends on besides its inputs' shapes: `settings`
    (the flags and model identity the caller names) plus the devices and the software."""
    import jaxlib

    return {"settings": dict(settings), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "devices": [(d.platform, d.device_kind, d.id, d.process_index)
                        for d in jax.devices()],
            "sgl_jax_source": source_digest()}


def abstract(tree: Any) -> Any:
    """Arrays (device or host) as ShapeDtypeStructs, device arrays with their sharding: what
    lowering reads of them, safe to read from any thread (a donated array keeps its shape)."""
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                        weak_type=x.weak_type)
        if isinstance(x, (np.ndarray, np.generic)):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
        return x
    return jax.tree.map(one, tree)


def signature(args: tuple, static: Mapping[str, Any]) -> str:
    """A digest of a call's abstract inputs (`abstract`'s) and static arguments: two calls
    with the same signature run the same executable."""
    leaves, treedef = jax.tree.flatten(args)
    described = [str(treedef), repr(sorted(static.items()))]
    for leaf in leaves:
        described.append(f"{leaf.shape}{leaf.dtype}{leaf.weak_type}{leaf.sharding}"
                         f"{_device_ids(leaf.sharding)}"
                         if isinstance(leaf, jax.ShapeDtypeStruct) else repr(leaf))
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:32]


def _device_ids(sharding: Any) -> tuple[int, ...]:
    """The devices a sharding places on, in order: its text names a mesh's shape only, and
    the same shape on other devices is another program."""
    if sharding is None:
        return ()
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and hasattr(mesh, "device_ids"):
        return tuple(int(i) for i in np.asarray(mesh.device_ids).flat)
    return tuple(sorted(d.id for d in sharding.device_set))


def _initialize_lapack() -> None:
    """XLA:CPU runs linear algebra (a triangular solve, in Qwen3-Next's gated delta rule)
    through LAPACK functions that JAX looks up when it first lowers such an operation: a
    process that only loads the program would call a null pointer (as JAX's own
    deserialization of exported programs knows)."""
    try:
        from jax._src.lax import linalg
    except ImportError:
        return
    initialize = getattr(linalg, "initialize_lapack", None)
    if initialize is not None:
        initialize()


class ExecutableStore:
    """Serialized executables of one fingerprint, in `root`/<digest of the fingerprint>/."""

    def __init__(self, root: Path, fingerprint: Mapping[str, Any]):
        text = json.dumps(fingerprint, sort_keys=True, default=str)
        self.directory = Path(root) / hashlib.sha256(text.encode()).hexdigest()[:24]
        self.new = not self.directory.is_dir()
        self.directory.mkdir(parents=True, exist_ok=True)
        os.utime(self.directory)  # marks it used, for evict()
        (self.directory / "fingerprint.json").write_text(text)
        evict(Path(root), keep=self.directory)

    def load(self, name: str, signature: str) -> jax.stages.Compiled | None:
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(name, signature)
        _initialize_lapack()
        try:
            payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
            by_id = {d.id: d for d in jax.devices()}
            # Loaded onto all devices, a program of a sub-mesh (tensor parallelism narrower
            # than the machine) aborts the process in XLA: it runs on the devices it was
            # compiled for.
            devices = [by_id[i] for i in device_ids]
            return deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except FileNotFoundError:
            return None
        except Exception as exc:  # a torn or foreign file: build it again
            logger.warning("executable %s unreadable (%s): building it again", path.name, exc)
            return None

    def note_found_in_jax_cache(self, name: str, signature: str) -> None:
        """The program came from JAX's cache, unstorable: the next build compiles it afresh."""
        self._path(name, signature).with_suffix(".in-jax-cache").touch()

    def found_in_jax_cache(self, name: str, signature: str) -> bool:
        return self._path(name, signature).with_suffix(".in-jax-cache").exists()

    def save(self, name: str, signature: str, compiled: jax.stages.Compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        try:
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            blob = pickle.dumps((*serialize(compiled), device_ids))
        except Exception as exc:  # some backends cannot serialize: serve without keeping it
            logger.info("executable %s not kept: %s", name, exc)
            return
        path = self._path(name, signature)
        partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_bytes(blob)
        partial.replace(path)  # readers see a whole file or none
        path.with_suffix(".in-jax-cache").unlink(missing_ok=True)

    def read_json(self, name: str) -> dict[str, Any]:
        """A small record kept beside the executables (e.g. their measured timings)."""
        try:
            return json.loads((self.directory / f"{name}.json").read_text())
        except (OSError, ValueError):
            return {}

    def write_json(self, name: str, record: Mapping[str, Any]) -> None:
        path = self.directory / f"{name}.json"
        partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_text(json.dumps(record, sort_keys=True))
        partial.replace(path)

    def _path(self, name: str, signature: str) -> Path:
        return self.directory / f"{name}-{signature}.exe"


def evict(root: Path, *, keep: Path, limit: int = STORE_BYTES) -> None:
    """Remove the least recently used fingerprints' directories while `root` holds more than
    `limit` bytes (never `keep`, the one in use). Other processes may be writing or removing
    directories meanwhile: what vanishes is skipped."""
    sizes = {}
    for directory in root.iterdir():
        try:
            sizes[directory] = (directory.stat().st_mtime,
                                sum(f.stat().st_size for f in directory.iterdir()))
        except OSError:
            continue
    total = sum(size for _, size in sizes.values())
    for directory, (_, size) in sorted(sizes.items(), key=lambda item: item[1][0]):
        if total <= limit:
            return
        if directory == keep:
            continue
        shutil.rmtree(directory, ignore_errors=True)
        total -= size


class Programs:
    """The executables of one jitted function, by the caller's key (which must determine the
    inputs' shapes: the other inputs, parameters and state, never change)."""

    def __init__(self, name: str, jitted: Callable, store: ExecutableStore | None):
        self.name = name
        self._jitted = jitted
        self._store = store
        self._built: dict[Hashable, jax.stages.Compiled] = {}
        self._locks: dict[Hashable, threading.Lock] = {}
        self._guard = threading.Lock()
        self.loaded = self.traced = 0  # executables loaded from the store, and traced here

    def get(self, key: Hashable) -> jax.stages.Compiled | None:
        """The key's executable if built (never builds)."""
        return self._built.get(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._built

    def __call__(self, key: Hashable, *args, **static):
        """Run the key's executable on `args`, building it first if nothing has."""
        program = self._built.get(key) or self.build(key, *args, **static)
        return program(*args)

    def build(self, key: Hashable, *args, **static) -> jax.stages.Compiled:
        """The key's executable, from the store or traced and compiled now (`args` as a
        call's, or ShapeDtypeStructs: only shapes, dtypes and shardings are read). Two threads
        asking for the same key build it once."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key in self._built:
                return self._built[key]
            start = time.perf_counter()
            name = f"{self.name}[{_key_text(key)}]"
            args = abstract(args)
            digest = signature(args, static) if self._store else ""
            program = self._store.load(self.name, digest) if self._store else None
            if program is not None:
                self.loaded += 1
                logger.debug("Loaded %s from the executable store", name)
            else:
                lowered = self._jitted.lower(*args, **static)
                afresh = self._store is not None and self._store.found_in_jax_cache(
                    self.name, digest)
                # Only the compile's own hit counts: tracing may run small eager programs
                # that JAX's cache does hold.
                _compiling.cache_hit = False
                with outside_jax_cache() if afresh else contextlib.nullcontext():
                    program = lowered.compile()
                self.traced += 1
                if self._store and _compiling.cache_hit:
                    self._store.note_found_in_jax_cache(self.name, digest)
                elif self._store:
                    self._store.save(self.name, digest, program)
                logger.info("Built %s in %.1f s (%s)", name, time.perf_counter() - start,
                            "not in the executable store" if self._store
                            else "executable store off")
            self._built[key] = program
            return program


def build_in_pairs(builds: Sequence[Callable[[], object]]) -> None:
    """Run `builds` two at a time: loading a kept executable and compiling both leave the
    GIL to the other thread."""
    with ThreadPoolExecutor(2) as pool:
        for _ in pool.map(lambda build: build(), builds):
            pass


def _key_text(key: Hashable) -> str:
    parts = key if isinstance(key, tuple) else (key,)
    return ", ".join(str(p) for p in parts)


# The most the interpreter's exit waits for a build a stopped builder left running (a stuck
# job must not hang it).
EXIT_WAIT_S = 600.0


class BackgroundBuilder:
    """A thread that runs build jobs, the lowest priority number first; a job asked for
    twice runs once. It starts paused (`resume()`: tracing holds the GIL, so it would slow
    the start it follows); `stop()` drops what has not started and waits a while for the
    job running."""

    def __init__(self, name: str = "program-builder"):
        self._jobs: list[tuple[Any, int, Hashable, Callable[[], None]]] = []
        self._queued: set[Hashable] = set()
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._stopped = False
        self.failed: dict[Hashable, BaseException] = {}
        self._busy = False
        self._paused = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job_id: Hashable, build: Callable[[], None], priority: Any = 0) -> None:
        with self._wake:
            if self._stopped or job_id in self._queued:
                return
            self._queued.add(job_id)
            heapq.heappush(self._jobs, (priority, next(self._order), job_id, build))
            self._wake.notify()

    def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._wake.notify()

    def idle(self) -> bool:
        """No job waiting or running."""
        return self.pending() == 0

    def pending(self) -> int:
        """Jobs waiting or running."""
        with self._wake:
            return len(self._jobs) + int(self._busy)

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.idle():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stop(self, timeout: float = 60.0) -> None:
        """Drop the queue and wait up to `timeout` s for the running job. A job still running
        then is left to its thread (the executable store writes whole files only: nothing
        half-built is kept), so a stuck or long compile never holds a stopping server. The
        interpreter's normal exit still waits for it: a thread inside XLA must not meet the
        interpreter's finalization, which aborts the process; a server stopped by a signal
        exits without either."""
        with self._wake:
            self._stopped = True
            self._jobs.clear()
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.info("A background build is still running; shutdown goes on without it")
            atexit.register(self._thread.join, EXIT_WAIT_S)

    def _run(self) -> None:
        while True:
            with self._wake:
                while (self._paused or not self._jobs) and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                _, _, job_id, build = heapq.heappop(self._jobs)
                self._busy = True
            try:
                build()
            except BaseException as exc:  # the serving thread builds it when it must
                self.failed[job_id] = exc
                logger.warning("background build %s failed: %r", job_id, exc)
            finally:
                with self._wake:
                    self._busy = False
