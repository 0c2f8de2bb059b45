"""ServerArgs: every user-facing setting and CLI flag, validated once at start-up.

Subsystems read the part they need: the runtime its model and scheduling fields, the HTTP
server `http`, speculative decoding `speculative` (None without --speculative-algorithm), a
config each subsystem defines (speculative/spec_config.py) and this module fills from the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from sgl_jax.model_executor.forward_batch import EXTEND_Q_BLOCK
from sgl_jax.models.loader import DTYPE_CHOICES
from sgl_jax.speculative.drafters.ngram.suffix_config import SuffixConfig
from sgl_jax.speculative.flags import (
    NGRAM_MATCH_TYPES,
    SPECULATIVE_ALGORITHMS,
    add_ngram_flags,
    add_speculative_flags,
)
from sgl_jax.speculative.spec_config import SpeculativeConfig

DEVICE_CHOICES = ("cpu", "gpu", "cuda", "tpu")
# `triton` is the name SGLang's GPU users pass; here it selects the same Pallas kernels as `fa`.
ATTENTION_BACKEND_CHOICES = ("native", "fa", "triton")
# Drafters whose default shape is not the 3-step chain: (steps, draft tokens). NGRAM's text
# lookups cost nothing per step; a DFlash head drafts its whole block (the published heads'
# 16 tokens: 15 steps and the root) in one forward, a DSpark head all of its (DeepSpec's 7).
SHAPE_DEFAULTS = {"NGRAM": (7, 8), "DFLASH": (15, None), "DSPARK": (7, None)}  # None: a chain
# Drafters whose chain width, given alone, sets the depth (SGLang's DFlash block size is its
# --speculative-num-draft-tokens): a chain of W tokens drafts W - 1.
WIDTH_SETS_CHAIN_DEPTH = ("DFLASH", "DSPARK", "NEXTN")
MAX_NGRAM_DRAFT_TOKENS = 64
REASONING_PARSERS = ("qwen3", "deepseek-r1")
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# SGLang's names, then vLLM's for the same formats (sgl_jax.tokenizer.tool_calls).
TOOL_CALL_PARSERS = ("qwen25", "llama3", "hermes", "llama3_json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Weight formats (SGLang's names): int8 / w8a8_int8 / fp8 quantize a float checkpoint at
# load; an FP8 checkpoint (quantization_config.quant_method "fp8") loads as fp8 without the
# flag.
QUANTIZATION_CHOICES = ("int8", "w8a8_int8", "fp8")
# A draft head's format: the target's by default; "unquant" keeps it in the model dtype.
DRAFT_QUANTIZATION_CHOICES = ("unquant", *QUANTIZATION_CHOICES)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e5m2", "fp8_e4m3")


@dataclass(frozen=True)
class HttpConfig:
    host: str
    port: int
    api_key: str | None
    served_model_name: str
    enable_metrics: bool
    chat_template: str | None  # a file, a template name, or None for the tokenizer's own
    reasoning_parser: str | None
    tool_call_parser: str | None
    sampling_defaults: str  # "model": generation_config.json's where it sets them; "openai"
    shutdown_drain_s: float  # on SIGTERM / SIGINT: how long running requests may still run


SAMPLING_DEFAULTS = ("model", "openai")


@dataclass(frozen=True)
class ServerArgs:
    # Model and tokenizer
    model_path: str | None = None  # None: the launcher serves the built-in demo model
    tokenizer_path: str | None = None  # default: model_path
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    quantization: str | None = None  # None: the checkpoint's own format
    context_length: int | None = None  # default: the model's max_position_embeddings
    device: str | None = None  # default: JAX's default backend
    # KV cache
    page_size: int = 16
    kv_cache_dtype: str = "auto"  # auto: the model dtype
    max_total_tokens: int | None = None  # KV pool size in tokens; default from memory
    mem_fraction_static: float | None = None  # of device memory for weights + KV pool
    disable_radix_cache: bool = False
    # Scheduling
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048  # new tokens in one extend batch
    chunked_prefill_size: int = 2048  # new tokens of one request per batch; -1 = no limit
    precompile_token_paddings: tuple[int, ...] | None = None  # default: powers of two
    precompile_bs_paddings: tuple[int, ...] | None = None  # default: powers of two
    skip_server_warmup: bool = False
    compilation_cache_dir: str | None = None  # default: <user cache>/sgl-jax/xla
    disable_compilation_cache: bool = False
    disable_overlap_schedule: bool = False  # run each step after reading the last one's tokens
    attention_backend: str | None = None  # default: fa on TPU and GPU, native on CPU
    # Parallelism
    tp_size: int = 1
    nnodes: int = 1  # processes (usually hosts) that form the mesh together
    node_rank: int = 0  # this process's index among them; rank 0 serves HTTP
    dist_init_addr: str | None = None  # host:port of rank 0's coordinator, with nnodes > 1
    dp_size: int = 1  # replicas of the server behind SGLang's router (the launcher's job)
    router_policy: str = "cache_aware"
    replica_health_timeout: float = 10.0  # s without /health before a replica is restarted
    # SGLang's router (its flags as sglang_router.launch_server names them); the breaker's
    # timeout is ours: the router's 60 s left a restarted replica idle for a minute.
    router_request_timeout_secs: int = 1800
    router_retry_max_retries: int = 5
    router_health_failure_threshold: int = 3
    router_health_check_timeout_secs: int = 5
    router_cb_timeout_duration_secs: int = 10
    # Speculative decoding
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_draft_model_revision: str | None = None
    speculative_draft_model_quantization: str | None = None  # None: as --quantization
    speculative_num_steps: int | None = None  # default 3
    speculative_eagle_topk: int | None = None  # default 1
    speculative_num_draft_tokens: int | None = None  # default: num_steps + 1 (chain)
    speculative_accept_threshold_single: float = 1.0
    speculative_accept_threshold_acc: float = 1.0
    speculative_adaptive: bool = True  # off: every round takes the flags' shape
    speculative_per_request_lengths: bool = False  # rows verify subtrees of their own sizes
    # NGRAM (SGLang's flags; docs/speculative.md says what each means here)
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 1_000_000
    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: model_path
    chat_template: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # What the OpenAI endpoints use for a sampling field a request leaves out or sends null:
    # the model's generation_config.json, else OpenAI's default ("openai": always OpenAI's).
    sampling_defaults: str = "model"
    enable_metrics: bool = False
    # On SIGTERM / SIGINT: seconds running requests may take to finish before the rest are
    # aborted (Kubernetes kills a pod 30 s after its SIGTERM by default).
    shutdown_drain_s: float = 20.0
    # Misc
    random_seed: int | None = None
    decode_log_interval: int = 40
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("precompile_token_paddings", "precompile_bs_paddings"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(sorted(value)))
        if self.speculative_algorithm is not None:
            object.__setattr__(self, "speculative_algorithm", self.speculative_algorithm.upper())
        self._validate()

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        self._validate_choices()
        self._validate_ranges()
        self._validate_paddings()
        self._validate_nodes()
        if self.speculative_algorithm is not None:
            self._validate_speculative()
        if self.speculative_draft_model_quantization and self.speculative_algorithm in (
                None, "NGRAM"):
            raise ValueError(f"speculative_draft_model_quantization "
                             f"{self.speculative_draft_model_quantization!r} applies to a draft "
                             f"model; {self.speculative_algorithm or 'plain decoding'} has no "
                             "draft model")

    def _validate_choices(self) -> None:
        choices = {
            "dtype": DTYPE_CHOICES, "device": (None, *DEVICE_CHOICES),
            "attention_backend": (None, *ATTENTION_BACKEND_CHOICES),
            "speculative_algorithm": (None, *SPECULATIVE_ALGORITHMS),
            "reasoning_parser": (None, *REASONING_PARSERS), "router_policy": ROUTER_POLICIES,
            "tool_call_parser": (None, *TOOL_CALL_PARSERS), "log_level": LOG_LEVELS,
            "sampling_defaults": SAMPLING_DEFAULTS,
            "quantization": (None, *QUANTIZATION_CHOICES), "kv_cache_dtype": KV_CACHE_DTYPES,
            "speculative_draft_model_quantization": (None, *DRAFT_QUANTIZATION_CHOICES),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                shown = ", ".join(str(a) for a in allowed if a is not None)
                raise ValueError(f"{name} {getattr(self, name)!r} is not supported; "
                                 f"choose from {shown}")

    def _validate_ranges(self) -> None:
        positive = ("page_size", "max_running_requests", "max_prefill_tokens",
                    "decode_log_interval", "tp_size", "nnodes", "dp_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"chunked_prefill_size must be >= 1 or -1, got "
                             f"{self.chunked_prefill_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must hold at least "
                             f"two pages of page_size {self.page_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got "
                             f"{self.mem_fraction_static}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        for name in ("router_request_timeout_secs", "router_retry_max_retries",
                     "router_health_failure_threshold", "router_health_check_timeout_secs",
                     "router_cb_timeout_duration_secs"):
            least = 0 if name == "router_retry_max_retries" else 1
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not 0 <= self.shutdown_drain_s <= 3600:
            raise ValueError(f"shutdown_drain_s must be in [0, 3600] s, got "
                             f"{self.shutdown_drain_s}")
        if not self.replica_health_timeout > 0:
            raise ValueError(f"replica_health_timeout must be > 0 s, got "
                             f"{self.replica_health_timeout}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty; leave it out to serve without a key")

    def _validate_paddings(self) -> None:
        for name in ("precompile_token_paddings", "precompile_bs_paddings"):
            value = getattr(self, name)
            if value is not None and (not value or min(value) < 1):
                raise ValueError(f"{name} must be a non-empty list of sizes >= 1, got {value}")
        tokens = self.precompile_token_paddings or ()
        if any(t % EXTEND_Q_BLOCK for t in tokens):
            raise ValueError(f"precompile_token_paddings must be multiples of {EXTEND_Q_BLOCK} "
                             f"(prefill chunks start on {EXTEND_Q_BLOCK}-token blocks), "
                             f"got {tokens}")

    def _validate_nodes(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes) = [0, {self.nnodes}), got "
                             f"{self.node_rank}")
        if self.dp_size > 1 and self.dp_size % self.nnodes:
            raise ValueError(f"--dp-size {self.dp_size} replicas do not split evenly over "
                             f"--nnodes {self.nnodes}")
        if self.nnodes == 1:
            return
        host, _, port = (self.dist_init_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (rank "
                             f"0's address, reachable from every node), got "
                             f"{self.dist_init_addr!r}")

    def _validate_speculative(self) -> None:
        spec = self.speculative
        for name in ("num_steps", "eagle_topk"):
            if getattr(spec, name) < 1:
                raise ValueError(f"speculative_{name} must be >= 1, got {getattr(spec, name)}")
        for name in ("accept_threshold_single", "accept_threshold_acc"):
            if not 0 < getattr(spec, name) <= 1:
                raise ValueError(f"speculative_{name} must be in (0, 1], got "
                                 f"{getattr(spec, name)}")
        if spec.per_request_lengths and not spec.adaptive:
            raise ValueError("--speculative-per-request-lengths: the adaptive policy chooses "
                             "each request's length; drop --no-speculative-adaptive")
        if spec.ngram is not None:
            self._validate_ngram(spec)
            return
        demo_head = self.model_path is None and self.speculative_algorithm == "EAGLE3"
        if not spec.draft_model_path and not demo_head:  # the demo ships its head
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} needs "
                             "--speculative-draft-model-path")
        if spec.eagle_topk == 1 and spec.num_draft_tokens != spec.num_steps + 1:
            raise ValueError(
                f"with speculative_eagle_topk 1 the draft is a chain of num_steps tokens, so "
                f"speculative_num_draft_tokens must be num_steps + 1 = {spec.num_steps + 1}, "
                f"got {spec.num_draft_tokens}"
            )
        # Step 0 proposes K children; each later step scores K*K candidates.
        most = 1 + spec.eagle_topk + (spec.num_steps - 1) * spec.eagle_topk**2
        if not 2 <= spec.num_draft_tokens <= most:
            raise ValueError(
                f"speculative_num_draft_tokens must be in [2, {most}] for num_steps "
                f"{spec.num_steps} and eagle_topk {spec.eagle_topk}, got {spec.num_draft_tokens}"
            )

    def _validate_ngram(self, spec: SpeculativeConfig) -> None:
        """NGRAM drafts from text: no draft model, and a tree of any shape within
        num_draft_tokens nodes, num_steps deep (eagle_topk does not bound it)."""
        if self.speculative_draft_model_path:
            raise ValueError("--speculative-algorithm NGRAM drafts from the text itself and "
                             "takes no --speculative-draft-model-path")
        if not 2 <= spec.num_draft_tokens <= MAX_NGRAM_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_draft_tokens must be in [2, "
                             f"{MAX_NGRAM_DRAFT_TOKENS}] for NGRAM, got {spec.num_draft_tokens}")
        for name in ("min_bfs_breadth", "max_bfs_breadth"):
            if getattr(self, f"speculative_ngram_{name}") < 1:
                raise ValueError(f"--speculative-ngram-{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, f'speculative_ngram_{name}')}")
        if self.speculative_ngram_match_type.upper() not in NGRAM_MATCH_TYPES:
            raise ValueError(f"--speculative-ngram-match-type must be one of "
                             f"{', '.join(NGRAM_MATCH_TYPES)}, got "
                             f"{self.speculative_ngram_match_type!r}")
        spec.ngram.validate()

    # ------------------------------------------------------------------ derived settings

    @property
    def chunk_size(self) -> int:
        """New tokens of one request in one extend batch."""
        if self.chunked_prefill_size == -1:
            return self.max_prefill_tokens
        return min(self.chunked_prefill_size, self.max_prefill_tokens)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_algorithm is None:
            return None
        algorithm = self.speculative_algorithm
        default_steps, default_tokens = SHAPE_DEFAULTS.get(algorithm, (3, None))
        topk = self.speculative_eagle_topk or 1
        width = self.speculative_num_draft_tokens
        if algorithm in WIDTH_SETS_CHAIN_DEPTH and topk == 1 and width:
            default_steps = max(width - 1, 1)
        steps = self.speculative_num_steps or default_steps
        if default_tokens is None:
            default_tokens = steps + 1 if topk == 1 else 2 * (steps + 1)
        return SpeculativeConfig(
            algorithm=self.speculative_algorithm,
            draft_model_path=self._draft_model_path(),
            draft_model_revision=self.speculative_draft_model_revision,
            draft_quantization=self._draft_quantization(),
            num_steps=steps, eagle_topk=topk,
            num_draft_tokens=self.speculative_num_draft_tokens or default_tokens,
            accept_threshold_single=self.speculative_accept_threshold_single,
            accept_threshold_acc=self.speculative_accept_threshold_acc,
            adaptive=self.speculative_adaptive,
            per_request_lengths=self.speculative_per_request_lengths,
            ngram=self._ngram_config() if algorithm == "NGRAM" else None,
        )

    def _draft_model_path(self) -> str | None:
        """The flag's path; for NEXTN without it, the target's own checkpoint, which holds
        the multi-token-prediction module."""
        if self.speculative_algorithm == "NEXTN":
            return self.speculative_draft_model_path or self.model_path
        return self.speculative_draft_model_path

    def _draft_quantization(self) -> str | None:
        """The target's --quantization unless the draft's flag says otherwise; "unquant"
        keeps the draft in the model dtype."""
        chosen = self.speculative_draft_model_quantization or self.quantization
        return None if chosen == "unquant" else chosen

    def _ngram_config(self) -> SuffixConfig:
        """SGLang's NGRAM flags in suffix decoding's terms: the match windows bound the
        suffix matched, the branch length the deepest draft, the capacity the tokens of
        recent responses kept. BFS breadth and match type shape SGLang's trie walk; here a
        tree follows the text's statistics (PROB's order) and they are only checked."""
        return SuffixConfig(
            min_match=self.speculative_ngram_min_match_window_size,
            max_match=self.speculative_ngram_max_match_window_size,
            branch_length=self.speculative_ngram_branch_length,
            capacity=self.speculative_ngram_capacity)

    @property
    def http(self) -> HttpConfig:
        return HttpConfig(
            host=self.host, port=self.port, api_key=self.api_key,
            served_model_name=self.served_model_name or self.model_path or "default",
            enable_metrics=self.enable_metrics, chat_template=self.chat_template,
            reasoning_parser=self.reasoning_parser, tool_call_parser=self.tool_call_parser,
            sampling_defaults=self.sampling_defaults, shutdown_drain_s=self.shutdown_drain_s,
        )

    def to_dict(self) -> dict:
        public = dataclasses.asdict(self)
        if public["api_key"] is not None:
            public["api_key"] = "<set>"
        return public

    # ------------------------------------------------------------------ command line

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        namespace = build_parser().parse_args(argv)
        return cls(**vars(namespace))


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless it is unset or the help already explains it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_jax.launch_server",
        description="Serve a model (optionally with an EAGLE3 draft) behind an "
                    "OpenAI-compatible HTTP API.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    _add_model_args(parser.add_argument_group("model and tokenizer"))
    _add_memory_args(parser.add_argument_group("KV cache and memory"))
    _add_scheduling_args(parser.add_argument_group("scheduling and compilation"))
    _add_parallel_args(parser.add_argument_group("parallelism"))
    add_speculative_flags(parser.add_argument_group("speculative decoding"),
                          DRAFT_QUANTIZATION_CHOICES)
    add_ngram_flags(parser.add_argument_group("NGRAM drafting (--speculative-algorithm NGRAM)"))
    _add_http_args(parser.add_argument_group("HTTP server and OpenAI API"))
    _add_logging_args(parser.add_argument_group("logging and metrics"))
    return parser


def _add_model_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model-path", "--model", dest="model_path", default=None,
                       help="local directory or Hugging Face id; default: the built-in demo model")
    group.add_argument("--tokenizer-path", default=None, help="default: --model-path")
    group.add_argument("--revision", default=None, help="hub branch, tag or commit of the model")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="let transformers run the repository's own tokenizer code; the "
                            "model itself always runs this project's implementation")
    group.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                       help="weights and activations; auto = float32 on CPU, bfloat16 elsewhere")
    group.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                       help="store the weights in 8 bits with per-output-channel scales (int8, "
                            "or fp8 e4m3); w8a8_int8: int8 weights whose products also take "
                            "int8 inputs, quantized per token; default: the checkpoint's own "
                            "format (an FP8 checkpoint loads as fp8, its block scales kept)")
    group.add_argument("--context-length", type=int, default=None,
                       help="longest prompt + completion; default: max_position_embeddings")
    group.add_argument("--device", default=None, choices=DEVICE_CHOICES,
                       help="JAX platform to run on; default: JAX's default backend")


def _add_memory_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="what the KV pages store; fp8 halves a bfloat16 cache's bytes per "
                            "token (values cast, no scales); auto = the model dtype")
    group.add_argument("--max-total-tokens", type=int, default=None,
                       help="KV pool size in tokens; default: from --mem-fraction-static")
    group.add_argument("--mem-fraction-static", type=float, default=None,
                       help="share of device memory for weights + KV pool (0.8; 0.1 on CPU)")
    group.add_argument("--disable-radix-cache", action="store_true",
                       help="turn off prefix reuse across requests")


def _add_scheduling_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-running-requests", type=int, default=64,
                       help="requests decoding together")
    group.add_argument("--max-prefill-tokens", type=int, default=2048,
                       help="new tokens in one prefill batch")
    group.add_argument("--chunked-prefill-size", type=int, default=2048,
                       help="new tokens of one request per batch; -1 = no chunking")
    group.add_argument("--precompile-token-paddings", type=_int_list, default=None,
                       help="token buckets of prefill batches, e.g. '64,256,1024' "
                            "(multiples of 16); default: 64, 256, 1024, ...")
    group.add_argument("--precompile-bs-paddings", type=_int_list, default=None,
                       help="batch-size buckets of decode batches, e.g. '1,4,16'; "
                            "default: powers of two up to --max-running-requests")
    group.add_argument("--skip-server-warmup", action="store_true",
                       help="compile shape buckets on first use instead of at start-up")
    group.add_argument("--compilation-cache-dir", default=None,
                       help="where compiled programs are kept between starts, so a second "
                            "start skips the compiler; default: ~/.cache/sgl-jax/xla (under "
                            "$XDG_CACHE_HOME when set)")
    group.add_argument("--disable-compilation-cache", action="store_true",
                       help="compile every bucket afresh at each start")
    group.add_argument("--disable-overlap-schedule", action="store_true",
                       help="read each step's tokens before dispatching the next (by default "
                            "the engine loop runs a step ahead, so the host's work on a step's "
                            "results overlaps the device's next step); speculative rounds are "
                            "synchronous either way")
    group.add_argument("--attention-backend", default=None,
                       choices=ATTENTION_BACKEND_CHOICES,
                       help="fa (alias triton) = the Pallas ragged paged FlashAttention kernels, "
                            "native = the jnp reference; default: fa on TPU and GPU, native on "
                            "CPU")


def _add_parallel_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1,
                       help="tensor-parallel degree: devices the model is split over, across "
                            "all nodes")
    group.add_argument("--nnodes", type=int, default=1,
                       help="processes (usually hosts) that form the mesh together; start "
                            "the same command on each with its own --node-rank")
    group.add_argument("--node-rank", type=int, default=0,
                       help="this process's index in [0, nnodes); rank 0 serves HTTP")
    group.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=1,
                       help="replicas of the server, each on its own --tp-size devices "
                            "(with --nnodes, dp-size / nnodes on each node), behind SGLang's "
                            "router on rank 0's --port (pip install \"sgl-jax[router]\")")
    group.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                       help="how the router picks a replica with --dp-size")
    group.add_argument("--replica-health-timeout", type=float, default=10.0,
                       help="with --dp-size: seconds a replica may go without answering "
                            "/health (checked every 2 s) before the launcher kills it and "
                            "starts it again")
    for flag, default, what in (
            ("request-timeout-secs", 1800, "the router ends a request that takes longer"),
            ("retry-max-retries", 5, "retries of a request that failed before its answer "
                                     "began, on another replica"),
            ("health-failure-threshold", 3, "failed health checks (every 2 s) before the "
                                            "router takes a replica out of rotation"),
            ("health-check-timeout-secs", 5, "seconds a health check waits for /health"),
            ("cb-timeout-duration-secs", 10, "seconds the router's circuit breaker keeps a "
                                             "replica whose requests failed out of rotation")):
        group.add_argument(f"--router-{flag}", type=int, default=default,
                           help=f"with --dp-size: {what} (SGLang's router flag)")
    group.add_argument("--dist-init-addr", default=None,
                       help="HOST:PORT of rank 0, where the nodes meet (needed with "
                            "--nnodes > 1); PORT + 1 carries the scheduled steps")


def _add_http_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=30000, help="port to listen on")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients send and /v1/models lists; "
                            "default: --model-path")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja template file or a built-in name (see docs/server.md); "
                            "default: the tokenizer's own")
    group.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="split <think> blocks into reasoning_content in chat responses")
    group.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="the format the model writes tool calls in (qwen25 / hermes: "
                            "<tool_call> blocks; llama3 / llama3_json: Llama 3.1 JSON); "
                            "default: detected from the chat template, else qwen25 taught "
                            "in the system message")
    group.add_argument("--sampling-defaults", default="model", choices=SAMPLING_DEFAULTS,
                       help="defaults of temperature, top_p, top_k, min_p and "
                            "repetition_penalty for OpenAI requests that leave them out: the "
                            "model's generation_config.json where it sets them (model), or "
                            "OpenAI's always (openai)")
    group.add_argument("--shutdown-drain-s", type=float, default=20.0,
                       help="on SIGTERM or SIGINT: stop taking requests, give the running ones "
                            "this many seconds to finish, then end the rest with an error "
                            "(streams get an error event) and exit")


def _add_logging_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                       help="least severe log records shown")
    group.add_argument("--decode-log-interval", type=int, default=40,
                       help="decode steps between 'Decode batch' log lines")
    group.add_argument("--enable-metrics", action="store_true",
                       help="serve Prometheus metrics on /metrics")
    group.add_argument("--random-seed", type=int, default=None,
                       help="seeds the draws for requests that give no seed")
