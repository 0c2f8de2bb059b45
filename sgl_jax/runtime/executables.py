"""Where a runtime keeps its compiled programs, and what they are keyed by.

The store lives beside JAX's compilation cache (<cache dir>/executables; clearing the cache
directory clears both). Its fingerprint holds every flag that may change a program (the
server's host-side settings left out, so replicas on other ports share it), the target's
parsed config and the draft checkpoint's config file; the parameters' shapes and dtypes go
into each program's own signature (model_executor/programs.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from sgl_jax.cache import user_cache_dir
from sgl_jax.model_executor.programs import ExecutableStore, fingerprint
from sgl_jax.models.loader import LoadedModel
from sgl_jax.server_args import ServerArgs

# Settings that never reach a compiled program: the HTTP side, logging, and what only sizes
# the pools or picks the buckets (those show in the programs' input shapes).
HOST_ONLY_SETTINGS = frozenset((
    "model_path", "tokenizer_path", "trust_remote_code", "speculative_draft_model_path",
    "max_total_tokens", "mem_fraction_static", "disable_radix_cache", "max_prefill_tokens",
    "chunked_prefill_size", "skip_server_warmup", "compilation_cache_dir",
    "disable_compilation_cache", "disable_overlap_schedule", "dp_size", "router_policy",
    "replica_health_timeout", "router_request_timeout_secs", "router_retry_max_retries",
    "router_health_failure_threshold", "router_health_check_timeout_secs",
    "router_cb_timeout_duration_secs",
    "host", "port", "api_key", "served_model_name", "chat_template", "reasoning_parser",
    "tool_call_parser", "sampling_defaults", "enable_metrics", "random_seed",
    "decode_log_interval", "log_level"))


def open_store(args: ServerArgs, model: LoadedModel) -> ExecutableStore | None:
    """The store of this runtime's programs; None where programs are not kept (the
    compilation cache off, or several nodes: each rank's executables span the others)."""
    if args.disable_compilation_cache or args.nnodes > 1:
        return None
    return ExecutableStore(store_root(args.compilation_cache_dir),
                           fingerprint(program_settings(args, model)))


def store_root(compilation_cache_dir: str | None) -> Path:
    return Path(compilation_cache_dir or user_cache_dir() / "xla") / "executables"


def program_settings(args: ServerArgs, model: LoadedModel) -> dict[str, Any]:
    settings = {k: v for k, v in args.to_dict().items() if k not in HOST_ONLY_SETTINGS}
    settings["target_config"] = repr(model.config)
    settings["draft"] = checkpoint_identity(args.speculative_draft_model_path)
    return settings


def checkpoint_identity(path: str | None) -> str | None:
    """A local checkpoint's config file digest (a directory), or its size and time (a file);
    else the name as given (a hub id: its config is read at load, a revision pins it)."""
    if path is None:
        return None
    local = Path(path)
    if (local / "config.json").is_file():
        return hashlib.sha256((local / "config.json").read_bytes()).hexdigest()
    if local.is_file():
        stat = local.stat()
        return f"{local.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return path
