"""Recurrent-state slots on the host (no JAX): the allocator, and the cache manager handing a
slot to each admitted request and taking it back on release (finish, abort, retraction)."""

import subprocess
import sys

import pytest

from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.mem_cache.state_slots import NULL_SLOT, OutOfStateSlotsError, StateSlotAllocator
from sgl_jax.sampling_params import SamplingParams
from sgl_jax.scheduler.cache_manager import CacheManager
from sgl_jax.scheduler.decode_manager import DecodeManager
from sgl_jax.scheduler.prefill_manager import PrefillLimits, PrefillManager
from sgl_jax.scheduler.req import Req


def test_null_slot_is_never_handed_out_and_slots_are_reused():
    slots = StateSlotAllocator(4)
    taken = [slots.allocate() for _ in range(3)]
    assert sorted(taken) == [1, 2, 3] and NULL_SLOT not in taken
    assert slots.num_free == 0
    with pytest.raises(OutOfStateSlotsError, match="all 3 recurrent-state slots are in use"):
        slots.allocate()
    slots.free(taken[1])
    assert slots.allocate() == taken[1]


def test_double_free_and_tiny_pools_are_errors():
    slots = StateSlotAllocator(2)
    slot = slots.allocate()
    slots.free(slot)
    with pytest.raises(ValueError, match="double free"):
        slots.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        slots.free(NULL_SLOT)
    with pytest.raises(ValueError, match="at least 2 slots"):
        StateSlotAllocator(1)


def test_the_allocator_needs_no_jax():
    code = ("import sys; sys.modules['jax'] = None\n"
            "from sgl_jax.mem_cache.state_slots import StateSlotAllocator\n"
            "StateSlotAllocator(3).allocate()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def request(rid: str, length: int) -> Req:
    return Req(rid=rid, prompt_ids=list(range(1, length + 1)), params=SamplingParams(),
               seed=0, eos_ids=frozenset(), context_len=64, detokenizer=None)


def test_requests_hold_a_slot_from_admission_to_release():
    """Admission takes a slot; a full pool of slots holds back admission; retraction and
    release give slots back, and a retracted request gets a fresh slot when readmitted."""
    slots = StateSlotAllocator(3)  # two requests at a time
    cache = CacheManager(PageAllocator(9), None, 4, states=slots)
    prefill = PrefillManager(cache, PrefillLimits(max_prefill_tokens=64, chunk_size=64,
                                                  max_running_requests=8))
    reqs = [request(str(i), 8) for i in range(3)]
    for req in reqs:
        prefill.add(req)
    running: list[Req] = []
    batch = prefill.schedule(running)
    assert [r.rid for r, _ in batch] == ["0", "1"] and len(prefill.waiting) == 1
    assert sorted(r.state_slot for r in running) == [1, 2] and slots.num_free == 0
    for req in running:  # prompts done, one token out: decoding needs a third page each
        req.kv_len, req.output_ids = 8, [5]
    retracted = []
    decode = DecodeManager(cache, lambda r: (cache.release(r), retracted.append(r)))
    cache.allocator.allocate(cache.allocator.num_free - 1)  # one page left: room for one
    assert [r.rid for r in decode.schedule(running)] == ["0"]
    assert retracted == [reqs[1]] and reqs[1].state_slot == NULL_SLOT and slots.num_free == 1
    cache.release(reqs[0])
    assert reqs[0].state_slot == NULL_SLOT and slots.num_free == 2
    cache.release(reqs[0])  # releasing twice frees nothing twice
    assert slots.num_free == 2


def test_a_request_that_cannot_start_gives_its_slot_back():
    slots = StateSlotAllocator(3)
    cache = CacheManager(PageAllocator(2), None, 4, states=slots)  # one page of 4 tokens
    prefill = PrefillManager(cache, PrefillLimits(max_prefill_tokens=64, chunk_size=64,
                                                  max_running_requests=8))
    prefill.add(request("long", 9))
    assert prefill.schedule([]) == [] and slots.num_free == 2
    assert prefill.waiting[0].state_slot == NULL_SLOT
