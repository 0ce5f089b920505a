"""The raw ASGI application: `granian --interface asgi serve.app:app`.

Owns: lifespan (config from TL_CONFIG + TL_ENGINE__* overrides; the health port started
first; the engine built in a worker thread, started and warmed before ready; any failure
becomes lifespan.startup.failed), request dispatch (404/405, X-Request-Id, api keys, body
limit, 503 while draining, the one catch-all that always finishes a response, every 5xx
logged once with its request id and cause, each API request's trace when tracing is on:
serve/tracing.py, which the start-up asks, and serve/otel.py) and the stop (README, "Stopping"): a first SIGTERM
or SIGINT (serve/signals.py decides which is which) during start-up gives the start-up up
(the engine is built on a daemon thread, which never holds the process); after it, the drain:
readyz and GET /health 503 at once, new requests still served for drain_min_s (the lame-duck
window a router needs to notice), then new requests 503 with Connection: close, in-flight
requests finish until drain_timeout_s since the signal (then are aborted, 2 s more for their
error events), then granian is told to stop, and its lifespan
shutdown stops the engine thread (bounded, each step timed); a second signal aborts every
request at once and stops; exit 0.

The engine and the record of the model it serves (tl/entry/served.py's ServedModel: all serve/
knows of the model) come from the `engine_factory` App is built with: tl.entry.build's
build_async_engine(cfg) for `app` below, a fake engine's for the tests (which hand granian
their own target, tests/helpers/fake_app.py). Nothing here imports jax.
Tested in memory by tests/serve/test_serve_app.py and over HTTP by tests/serve/test_serve_http.py.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from serve import errors, fleet, memwatch, page, tracing
from serve.asgi import (
    ClientGone,
    DisconnectWatcher,
    Receive,
    Request,
    Scope,
    Send,
    Sender,
)
from serve.config_load import load_config
from serve.errors import ApiError, log_server_error
from serve.generate import PING_INTERVAL_S, Job
from serve.health import HealthServer
from serve.loading import LoadingServer
from serve.metrics import Metrics
from serve.process import (
    ABORT_GRACE_S,
    ENGINE_STOP_S,
    ENGINE_STOP_WAIT_S,
    HEALTH_CLOSE_S,
    STOP_NOW_GRACE_S,
    TRACING_STOP_S,
    parse_listen,
    setup_logging,
)
from serve.responses import ResponseStore
from serve.routes import Ctx, match
from serve.signals import STOP, take_over_granian
from tl.core.async_engine import AsyncEngine, EmbedHandle
from tl.core.config import EngineConfig
from tl.core.stats import BackendInfo, EngineStats
from tl.entry.build import build_async_engine
from tl.entry.served import ServedModel

if TYPE_CHECKING:
    from serve.otel import Tracing

log = logging.getLogger("serve")
EngineFactory = Callable[[EngineConfig], tuple[AsyncEngine, ServedModel]]
T = TypeVar("T")


def _response_store(cfg: EngineConfig) -> ResponseStore:
    return ResponseStore(cfg.responses_store_size, cfg.responses_store_ttl_s)


class App:
    def __init__(
        self,
        config: EngineConfig | None = None,
        engine_factory: EngineFactory = build_async_engine,
        handle_signals: bool = True,
        start_health: bool = True,
    ) -> None:
        self.config = config
        self.engine_factory = engine_factory
        self.handle_signals = handle_signals
        self.start_health = start_health
        self.engine: AsyncEngine | None = None
        self.info: ServedModel | None = None
        self.metrics = Metrics(self._stats, self._backend)
        self.health = HealthServer(self.metrics, self.is_ready)
        self.loading = LoadingServer()
        self.draining = False  # from the stop signal: /readyz and /health 503
        self.refusing = False  # from drain_min_s after it: new requests 503
        self.inflight = 0
        self.jobs: set[Job | EmbedHandle] = set()
        self.responses = _response_store(config or EngineConfig())  # again at start-up, from the loaded config
        self.ping_interval_s = PING_INTERVAL_S
        self.tracing: Tracing | None = None  # serve/tracing.py: None unless OTEL_TRACES_EXPORTER asks
        self._drain_task: asyncio.Task[None] | None = None
        self._stop_heard = asyncio.Event()

    def _stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def _backend(self) -> BackendInfo | None:
        return self.engine.backend_info if self.engine is not None and self.info is not None else None

    def _worker(self) -> fleet.Worker:
        failure = self.engine.failure if self.engine is not None else None
        return fleet.Worker(
            self.is_ready() and failure is None,
            None if failure is None else str(failure),
            self._stats(),
            self.info,
            self.config or EngineConfig(),
            self.metrics,
        )

    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.ready and not self.draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except BaseException as e:  # granian serves without lifespan if startup raises
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        setup_logging()
        memwatch.start(os.environ)
        if self.config is None:
            self.config = load_config()
        cfg = self.config
        if self.tracing is None:  # tests hand the App a tracer of their own
            self.tracing = tracing.start(os.environ)
        if self.tracing is not None:
            log.info("tracing requests: OTEL_TRACES_EXPORTER=%s", os.environ.get("OTEL_TRACES_EXPORTER"))
        self.responses = _response_store(cfg)
        if self.handle_signals:
            STOP.on(self._stop_requested, self.stop_now)
        if self.start_health:
            host, port = parse_listen(cfg.health_listen)
            await self.health.start(host, port)
            log.info("health port listening on %s", cfg.health_listen)
            await self._answer_loading(cfg.http_listen)
        try:
            await self._load(cfg)
        finally:  # granian binds the API port once the start-up is over
            try:
                await asyncio.wait_for(self.loading.close(), HEALTH_CLOSE_S)
            except TimeoutError:
                log.warning("start-up: the loading answers did not close within %.1f s", HEALTH_CLOSE_S)

    async def _answer_loading(self, listen: str) -> None:
        """503 model_loading on the API port until granian takes it (serve/loading.py)."""
        host, port = parse_listen(listen)
        try:
            await self.loading.start(host, port, reuse_port=True)
        except OSError as e:
            log.warning("the API port %s answers nothing while the model loads: %s", listen, e)

    async def _load(self, cfg: EngineConfig) -> None:
        """The engine built, started and warmed up, or given up on a stop signal."""
        # A daemon thread, not the loop's executor: a stop during the build leaves it behind, and
        # the process's exit never waits for it (an executor's threads are joined at exit).
        built = _in_daemon_thread("tl-build", self.engine_factory, cfg)
        stopped = asyncio.ensure_future(self._stop_heard.wait())
        await asyncio.wait((built, stopped), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not built.done():
            log.info("stop requested during start-up: the model load and compiles are given up")
            built.add_done_callback(_close_late_engine)
            self.draining = self.refusing = True
            self._drain_task = asyncio.get_running_loop().create_task(self._hand_over())
            return
        engine, model = built.result()
        engine.start()
        self.engine = engine
        await engine.warmup()
        self.info = model
        if self._stop_heard.is_set():  # heard while warming up
            self.begin_drain()
        log.info("serving %s (context %d) ready", model.model_id, model.max_model_len)

    async def shutdown(self) -> None:
        """granian's lifespan shutdown: the engine thread stopped (at most ENGINE_STOP_S), the
        health port closed; each step timed, a slow one named."""
        t0 = time.monotonic()
        if self.engine is not None:
            stopping = _in_daemon_thread("tl-engine-stop", self.engine.shutdown, ENGINE_STOP_S)
            try:
                await asyncio.wait_for(asyncio.shield(stopping), ENGINE_STOP_WAIT_S)
            except TimeoutError:
                log.warning("shutdown: the engine thread did not stop within %.1f s; exiting anyway", ENGINE_STOP_S)
            else:
                _timed("shutdown: engine stopped", t0)
        t1 = time.monotonic()
        # the last spans' export runs beside the health port's close: the stop's bound is unchanged
        flushed = asyncio.ensure_future(self._stop_tracing(self.tracing)) if self.tracing is not None else None
        try:
            await asyncio.wait_for(self.health.close(), HEALTH_CLOSE_S)
        except TimeoutError:
            log.warning("shutdown: the health port did not close within %.1f s; exiting anyway", HEALTH_CLOSE_S)
        _timed("shutdown: health port closed", t1)
        if flushed is not None:
            await flushed
        log.info("shutdown complete in %.1f s", time.monotonic() - t0)

    async def _stop_tracing(self, tracer: Tracing) -> None:
        """The spans still buffered exported (at most TRACING_STOP_S: a collector that does not
        answer is left behind on a daemon thread)."""
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(_in_daemon_thread("tl-tracing-stop", tracer.shutdown), TRACING_STOP_S)
        except TimeoutError:
            log.warning("shutdown: spans not exported within %.1f s; exiting anyway", TRACING_STOP_S)
        else:
            _timed("shutdown: spans exported", t0)

    def _stop_requested(self) -> None:
        """A first stop signal: give the start-up up, or drain."""
        self._stop_heard.set()
        if self.engine is not None and self.engine.ready:
            self.begin_drain()

    def begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """readyz and /health 503 at once; new requests served for drain_min_s more (a router
        polling /health stops sending meanwhile), then refused with 503; in-flight ones finish or
        are aborted drain_timeout_s after the signal; then granian is told to stop."""
        self.draining = True
        timeout = self.config.drain_timeout_s if self.config else 30.0
        lame = self.config.drain_min_s if self.config else 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if lame > 0:
            log.info("stop signal: /health 503, requests still served for %.1f s (drain_min_s)", lame)
            await asyncio.sleep(lame)
        self.refusing = True
        log.info("draining: %d requests in flight, up to %.1f s", self.inflight, t0 + timeout - loop.time())
        deadline = t0 + timeout
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self.inflight:
            log.warning("drain deadline: aborting %d requests", self.inflight)
            await self._abort_all(ABORT_GRACE_S)
        log.info("drained in %.1f s", loop.time() - t0)
        await self._hand_over()

    def stop_now(self) -> None:
        """A second stop signal: every request aborted (open streams end with an error event and
        [DONE]), then granian is told to stop."""
        self.draining = self.refusing = True
        asyncio.get_running_loop().create_task(self._stop_now())

    async def _stop_now(self) -> None:
        await self._abort_all(STOP_NOW_GRACE_S)
        await self._hand_over()

    async def _abort_all(self, grace_s: float) -> None:
        for job in list(self.jobs):
            job.abort()
        loop = asyncio.get_running_loop()
        until = loop.time() + grace_s
        while self.inflight and loop.time() < until:
            await asyncio.sleep(0.01)
        if self.inflight:
            log.warning("%d requests still open %.1f s after their abort", self.inflight, grace_s)

    async def _hand_over(self) -> None:
        if self.handle_signals:
            await STOP.hand_over()

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()  # the request's arrival: TTFT and e2e count from it, its trace starts at it
        req = Request(scope, receive)
        out = Sender(send, req.request_id)
        route = match(req.path)
        endpoint = (
            route[0]
            if route
            else page.endpoint(req.path)
            or fleet.endpoint(req.path)
            or ("/healthz" if req.path == "/healthz" else "other")
        )
        trace = self.tracing.request(req, endpoint, arrived) if self.tracing is not None and route else None
        watcher: DisconnectWatcher | None = None
        counted = False
        try:
            if req.path == "/healthz":
                if req.method != "GET":
                    raise errors.method_not_allowed("GET")
                await out.whole(200, b'{"status":"ok"}')
                return
            if page.endpoint(req.path) is not None:  # the chat page: static, needs no key (serve/page.py)
                await page.answer(req, out)
                return
            if fleet.endpoint(req.path) is not None:  # a router's probes: no key (serve/fleet.py)
                await fleet.answer(req, out, self._worker())
                return
            if route is None:
                raise ApiError(
                    404, f"Unknown route {req.method} {req.path}", "invalid_request_error", None, "not_found"
                )
            _, ops = route
            r = next((op for op in ops if op.method == req.method), None)
            if r is None:
                raise errors.method_not_allowed(", ".join(op.method for op in ops))
            if self.refusing or self.engine is None or self.info is None or self.config is None:
                raise errors.draining()
            if self.engine.failure is not None:
                raise errors.unavailable(str(self.engine.failure))
            self._authorize(req)
            self.inflight += 1
            counted = True
            body = await req.body(self.config.max_body_bytes) if r.request is not None else b""
            watcher = DisconnectWatcher(receive)
            ctx = Ctx(
                self.engine,
                self.info,
                self.metrics,
                req,
                out,
                body,
                arrived,
                lambda: self.ping_interval_s,
                self.jobs,
                self.responses,
                watcher,
                trace,
            )
            await r.handler(ctx)
        except ClientGone:
            pass
        except ApiError as e:
            if trace is not None:
                trace.fail(e)
            await self._fail(out, e, route is not None and route[1][0].anthropic)
        except Exception as e:
            log.exception("request %s: unhandled error in %s %s", req.request_id, req.method, req.path)
            if trace is not None:
                trace.fail(e)
            await self._fail(out, errors.internal(), logged=True)
        finally:
            if watcher is not None:
                watcher.stop()
            if counted:
                self.inflight -= 1
            if not out.finished and out.started:
                await out.end()
            self.metrics.requests.labels(endpoint, str(out.status or 499)).inc()
            if trace is not None:
                trace.end(out.status or 499)

    async def _fail(self, out: Sender, err: ApiError, anthropic: bool = False, logged: bool = False) -> None:
        if not logged:
            log_server_error(out, err)
        if not out.started:
            await out.error(err, anthropic)
        else:
            await out.end()

    def _authorize(self, req: Request) -> None:
        keys = self.config.api_keys if self.config else ()
        if not keys:
            return
        scheme, _, token = req.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and any(hmac.compare_digest(token.strip(), k) for k in keys):
            return
        anthropic_key = req.headers.get("x-api-key", "")  # Anthropic's clients send the key here
        if anthropic_key and any(hmac.compare_digest(anthropic_key.strip(), k) for k in keys):
            return
        raise ApiError(
            401,
            "Incorrect or missing API key (Authorization: Bearer <key>)",
            "invalid_request_error",
            None,
            "invalid_api_key",
            ((b"www-authenticate", b"Bearer"),),
        )


def _in_daemon_thread(name: str, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """fn(*args) on a new daemon thread, as a future of the running loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, err: BaseException | None) -> None:
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, err = fn(*args), None
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting side
            result, err = None, e
        try:
            loop.call_soon_threadsafe(settle, result, err)
        except RuntimeError:  # the loop closed meanwhile (a stop gave the start-up up)
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def _close_late_engine(built: asyncio.Future[tuple[AsyncEngine, ServedModel]]) -> None:
    """An engine whose build outlived a stop during start-up: its background compiles stopped."""
    if not built.cancelled() and built.exception() is None:
        built.result()[0].shutdown(0.0)


def _timed(what: str, t0: float) -> None:
    took = time.monotonic() - t0
    (log.warning if took > 1.0 else log.info)("%s in %.1f s", what, took)


take_over_granian()  # granian's worker imports this module before it sets up its signals
app = App()
