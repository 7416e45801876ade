"""Start the server: load the engine, bind the socket, run uvicorn, shut down cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from archserve.engine.config import EngineConfig
from archserve.serve.context import ServerSettings

log = logging.getLogger("archserve.serve")

# The default burst window on a CPU, where a prompt's prefill costs tens of ms a step, so
# a burst split over the first steps decodes in staggered groups; the client's requests
# of one burst (16 streams through HTTP) reached the server over 15-35 ms, in clusters a few
# ms apart. Elsewhere a prefill step costs about a decode step and there is no wait (as in
# vLLM).
CPU_BURST_WINDOW_MS = 10.0


def burst_window_ms(requested: float | None, device_type: str) -> float:
    """The burst window of a server: ``requested`` (ms), else the device's default."""
    if requested is not None:
        return requested
    return CPU_BURST_WINDOW_MS if device_type == "cpu" else 0.0


def build_context(engine_config: EngineConfig, settings: ServerSettings):
    """Load the engine and wire it to metrics; the engine thread is not started yet."""
    from archserve.engine.llm_engine import LLMEngine
    from archserve.serve.async_engine import AsyncEngine
    from archserve.serve.context import ServingContext
    from archserve.serve.metrics import ServerMetrics

    engine = LLMEngine(engine_config)
    metrics = ServerMetrics(engine)
    window_ms = burst_window_ms(settings.burst_window_ms, engine.runner.device.type)
    async_engine = AsyncEngine(engine, observer=metrics.observe_step,
                               abort_observer=metrics.observe_abort,
                               burst_window_s=window_ms / 1e3)
    return ServingContext(async_engine, metrics, settings)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# After the shutdown timeout, the requests still running are ended (finish_reason "abort",
# or a 503); uvicorn waits this much longer for their handlers to write those endings before
# it cancels what is left (which would cut a stream off mid-body).
_ENDING_GRACE_S = 10.0


def _draining_server(config, engine, shutdown_timeout_s: float):
    """A uvicorn server that, on SIGTERM, lets in-flight requests run for the shutdown
    timeout and then ends those left through the engine, so each still gets a proper
    OpenAI ending instead of a connection cut by uvicorn's own timeout."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            timer = asyncio.get_running_loop().call_later(
                shutdown_timeout_s, engine.end_all,
                f"shutdown: the shutdown timeout ({shutdown_timeout_s:g} s) has passed")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return DrainingServer(config)


def run_server(engine_config: EngineConfig, settings: ServerSettings) -> None:
    """Serve until SIGTERM or SIGINT, then drain and exit normally."""
    import uvicorn

    from archserve.serve.app import build_app

    ctx = build_context(engine_config, settings)
    engine = ctx.engine.engine
    report = engine.report
    # LLMEngine has already logged its route (engine.describe_route()) while loading.
    log.info("kv cache: %d blocks of %d tokens = %d tokens", report.num_blocks,
             report.block_size, report.num_blocks * report.block_size)
    if ctx.sampling_defaults:   # as vLLM says it: the checkpoint changes what requests get
        source = (engine.config.model if settings.generation_config == "auto"
                  else settings.generation_config)
        log.info("default sampling parameters from %s/generation_config.json: %s (relaunch "
                 "with --generation-config vllm to ignore them)", source,
                 ctx.sampling_defaults)
    app = build_app(ctx)
    # Binding first means the address is known before we announce it (port 0 works).
    sock = _bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    ctx.engine.start()
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s
                                                          + _ENDING_GRACE_S),
                            timeout_keep_alive=5)
    server = _draining_server(config, ctx.engine, settings.shutdown_timeout_s)
    # Every uvicorn protocol registers its connection here while it is open.
    connections = server.server_state.connections
    ctx.engine.open_connections = lambda: len(connections)
    # Uvicorn re-raises the signal that stopped it once it has shut down; a no-op
    # handler here turns that into a normal return, so SIGTERM exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    log.info("archserve: listening on http://%s:%d (model name: %s)", shown, port,
             ", ".join(ctx.model_names))
    try:
        server.run(sockets=[sock])
    finally:
        ctx.engine.shutdown(settings.shutdown_timeout_s)
        engine.shutdown()           # tensor-parallel workers, if any
        sock.close()
    log.info("archserve: server stopped")
