"""How a server stops under load: seconds from SIGTERM to exit, and how each stream ended.

A server (a tiny random Llama by default, `--context-length 4096`) takes --streams streamed
chats of --max-tokens tokens each (ignore_eos); --signal-after seconds after they start it
gets SIGTERM. Per run it prints the seconds until the process exited and the streams by how
they ended: `done` ([DONE] came: finished within the drain window), `error` (an error event
in OpenAI's shape: aborted when the window closed) or `cut` (closed without either: a
client would read a network fault), and whether the log holds a traceback. Extra server
flags follow `--`, e.g. `-- --dp-size 2` or `-- --shutdown-drain-s 5`.

    python benchmark/bench_shutdown.py
    python benchmark/bench_shutdown.py --runs 3 -- --dp-size 2
"""

from __future__ import annotations

import argparse
import collections
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
try:
    import sgl_jax  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_HERE.parent))
from sgl_jax.testing import write_tiny_checkpoint, write_tiny_tokenizer  # noqa: E402
from sgl_jax.testing.server import StreamedChat, launch_server  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: a tiny random Llama")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--signal-after", type=float, default=3.0,
                        help="seconds between starting the streams and SIGTERM")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--wait", type=float, default=120.0,
                        help="seconds to wait for the exit before killing the server")
    args, server_flags = parser.parse_known_args(argv)
    return args, [flag for flag in server_flags if flag != "--"]


def tiny_model(directory: Path) -> Path:
    write_tiny_checkpoint(directory, "llama")
    write_tiny_tokenizer(directory)
    return directory


def one_run(flags: list[str], args: argparse.Namespace) -> str:
    with launch_server(flags, timeout_s=600) as server:
        streams = [StreamedChat(server.base_url, args.max_tokens) for _ in range(args.streams)]
        for stream in streams:
            stream.start()
        time.sleep(args.signal_after)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=args.wait)
            exited = f"exited {time.monotonic() - signalled:.1f} s after SIGTERM"
        except subprocess.TimeoutExpired:  # launch_server's exit kills it
            exited = f"still running {args.wait:.0f} s after SIGTERM"
        for stream in streams:
            stream.join(timeout=10)
        endings = collections.Counter(stream.ending for stream in streams)
        traceback = "Traceback" in server.log()
    return (f"{exited}; streams: " + ", ".join(f"{n} {kind}" for kind, n in sorted(
        endings.items())) + f"; traceback in the log: {'yes' if traceback else 'no'}")


def main(argv: list[str] | None = None) -> None:
    args, server_flags = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model_path or str(tiny_model(Path(scratch) / "llama"))
        flags = ["--model-path", model, "--context-length", "4096", *server_flags]
        print(f"{args.streams} streams of {args.max_tokens} tokens, SIGTERM "
              f"{args.signal_after:.0f} s in; server flags: {' '.join(server_flags) or 'none'}")
        for run in range(args.runs):
            print(f"run {run + 1}: {one_run(flags, args)}", flush=True)


if __name__ == "__main__":
    main()
