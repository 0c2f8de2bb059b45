"""Host-side allocation of recurrent-state slots (hybrid models: one slot per running request
holds its Gated DeltaNet states in every linear layer). Slot 0 is never handed out: it is the
null slot of padding rows. Plain Python, like the page allocator."""

from __future__ import annotations

NULL_SLOT = 0


class OutOfStateSlotsError(RuntimeError):
    """Raised when a request needs a state slot and none is free."""


class StateSlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"a state pool needs at least 2 slots (one is reserved), "
                             f"got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, NULL_SLOT, -1))  # a stack: low ids first
        self._in_use: set[int] = set()

    @property
    def capacity(self) -> int:
        """Slots that can ever be allocated (all but the null slot)."""
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfStateSlotsError(f"all {self.capacity} recurrent-state slots are in use")
        slot = self._free.pop()
        self._in_use.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._in_use:
            raise ValueError(f"state slot {slot} is not allocated (double free?)")
        self._in_use.remove(slot)
        self._free.append(slot)
