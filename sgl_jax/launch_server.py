"""`python -m sgl_jax.launch_server [flags]`: load the model, then serve the HTTP API.

Without --model-path the built-in demo model, SmolLM2-135M-Instruct, is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import AsyncIterator

from sgl_jax.server_args import ServerArgs, build_parser
from sgl_jax.tokenizer.chat_template import resolve_chat_template

logger = logging.getLogger("sgl_jax.launch_server")

# Start-up problems the user can fix: reported in one line, without a traceback.
_USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError, OSError)


def main(argv: list[str] | None = None) -> int:
    # argparse refuses unknown flags and choices itself (usage, exit 2); --log-level is one
    # of those choices, so logging is set up before a bad value can be reported.
    cli = build_parser().parse_args(argv)
    logging.basicConfig(level=cli.log_level.upper(),
                        format="[%(asctime)s %(name)s] %(levelname)s %(message)s")
    engine = None
    try:
        args = ServerArgs(**vars(cli))  # validates every value
        resolve_chat_template(args.chat_template)  # a bad name or path fails before loading
        if args.dp_size > 1:
            from sgl_jax.entrypoints.router import serve_replicas

            return serve_replicas(args, sys.argv[1:] if argv is None else argv)
        _select_platform(args)
        from sgl_jax.entrypoints.engine import Engine  # loads JAX after the platform choice
        from sgl_jax.entrypoints.http_server import create_app

        engine = Engine(**dataclasses.asdict(args), defer_background_builds=True)
        if args.node_rank > 0:  # it followed rank 0 until rank 0 stopped
            return 0
        args = engine.server_args  # the model path and name filled in when not given
        app = create_app(engine, args)
    except _USER_ERRORS as exc:
        logger.error("cannot start: %s", exc)
        if engine is not None:
            engine.shutdown()
        return 2
    try:
        _serve(app, engine, args)
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT once it has drained and stopped
        engine.shutdown(abandon_builds=True)
        _exit_now(130)
    finally:
        engine.shutdown()
    return 0


def _exit_now(code: int) -> None:
    """Exit without the interpreter's exit, which would wait for a background build left
    compiling (on SIGTERM uvicorn's re-raised signal ends the process the same way)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _select_platform(args: ServerArgs) -> None:
    """Point JAX at --device and join the other nodes before any backend starts (the engine
    checks the outcome)."""
    device = args.device
    if device is None:
        return
    import jax

    from sgl_jax.parallel import init_distributed

    try:
        jax.config.update("jax_platforms", "cuda" if device == "gpu" else device)
    except RuntimeError:  # a backend is already running; Engine reports a mismatch
        return
    init_distributed(args.nnodes, args.node_rank, args.dist_init_addr)
    try:
        jax.devices()
    except RuntimeError as exc:
        raise ValueError(f"--device {device}: JAX cannot start that platform here ({exc})"
                         ) from None


# Seconds uvicorn waits for connections to close once the engine has drained (the aborted
# streams end with their error events well within this); then it cuts what is left.
CONNECTIONS_GRACE_S = 5.0


def _serve(app, engine, args: ServerArgs) -> None:
    import uvicorn

    @contextlib.asynccontextmanager
    async def lifespan(_app) -> AsyncIterator[None]:
        engine.start_background_builds()  # the app is built: its tracing delays nothing else
        yield
        # uvicorn re-raises SIGTERM/SIGINT once it has stopped, which ends the process before
        # main's `finally`; shutting down here also releases the other nodes cleanly. The
        # process exits next: a program still compiling must not hold it.
        engine.shutdown(abandon_builds=True)

    app.router.lifespan_context = lifespan
    logger.info("Serving %s on http://%s:%d", args.http.served_model_name, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=30,
                            timeout_graceful_shutdown=CONNECTIONS_GRACE_S)
    drain_s = args.http.shutdown_drain_s

    class DrainingServer(uvicorn.Server):
        """uvicorn's Server whose shutdown (SIGTERM, SIGINT) first drains the engine: no new
        connections, new requests on open ones refused (503), the running ones given
        `drain_s` seconds to finish and the rest aborted (a stream ends with an error event);
        then uvicorn closes the connections and runs the lifespan's end (engine.shutdown)."""

        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:
                server.close()
            logger.info("Shutting down: %d requests running, up to %.0f s to finish",
                        engine.outputs.pending, drain_s)
            aborted = await asyncio.to_thread(engine.drain, drain_s)
            if aborted:
                logger.info("Aborted %d requests still running after %.0f s", aborted, drain_s)
            await super().shutdown(sockets)

    DrainingServer(config).run()


if __name__ == "__main__":
    sys.exit(main())
