"""Settings for every test process."""

import gc

import jax
import pytest

# Engines built inside test processes compile without JAX's persistent compilation cache.
# XLA:CPU aborted or segfaulted while loading cached speculative round programs in long-lived
# test workers (which had built engines of the same programs before); a process that loads
# them once, like a server's, reads them fine. Servers started as subprocesses keep the cache.
jax.config.update("jax_enable_compilation_cache", False)


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
