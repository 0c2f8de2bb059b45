"""The process's memory mappings (and resident memory), and a warning before warm-up would
exhaust the mappings.

XLA:CPU maps the machine code of every compiled kernel into the process apart (code,
read-only data and data: about three mappings a kernel, a few hundred a step program), and
Linux allows a process `vm.max_map_count` mappings (65530 by default). Past that, the next
compilation fails inside LLVM and the process dies with a segmentation fault. Warm-up compiles
every bucket up front, so it is where a server would meet the limit: `WarmupForecast` projects
the count after each compiled program and says what to do while there is still room.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_MAPS = Path("/proc/self/maps")
_LIMIT = Path("/proc/sys/vm/max_map_count")
_STATUS = Path("/proc/self/status")
NEAR_LIMIT = 0.75  # share of the limit a projection may reach without a warning


def mapping_count() -> int | None:
    """This process's memory mappings now (None where /proc is not Linux's)."""
    try:
        with _MAPS.open("rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def resident_bytes() -> int | None:
    """This process's resident memory now (None where /proc is not Linux's)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError):
        pass
    return None


def return_free_heap() -> None:
    """Hand the C heap's free pages back to the system. glibc keeps freed memory for reuse:
    ten tiny engines built and shut down in a row grew the process by 40% without this and
    by under 5% with it. Elsewhere (not glibc) nothing happens."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mapping_limit() -> int | None:
    """The kernel's limit on one process's mappings (None where it cannot be read)."""
    try:
        return int(_LIMIT.read_text())
    except (OSError, ValueError):
        return None


class WarmupForecast:
    """Follows a warm-up of `programs` programs: after each compiled one, the mappings the
    rest would add at the mean so far; warns once when the total would come near the limit."""

    def __init__(self, programs: int, *, limit: int | None = None):
        self.programs = programs
        self.limit = mapping_limit() if limit is None else limit
        self.start = mapping_count()
        self.done = 0
        self.warned = False

    def compiled(self, count: int = 1) -> None:
        self.done += count
        now = mapping_count()
        if self.warned or not self.limit or self.start is None or now is None:
            return
        projected = self.projected(now)
        if projected >= NEAR_LIMIT * self.limit:
            self.warned = True
            logger.warning(
                "warming up %d compiled programs will take about %d of the %d memory mappings "
                "this process may have (vm.max_map_count): XLA:CPU maps each compiled kernel "
                "apart, and the process crashes past the limit. Compile fewer programs (fewer "
                "--precompile-bs-paddings or a lower --max-running-requests, fewer "
                "--precompile-token-paddings, --no-speculative-adaptive) or raise the limit "
                "(sudo sysctl -w vm.max_map_count=262144)", self.programs, projected, self.limit)

    def projected(self, now: int) -> int:
        """Mappings once every program is compiled, at the mean cost so far."""
        per_program = (now - self.start) / max(self.done, 1)
        return int(now + per_program * max(self.programs - self.done, 0))
