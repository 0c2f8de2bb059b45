"""Which batch bucket a speculative round pads to, and which buckets a burst has built, while
a CPU server builds its larger buckets in the background: the bucket a burst needs is built
first, every bucket's base programs before any drafted shape, and a batch pads to the
smallest usable bucket that fits it."""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace

import pytest

from sgl_jax.model_executor.forward_batch import Buckets
from sgl_jax.model_executor.programs import BackgroundBuilder
from sgl_jax.speculative import spec_warmup
from sgl_jax.speculative.policy.shape_policy import PLAIN
from sgl_jax.speculative.spec_config import TreeShape

SIZES = (1, 2, 4, 8)
SHAPES = (PLAIN, TreeShape(3, 1, 4), TreeShape(3, 4, 8))  # an adaptive menu: two drafted


class RecordingBuilder:
    def __init__(self):
        self.jobs: list[tuple[int, str, int]] = []  # (priority, job, bucket)

    def submit(self, job_id, build, priority):
        self.jobs.append((priority, *job_id))

    def build_order(self) -> list[tuple[str, int]]:
        """(base programs: "bucket", or a drafted "shape", batch bucket), the shapes of one
        bucket named once."""
        return list(dict.fromkeys((job.split()[1], bucket)
                                  for _, job, bucket, *_ in sorted(self.jobs)))


def fake_spec(usable: set[int], builder: RecordingBuilder | None, built: set[int] = frozenset(),
              monkeypatch=None) -> SimpleNamespace:
    """A SpecRunner whose buckets `usable` may serve, `built` of them with every shape."""
    monkeypatch.setattr(spec_warmup, "bucket_usable", lambda spec, size: size in usable)
    monkeypatch.setattr(spec_warmup, "bucket_built", lambda spec, size: size in built)
    buckets = Buckets((64,), SIZES, context_len=128, page_size=16)
    return SimpleNamespace(buckets=buckets, target=SimpleNamespace(builder=builder),
                           shapes=SHAPES)


@pytest.mark.parametrize("usable, wanted, limit, order", [
    # the burst's bucket first, then those below; drafted shapes behind every base
    ({1}, 6, 1, [("bucket", 8), ("bucket", 2), ("bucket", 4),
                 ("shape", 8), ("shape", 2), ("shape", 4)]),
    ({1, 8}, 3, 8, [("bucket", 4), ("bucket", 2), ("shape", 4),
                    ("shape", 2)]),  # 3 pad to 8 meanwhile: no wait for 4
    ({1, 2}, 2, 2, []),
    (set(), 8, 8, []),  # not even the smallest: everything compiles when due
])
def test_the_needed_bucket_is_built_first(usable, wanted, limit, order, monkeypatch):
    builder = RecordingBuilder()
    spec = fake_spec(usable, builder, usable, monkeypatch)
    assert spec_warmup.batch_limit(spec, wanted) == limit
    assert builder.build_order() == order
    assert spec_warmup.batch_limit(fake_spec(usable, None, usable, monkeypatch), wanted) == 8


def test_a_usable_bucket_still_gets_its_other_shapes(monkeypatch):
    builder = RecordingBuilder()
    assert spec_warmup.batch_limit(fake_spec({1, 2}, builder, {1}, monkeypatch), 2) == 2
    assert builder.build_order() == [("bucket", 2), ("shape", 2)]


def test_a_burst_waits_for_one_drafted_shape_not_for_a_bucket_of_them(monkeypatch):
    """A drafted shape takes a CPU seconds to compile. A burst that needs a larger bucket
    while the builder compiles one of another bucket's shapes has its bucket's base
    programs built next, ahead of that bucket's other shapes."""
    built, usable, compiling, gate = [], {1}, threading.Event(), threading.Event()

    def build_shape(shape, size):
        if not gate.is_set():  # the first one compiles until the second burst has come
            compiling.set()
            gate.wait(10)
        built.append((shape.name, size))

    def build_base(size):
        built.append(("base", size))
        usable.add(size)

    monkeypatch.setattr(spec_warmup, "_round_builds", lambda spec, shapes, size: [
        functools.partial(build_shape, shape, size) for shape in shapes])
    monkeypatch.setattr(spec_warmup, "_base_builds", lambda spec, size: [
        functools.partial(build_base, size)])
    builder = BackgroundBuilder()
    spec = fake_spec(usable, builder, built={1}, monkeypatch=monkeypatch)
    try:
        assert spec_warmup.batch_limit(spec, 4) == 1  # a burst of 4
        builder.resume()
        assert compiling.wait(10) and built == [("base", 4), ("base", 2)]
        assert spec_warmup.batch_limit(spec, 8) == 4  # a burst of 8 while a shape compiles
        gate.set()
        assert builder.wait_idle(10)
    finally:
        builder.stop()
    assert built[2:5] == [("3/1/4", 4), ("base", 8), ("3/4/8", 4)], built
    assert spec_warmup.batch_limit(spec, 8) == 8


@pytest.mark.parametrize("built, rows, padded", [
    ({1, 8}, 3, 8),  # 4 is still building: the next usable bucket up
    ({1, 4, 8}, 3, 4),
    ({1, 8}, 1, 1),
    ({1}, 3, 4),  # nothing built fits: the bucket that fits (built when due)
])
def test_a_batch_pads_to_the_smallest_usable_bucket(built, rows, padded, monkeypatch):
    spec = fake_spec(built, RecordingBuilder(), monkeypatch=monkeypatch)
    assert spec_warmup.ready_padding(spec, rows) == padded
    without_builder = fake_spec(built, None, monkeypatch=monkeypatch)
    assert spec_warmup.ready_padding(without_builder, rows) == Buckets(
        (64,), SIZES, 128, 16).batch_padding(rows)


def test_shapes_timed_while_the_builder_ran_are_timed_again_once_it_is_idle(monkeypatch):
    """A bucket's shapes timed while the background builder compiled on the other core are
    offered for timing again once it is idle, and not before; clean ones never again."""
    chain, packed, plain = "3/1/4", "3/1/4:2", "plain"
    builder = RecordingBuilder()
    builder.idle = lambda: busy is False
    spec = fake_spec({1}, builder, monkeypatch=monkeypatch)
    spec.shapes = (plain, chain, packed)
    monkeypatch.setattr(spec_warmup, "shapes_built", lambda spec, size: (plain, chain))
    timed = {(plain, 8), (chain, 8)}
    provisional = {(chain, 8)}
    busy = True
    assert spec_warmup.untimed_shapes(spec, 8, timed, provisional) == []
    busy = False
    assert spec_warmup.untimed_shapes(spec, 8, timed, provisional) == [chain]
    assert spec_warmup.untimed_shapes(spec, 8, {(plain, 8)}) == [chain]  # built, untimed
