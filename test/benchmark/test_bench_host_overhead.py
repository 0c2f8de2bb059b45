"""bench_host_overhead on the tiny model: it runs, times every part, and writes its JSON."""

import json

from sgl_jax.testing.benchmarks import load_benchmark


def test_tiny_rows_print_and_save(tmp_path, capsys):
    bench = load_benchmark("bench_host_overhead")
    out = tmp_path / "overhead.json"
    # Each figure is the difference of two runs over the steps between them: enough steps
    # that a tiny model's 0.4 ms ones stand above the timer's noise (8 once gave -0.06 ms).
    rows = bench.main(["--rows", "tiny", "--tiny-batch-sizes", "2", "--steps", "48",
                       "--short", "4", "--json", str(out)])
    assert [(r["model"], r["batch"]) for r in rows] == [("tiny", 2)]
    row = rows[0]
    assert row["steps"] == 48  # the long run took exactly --steps more decode steps
    assert all(row[k] > 0 for k in ("engine_ms", "engine_cpu_ms", "device_ms", "floor_ms"))
    assert json.loads(out.read_text())["rows"] == rows
    assert "| tiny | decode | 2 |" in capsys.readouterr().out
    # One thread's CPU time: within its wall time (the margin: both are differences of runs),
    # where the process's would count the XLA threads' too.
    assert row["engine_cpu_ms"] < 2 * row["engine_ms"]


# An optimized module as XLA prints it: ENTRY calls a loop whose body runs two kernels and
# whose condition one; a reduction's combiner and the fusions' bodies are parts of kernels.
HLO = """\
HloModule jit_step

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %sine.1 = f32[4]{0} sine(%param_0)
}

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.3 = f32[] add(%a, %b)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %sine_fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %gemm = f32[4]{0} custom-call(%sine_fusion), custom_call_target="__cublas$gemm"
  ROOT %tuple.2 = (s32[], f32[4]{0}) tuple(%i, %gemm)
}

%cond (t.1: (s32[], f32[4])) -> pred[] {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}

%loop (t.2: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t.2 = (s32[], f32[4]{0}) parameter(0)
  ROOT %while.0 = (s32[], f32[4]{0}) while(%t.2), condition=%cond, body=%body
}

ENTRY %main (x.1: f32[4]) -> f32[] {
  %x.1 = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %copy.1 = f32[4]{0} copy(%x.1)
  %tuple = (s32[], f32[4]{0}) tuple(%zero, %copy.1)
  %call = (s32[], f32[4]{0}) call(%tuple), to_apply=%loop
  %y = f32[4]{0} get-tuple-element(%call), index=1
  %fzero = f32[] constant(0)
  ROOT %reduce.1 = f32[] reduce(%y, %fzero), dimensions={0}, to_apply=%region_add
}
"""


def test_kernel_count_follows_control_flow_and_not_fusion_bodies():
    bench = load_benchmark("bench_host_overhead")
    # ENTRY: copy and reduce; the loop body: the fusion and the matrix product; its
    # condition: the compare. Not the sine inside the fusion nor the reduction's add.
    assert bench.kernel_count(HLO) == 5
