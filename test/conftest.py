"""Settings for every test process."""

import gc
import os

from sgl_jax.testing.parallel import FAST_COMPILE_FLAGS, with_xla_flags

# Before any backend starts (XLA reads its flags then); subprocesses inherit them.
os.environ["XLA_FLAGS"] = with_xla_flags(os.environ.get("XLA_FLAGS", ""), *FAST_COMPILE_FLAGS)

import jax  # noqa: E402
import pytest  # noqa: E402

# Engines built inside test processes use JAX's persistent compilation cache, as servers do
# (in the user cache dir): the tests build many engines of the same tiny shapes. XLA:CPU once
# aborted loading cached programs in long-lived test workers; that was the memory-mapping
# limit, which the module-level release below keeps the workers away from. Measured on the
# 2-core CI machine (docs/benchmarks/cpu.md, "The test suite"): four engine-heavy modules took
# 1194 s without the cache, 915 s with an empty one and 230 s with a warm one.


def pytest_configure(config):
    """One torch thread per test process: the oracles' second thread spins against the other
    test worker on the 2-core CI machine (fitting a DFlash head took 30x longer)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each compiled program maps its JIT code into the process, and the kernel allows
    65530 mappings (XLA:CPU aborts past them). Module-level jitted functions keep every
    shape they compiled: release them, and collect dead engines, after each test module,
    since a worker runs many modules."""
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()


# The modules that take minutes on the 2-core CI machine, longest first (measured with
# --durations). With --no-loadscope-reorder xdist hands whole modules to its workers in
# collection order (by default it starts those with the most tests, and these few-test
# modules came last), so these start first and the run does not end on one long module
# while the other worker idles.
LONG_MODULES = (
    "speculative/test_adaptive_speculation.py", "speculative/test_spec_overlap.py",
    "speculative/test_speculative_engine.py", "speculative/test_hybrid_speculative.py",
    "parallel/test_tp_native.py", "benchmark/test_bench_speculative.py",
    "parallel/test_tp_fa.py", "entrypoints/test_structured_outputs.py",
    "parallel/test_router.py", "entrypoints/test_client_libraries.py",
    "benchmark/test_bench_round_parts.py", "test_examples.py", "models/test_qwen3_next.py",
    "training/test_train_demo.py", "training/test_trainer.py",
    "speculative/test_dflash_engine.py", "test_lowering.py", "models/test_quantization.py",
    "parallel/test_lowering_tp.py",
)


def pytest_collection_modifyitems(items):
    def start_rank(item) -> int:
        path = item.path.as_posix()
        return next((rank for rank, module in enumerate(LONG_MODULES)
                     if path.endswith(f"test/{module}")), len(LONG_MODULES))

    items.sort(key=start_rank)  # stable: every module's tests keep their order
