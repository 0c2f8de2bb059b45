"""Compiled programs kept between processes (ExecutableStore), built by key (Programs) and in
the background (BackgroundBuilder), checked against the plain jitted functions."""

import functools
import json
import subprocess
import sys
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.model_executor import programs as programs_module
from sgl_jax.model_executor.model_runner import ready_batch_limit
from sgl_jax.model_executor.programs import (
    BackgroundBuilder,
    ExecutableStore,
    Programs,
    fingerprint,
)
from sgl_jax.testing.parallel import cpu_devices_env

SETTINGS = {"page_size": 16, "dtype": "float32"}
RUN = uuid.uuid4().hex  # a user cache may outlive a run


@jax.tree_util.register_dataclass
@dataclass
class Rows:
    ids: np.ndarray  # i32[B]
    scale: np.ndarray  # f32[B]


def step(state, rows: Rows, bound: float = 1e6):
    """A donated state written at the rows' ids, and a per-row result. `bound` never clips
    (|scale| < 10) but is a constant of the program: another bound, another program."""
    scale = jnp.minimum(rows.scale, bound)
    return state.at[rows.ids].add(scale), scale * 2 + state[rows.ids]


def reference(state: np.ndarray, rows: Rows):
    new = state.copy()
    np.add.at(new, rows.ids, rows.scale)
    return new, rows.scale * 2 + state[rows.ids]


def rows(batch: int) -> Rows:
    rng = np.random.default_rng(batch)
    return Rows(rng.permutation(8)[:batch].astype(np.int32),
                rng.standard_normal(batch).astype(np.float32))


def programs_in(root, settings=SETTINGS) -> Programs:
    """`step` as a program of its own for each test directory: whether JAX's cache (on in
    a worker where an engine ran) already holds it never depends on the tests before."""
    store = ExecutableStore(root, fingerprint(settings))
    bound = 1e6 + zlib.crc32(f"{root}{RUN}".encode()) % 2**20
    return Programs("step", jax.jit(functools.partial(step, bound=bound), donate_argnums=(0,)),
                    store)


def run(programs: Programs, batch: int):
    state = np.arange(8, dtype=np.float32)
    expected = reference(state, rows(batch))
    out = programs(batch, jnp.asarray(state), rows(batch))
    np.testing.assert_allclose(np.asarray(out[0]), expected[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out[1]), expected[1], rtol=1e-6)


def test_a_second_store_loads_what_the_first_built(tmp_path):
    first = programs_in(tmp_path)
    run(first, 4)
    assert (first.traced, first.loaded) == (1, 0)
    second = programs_in(tmp_path)  # a later process: same settings, devices, versions
    run(second, 4)
    assert (second.traced, second.loaded) == (0, 1)


def test_a_changed_setting_jax_version_or_shape_loads_nothing(tmp_path, monkeypatch):
    run(programs_in(tmp_path), 4)
    changed_flag = programs_in(tmp_path, {**SETTINGS, "page_size": 32})
    run(changed_flag, 4)
    other_shape = programs_in(tmp_path)
    run(other_shape, 2)  # a key whose inputs differ: its own executable
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    other_jax = programs_in(tmp_path)
    run(other_jax, 4)
    assert [p.loaded for p in (changed_flag, other_shape, other_jax)] == [0, 0, 0]
    assert len({p._store.directory for p in (changed_flag, other_shape, other_jax)}) == 3


def test_a_changed_source_file_loads_nothing(tmp_path, monkeypatch):
    run(programs_in(tmp_path), 4)
    monkeypatch.setattr(programs_module, "source_digest", lambda: "edited")
    edited = programs_in(tmp_path)
    run(edited, 4)
    assert (edited.traced, edited.loaded) == (1, 0)


def test_a_torn_file_is_built_again(tmp_path, caplog):
    run(programs_in(tmp_path), 4)
    (stored,) = programs_in(tmp_path)._store.directory.glob("step-*.exe")
    stored.write_bytes(stored.read_bytes()[:100])
    again = programs_in(tmp_path)
    run(again, 4)
    assert (again.traced, again.loaded) == (1, 0) and "unreadable" in caplog.text


def test_old_fingerprints_are_evicted_past_the_size_limit(tmp_path):
    stores = [ExecutableStore(tmp_path, fingerprint({"n": n})) for n in range(3)]
    for store in stores:
        (store.directory / "big.exe").write_bytes(b"x" * 1000)
        time.sleep(0.01)  # distinct modification times: 0 is the least recently used
    programs_module.evict(tmp_path, keep=stores[2].directory, limit=2500)
    assert [s.directory.exists() for s in stores] == [False, True, True]


def test_the_builder_runs_jobs_once_resumed_smallest_first_once_each_and_stops():
    builder, done, gate = BackgroundBuilder(), [], threading.Event()
    for size in (8, 2, 4, 2):
        builder.submit(size, lambda size=size: done.append(size), priority=size)
    time.sleep(0.1)
    assert not done  # paused until resumed
    builder.resume()
    assert builder.wait_idle(timeout=10) and done == [2, 4, 8]
    builder.submit("failing", lambda: 1 / 0)
    assert builder.wait_idle(timeout=10) and isinstance(builder.failed["failing"],
                                                         ZeroDivisionError)
    gate.clear()
    builder.submit("held", gate.wait, priority=0)
    builder.submit("dropped", lambda: done.append("dropped"), priority=1)
    threading.Timer(0.2, gate.set).start()
    builder.stop()
    assert "dropped" not in done


@pytest.mark.parametrize("built, wanted, limit, queued", [
    ({1}, 8, 1, [2, 4, 8]),  # only the smallest: the rest up to 8 go to the builder
    ({1, 2}, 3, 2, [4]),  # 3 requests need bucket 4
    ({1, 2, 4, 8}, 8, 8, []),
    ({1, 4}, 4, 1, [2]),  # bucket 4 is built but 2 is not: batches of 2..4 wait for it
    (set(), 8, 8, []),  # not even the smallest: everything compiles when due
])
def test_ready_batch_limit(built, wanted, limit, queued):
    class Recorder:
        def __init__(self):
            self.jobs = []

        def submit(self, job_id, build, priority):
            self.jobs.append(job_id[1])

    recorder = Recorder()
    got = ready_batch_limit((1, 2, 4, 8), wanted, recorder, lambda s: s in built,
                            lambda s: None, "test")
    assert got == limit and recorder.jobs == queued
    assert ready_batch_limit((1, 2, 4, 8), wanted, None, lambda s: s in built,
                             lambda s: None, "test") == 8


def test_an_executable_from_jaxs_own_cache_is_not_stored(tmp_path):
    """XLA:CPU serializes an executable its persistent cache handed back without some of its
    functions' code: such a build is used but never stored."""
    class FromJaxCache:
        def __init__(self, jitted):
            self.jitted = jitted

        def lower(self, *args, **kw):
            lowered = self.jitted.lower(*args, **kw)

            class Lowered:
                def compile(self):
                    jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
                    return lowered.compile()
            return Lowered()

    store = ExecutableStore(tmp_path, fingerprint(SETTINGS))
    run(Programs("step", FromJaxCache(jax.jit(step, donate_argnums=(0,))), store), 4)
    assert not list(store.directory.glob("step-*.exe"))
    run(programs_in(tmp_path), 4)  # compiled here: stored
    assert len(list(store.directory.glob("step-*.exe"))) == 1


def run_script(script: str, *args, env: dict[str, str] | None = None) -> str:
    """`script`'s standard output, run in a Python process of its own (JAX decides once per
    process whether it reads its cache; a bad load kills the process that loads it)."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def printed_json(stdout: str):
    return json.loads(stdout.strip().splitlines()[-1])


STALE_ENTRY = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from sgl_jax.cache import enable_compilation_cache
from sgl_jax.model_executor.programs import ExecutableStore, Programs, abstract, fingerprint
sys.path.insert(0, sys.argv[3])  # this file's directory
from test_programs import SETTINGS, reference, rows, step

root = Path(sys.argv[1])
enable_compilation_cache(root / "xla")
state = np.arange(8, dtype=np.float32)
if sys.argv[2] == "plain":  # another path (an older version, the store off) compiles the
    # same program, lowered the same way, into JAX's cache
    jitted = jax.jit(step, donate_argnums=(0,))
    jitted.lower(*abstract((jnp.asarray(state), rows(4)))).compile()
    sys.exit(0)
programs = Programs("step", jax.jit(step, donate_argnums=(0,)),
                    ExecutableStore(root / "store", fingerprint(SETTINGS)))
out = programs(4, jnp.asarray(state), rows(4))
np.testing.assert_allclose(np.asarray(out[1]), reference(state, rows(4))[1], rtol=1e-6)
print(json.dumps([programs.traced, programs.loaded]))
"""


def test_a_program_jaxs_cache_already_holds_is_stored_and_loaded_next_time(tmp_path):
    """An entry another path wrote for the same program in JAX's cache is read back
    (engines that share programs share that cache) but cannot be stored: it once kept the
    program out of the store for good (each start traced it again). Now the store notes it,
    the next start compiles it afresh and stores it, and the one after loads it. Each run in
    a process of its own (JAX decides once per process whether it reads its cache)."""
    here = Path(__file__).parent

    def run_in_process(kind: str) -> list[int]:
        return printed_json(run_script(STALE_ENTRY, tmp_path, kind, here))

    run_script(STALE_ENTRY, tmp_path, "plain", here)
    assert any((tmp_path / "xla").glob("jit_step-*")), "the other path's entry is not there"
    assert run_in_process("store") == [1, 0]  # traced, found in JAX's cache: not stored
    store = next((tmp_path / "store").iterdir())
    assert not list(store.glob("step-*.exe")) and list(store.glob("step-*.in-jax-cache"))
    assert run_in_process("store") == [1, 0]  # traced and compiled afresh, and stored
    assert list(store.glob("step-*.exe")) and not list(store.glob("step-*.in-jax-cache"))
    assert run_in_process("store") == [0, 1]  # the next start loads it


SUB_MESH = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from sgl_jax.model_executor.programs import ExecutableStore, Programs, fingerprint

def doubled_sum(x):
    return jnp.sum(x * 2.0, axis=0)

x_host = np.arange(32, dtype=np.float32).reshape(8, 4)
counts = []
for ids in ([2, 3], [3, 2], [0, 1]):  # one shape on other devices: other programs
    mesh = Mesh(np.array([jax.devices()[i] for i in ids]), ("tp",))
    x = jax.device_put(jnp.asarray(x_host), NamedSharding(mesh, P("tp")))
    for _ in range(2):  # the second store stands for a later process
        programs = Programs("sum", jax.jit(doubled_sum),
                            ExecutableStore(Path(sys.argv[1]), fingerprint({"n": 1})))
        out = programs("k", x)
        np.testing.assert_allclose(np.asarray(out), (x_host * 2).sum(0), rtol=1e-6)
        assert {d.id for d in out.sharding.device_set} <= set(ids)
        counts.append([programs.traced, programs.loaded])
print(json.dumps(counts))
"""


def test_a_program_of_a_sub_mesh_loads_onto_its_own_devices(tmp_path):
    """Tensor parallelism narrower than the machine: loaded onto every device, a stored
    program of two devices aborted the process in XLA; a mesh of the same shape on other
    devices is a program of its own."""
    counts = printed_json(run_script(SUB_MESH, tmp_path, env=cpu_devices_env(8)))
    assert counts == [[1, 0], [0, 1]] * 3


LINEAR_ALGEBRA = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from sgl_jax.model_executor.programs import ExecutableStore, Programs, fingerprint

def solve(a, b):
    return jax.scipy.linalg.solve_triangular(a, b, lower=True)

a = np.tril(np.random.default_rng(0).standard_normal((6, 6))).astype(np.float32) + 4 * np.eye(6,
    dtype=np.float32)
b = np.ones((6, 2), np.float32)
programs = Programs("solve", jax.jit(solve), ExecutableStore(Path(sys.argv[1]),
                                                             fingerprint({"n": 1})))
out = programs("k", jnp.asarray(a), jnp.asarray(b))
np.testing.assert_allclose(np.asarray(out), np.linalg.solve(a, b), rtol=1e-5)
print(json.dumps([programs.traced, programs.loaded]))
"""


def test_a_loaded_linear_algebra_program_runs_in_a_process_that_traced_nothing(tmp_path):
    """XLA:CPU's triangular solve calls LAPACK through pointers JAX sets when it first lowers
    one: loaded by a process that had lowered none, it called a null pointer (Qwen3-Next's
    decode step on a second start)."""
    assert printed_json(run_script(LINEAR_ALGEBRA, tmp_path)) == [1, 0]
    assert printed_json(run_script(LINEAR_ALGEBRA, tmp_path)) == [0, 1]
