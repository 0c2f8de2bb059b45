"""Settings for every test process."""

import jax

# Engines built inside test processes compile without JAX's persistent compilation cache.
# XLA:CPU aborted or segfaulted while loading cached speculative round programs in long-lived
# test workers (which had built engines of the same programs before); a process that loads
# them once, like a server's, reads them fine. Servers started as subprocesses keep the cache.
jax.config.update("jax_enable_compilation_cache", False)
