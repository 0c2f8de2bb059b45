"""Prometheus metrics of a running server (`--enable-metrics`, served on /metrics).

Latencies are observed on the engine thread as outputs are produced; load gauges (running and
queued requests, KV usage) are read from the scheduler when /metrics is scraped.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sgl_jax.entrypoints.engine import Engine
from sgl_jax.entrypoints.outputs import final_finish_reason
from sgl_jax.scheduler.req import Req

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                      1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.registry = CollectorRegistry()
        self._label = {"model_name": model_name}
        self._last_output_at: dict[str, float] = {}  # rid -> time of its latest token
        self._define()
        engine.outputs.observer = self.on_output

    def _define(self) -> None:
        names = ["model_name"]
        r = self.registry
        self.requests = Counter("sgl_jax_requests", "Finished requests by finish reason",
                                [*names, "finish_reason"], registry=r)
        self.prompt_tokens = Counter("sgl_jax_prompt_tokens", "Prompt tokens of finished "
                                     "requests", names, registry=r)
        self.generation_tokens = Counter("sgl_jax_generation_tokens", "Generated tokens",
                                         names, registry=r)
        self.ttft = Histogram("sgl_jax_time_to_first_token_seconds", "Time to first token",
                              names, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("sgl_jax_inter_token_latency_seconds", "Time between tokens",
                             names, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("sgl_jax_e2e_request_latency_seconds", "Request latency, "
                             "arrival to finish", names, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.running = Gauge("sgl_jax_num_running_reqs", "Running requests", names, registry=r)
        self.queued = Gauge("sgl_jax_num_queue_reqs", "Waiting requests", names, registry=r)
        self.token_usage = Gauge("sgl_jax_token_usage", "Share of KV pages held by requests",
                                 names, registry=r)
        self.cache_hit_rate = Gauge("sgl_jax_cache_hit_rate", "Prompt tokens served by the "
                                    "prefix cache", names, registry=r)
        self._define_phases()
        if self.engine.server_args.speculative is None:
            return
        self.spec_rounds = Gauge("sgl_jax_spec_verify_rounds", "Speculative verify rounds so "
                                 "far", names, registry=r)
        self.spec_accept_length = Gauge("sgl_jax_spec_accept_length", "Mean tokens per verify "
                                        "round (accepted draft tokens + 1)", names, registry=r)
        self.spec_accept_rate = Gauge("sgl_jax_spec_accept_rate", "Share of verify rounds that "
                                      "accepted the draft token at this position",
                                      [*names, "position"], registry=r)
        # The adaptive policy: what it chose, and what it believed when it last chose.
        self.spec_shape_rounds = Gauge("sgl_jax_spec_rounds_by_shape", "Rounds run in each "
                                       "draft shape (plain = no draft)", [*names, "shape"],
                                       registry=r)
        self.spec_believed_rate = Gauge("sgl_jax_spec_believed_accept_rate", "Server-wide "
                                        "acceptance the policy believes per draft depth, given "
                                        "the depth above", [*names, "family", "depth"],
                                        registry=r)
        self.spec_believed_round_ms = Gauge("sgl_jax_spec_believed_round_ms", "Cost of a round "
                                            "per shape at the last batch bucket, as the policy "
                                            "believed it", [*names, "shape"], registry=r)
        self.spec_expected_tokens = Gauge("sgl_jax_spec_expected_tokens_per_second", "Expected "
                                          "committed tokens/s per shape at the last choice",
                                          [*names, "shape"], registry=r)
        self.spec_finished = Gauge("sgl_jax_spec_finished_requests", "Requests finished, by "
                                   "whether admission gave them a draft", [*names, "draft"],
                                   registry=r)
        self.spec_freed_slots = Gauge("sgl_jax_spec_freed_slots", "Slots freed by finished "
                                      "requests while others ran, by whether a new request "
                                      "took them (the policy's batch-end rule)",
                                      [*names, "fate"], registry=r)
        self._define_vllm_spec()

    def _define_phases(self) -> None:
        """The engine thread's steps and seconds (get_server_info's scheduler_phases), totals
        since the start: where a server's time goes, beside the device's."""
        names, r = ["model_name"], self.registry
        self.phase_steps = Gauge("sgl_jax_scheduler_steps", "Steps run, by kind",
                                 [*names, "kind"], registry=r)
        self.phase_rows = Gauge("sgl_jax_scheduler_step_rows", "Requests in those steps, "
                                "summed", [*names, "kind"], registry=r)
        self.phase_seconds = Gauge("sgl_jax_scheduler_seconds", "Engine thread seconds by kind "
                                   "of step: launch (dispatching) and settle (reading the "
                                   "results and acting on them, the wait for the device "
                                   "included)", [*names, "kind", "phase"], registry=r)
        self.idle_seconds = Gauge("sgl_jax_scheduler_idle_seconds", "Engine thread seconds "
                                  "with nothing to run", names, registry=r)

    def _render_phases(self, phases: dict) -> None:
        self.idle_seconds.labels(**self._label).set(phases["idle_s"])
        for kind in ("prefill", "decode"):
            label = {**self._label, "kind": kind}
            self.phase_steps.labels(**label).set(phases[kind]["steps"])
            self.phase_rows.labels(**label).set(phases[kind]["rows"])
            for phase in ("launch", "settle"):
                self.phase_seconds.labels(**label, phase=phase).set(phases[kind][f"{phase}_s"])

    def _define_vllm_spec(self) -> None:
        """The acceptance counters under vLLM's names and labels, for dashboards built on
        them: drafts (a request's round with a draft), draft tokens (the positions they
        drafted), accepted tokens, and accepted tokens per position."""
        names, r = ["model_name", "engine"], self.registry
        self.vllm_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding "
                                   "drafts.", names, registry=r)
        self.vllm_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft "
                                         "tokens.", names, registry=r)
        self.vllm_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of "
                                     "accepted tokens.", names, registry=r)
        self.vllm_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.",
                                             [*names, "position"], registry=r)
        self._vllm_seen: dict[tuple, float] = {}  # what each counter was raised to so far

    def on_output(self, req: Req, num_new_tokens: int, finished: bool) -> None:
        """Output thread: a request produced tokens or finished."""
        now = time.perf_counter()
        if num_new_tokens:
            self.generation_tokens.labels(**self._label).inc(num_new_tokens)
            last = self._last_output_at.get(req.rid)
            if last is None:
                self.ttft.labels(**self._label).observe(now - req.created_at)
            else:  # several tokens at once share the gap
                gap = (now - last) / num_new_tokens
                for _ in range(num_new_tokens):
                    self.itl.labels(**self._label).observe(gap)
            self._last_output_at[req.rid] = now
        if finished:
            self._last_output_at.pop(req.rid, None)
            self.e2e.labels(**self._label).observe(now - req.created_at)
            self.prompt_tokens.labels(**self._label).inc(len(req.prompt_ids))
            self.requests.labels(**self._label,
                                 finish_reason=final_finish_reason(req)["type"]).inc()

    def render(self) -> bytes:
        """The exposition text, with the load gauges read now."""
        info = self.engine.get_server_info()
        self.running.labels(**self._label).set(info["num_running_reqs"])
        self.queued.labels(**self._label).set(info["num_queued_reqs"])
        self.token_usage.labels(**self._label).set(info["token_usage"])
        self.cache_hit_rate.labels(**self._label).set(info["cache_hit_rate"])
        self._render_phases(info["scheduler_phases"])
        if "avg_spec_accept_length" in info:
            self.spec_rounds.labels(**self._label).set(info["spec_verify_rounds"])
            self.spec_accept_length.labels(**self._label).set(info["avg_spec_accept_length"])
            for position, rate in enumerate(info["spec_accept_rates"]):
                self.spec_accept_rate.labels(**self._label, position=str(position)).set(rate)
            self._render_policy(info)
            self._render_vllm_spec(info)
        return generate_latest(self.registry)

    def _render_vllm_spec(self, info: dict) -> None:
        label = {**self._label, "engine": "0"}
        totals = [(self.vllm_drafts, label, info["spec_verify_rounds"]),
                  (self.vllm_draft_tokens, label, sum(info["spec_drafted_per_position"])),
                  (self.vllm_accepted, label, info["spec_accepted_tokens"])]
        totals += [(self.vllm_accepted_per_pos, {**label, "position": str(position)}, count)
                   for position, count in enumerate(info["spec_accepted_per_position"])]
        for counter, labels, total in totals:  # counters only go up: raise by what is new
            key = (id(counter), *labels.values())
            counter.labels(**labels).inc(total - self._vllm_seen.get(key, 0))
            self._vllm_seen[key] = total

    def _render_policy(self, info: dict) -> None:
        for shape, rounds in info["spec_rounds_by_shape"].items():
            self.spec_shape_rounds.labels(**self._label, shape=shape).set(rounds)
        for kind, count in info["spec_finished_requests"].items():
            self.spec_finished.labels(**self._label, draft=kind).set(count)
        for fate, count in info["spec_freed_slots"].items():
            self.spec_freed_slots.labels(**self._label, fate=fate).set(count)
        for kind, rates in info["spec_believed_accept_rates"].items():
            for depth, rate in enumerate(rates, start=1):
                self.spec_believed_rate.labels(**self._label, family=kind,
                                               depth=str(depth)).set(rate)
        last = info["spec_last_choice"]
        if last is not None:
            for shape, ms in last["round_ms"].items():
                self.spec_believed_round_ms.labels(**self._label, shape=shape).set(ms)
                self.spec_expected_tokens.labels(**self._label, shape=shape).set(
                    last["tokens_per_s"][shape])
