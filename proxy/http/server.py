"""Running the app: one serving process, or a supervisor with N worker processes.

We own the process's signals rather than rely on how uvicorn installs its handlers
(docs/architecture.md, "Clean shutdown"). uvicorn's server runs in a thread of its own:
Python delivers signals to the main thread only, so uvicorn installs none there. The
main thread catches SIGTERM/SIGINT, starts the app's own shutdown at once through
``ShutdownSignal`` (fetches cancelled, leases released: another replica takes over in
milliseconds), then asks the server to drain and stop through ``should_exit``, the
switch uvicorn documents for stopping a server it did not start from the command line.
SIGHUP reads the release policy again (``ReloadSignal``, docs/architecture.md, "Release
policy").

With ``--workers N`` the supervisor binds the socket once, starts N spawned worker
processes that share it, forwards signals to them (SIGHUP too: each worker reloads on
its own) and restarts one that dies.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

from proxy.config.settings import Settings
from proxy.runtime.logs import configure_logging

log = logging.getLogger("proxy.server")

GRACEFUL_SHUTDOWN_S = 10  # in-flight responses get this long to finish on SIGTERM
KEEP_ALIVE_TIMEOUT_S = 5  # an idle keep-alive connection is closed after this
WORKER_STOP_TIMEOUT_S = GRACEFUL_SHUTDOWN_S + 20
WORKER_RESTART_DELAY_S = 1.0
PARENT_CHECK_INTERVAL_S = 0.5
LISTEN_BACKLOG = 2048
STARTUP_FAILED = 1  # run_process's status when the server never started
# Descriptors kept for everything but client connections (database, files being read
# and written, upstream sockets, pipes); each connection may hold one more (a blob).
FD_RESERVE = 256
FDS_PER_CONNECTION = 2
OPEN_FILES_WANTED = 65536
# Fewer connections than this per process is worth a warning at start (a soft limit of
# 1,024 gives 384: a thousand idle connections would take them all).
CONNECTIONS_WARN_BELOW = 4096


class BindError(Exception):
    """The listen address cannot be bound (in use, not ours, bad host)."""


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise BindError(f"server.listen: cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files towards its hard limit (workers
    inherit it); (the limit before, the limit now). systemd and many shells give 1,024:
    a thousand idle connections would leave no descriptor for a real request."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_limit(open_files: int) -> int:
    """How many connections one process serves at once: beyond it, requests get a 503
    (uvicorn's limit_concurrency) instead of the reset a lack of descriptors gives."""
    return max(16, (open_files - FD_RESERVE) // FDS_PER_CONNECTION)


@dataclass(frozen=True)
class LogOptions:
    """How every process of the server logs (passed on to spawned workers)."""

    level: str = "info"
    format: str = "text"
    access: bool = True

    def configure(self) -> None:
        configure_logging(self.level, self.format, self.access)


def serve(settings: Settings, workers: int, logs: LogOptions) -> int:
    """Serve until SIGTERM/SIGINT; the process's exit status."""
    before, now = raise_open_files_limit()
    raised = f" (raised from {before})" if now != before else ""
    connections = connection_limit(now)
    if connections < CONNECTIONS_WARN_BELOW:
        log.warning(
            "open files limit %s%s, the hard limit: at most %d connections per process; "
            "raise it (systemd LimitNOFILE, docker --ulimit nofile) to serve more",
            now,
            raised,
            connections,
        )
    else:
        log.info(
            "open files limit %s%s: at most %d connections per process", now, raised, connections
        )
    sock = bind(settings.host, settings.port)
    log.info(
        "listening on %s with %d worker%s (access log %s)",
        settings.base_url,
        workers,
        "" if workers == 1 else "s",
        "on" if logs.access else "off",
    )
    if workers == 1:
        return run_process(settings, sock, logs)
    return supervise(settings, sock, workers, logs)


def run_process(
    settings: Settings, sock: socket.socket, logs: LogOptions, parent_pid: int | None = None
) -> int:
    """Serve on ``sock`` in this process until a signal (or the parent's death)."""
    import uvicorn

    from proxy.http.app import ReloadSignal, ShutdownSignal, create_app
    from proxy.http.protocol import GuardedHttpToolsProtocol

    shutdown, reload = ShutdownSignal(), ReloadSignal()
    open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    tls = settings.tls
    config = uvicorn.Config(
        create_app(settings, shutdown=shutdown, reload=reload),
        loop="uvloop",
        http=GuardedHttpToolsProtocol,
        lifespan="on",
        access_log=False,  # ours (http/access_log.py) says what the cache did, too
        log_config=None,
        log_level=logs.level,
        ssl_certfile=str(tls.cert) if tls is not None else None,
        ssl_keyfile=str(tls.key) if tls is not None else None,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        server_header=False,
        limit_concurrency=connection_limit(open_files),
        # uvicorn takes the client from X-Forwarded-For only from these peers (its own
        # default reads FORWARDED_ALLOW_IPS, a variable no setting of ours names).
        forwarded_allow_ips=list(settings.trusted_proxies),
    )
    server = uvicorn.Server(config)

    def stop(signum: int, frame: FrameType | None) -> None:
        if server.should_exit and signum == signal.SIGINT:
            server.force_exit = True  # a second Ctrl+C: stop waiting for connections
        shutdown.request()
        server.should_exit = True

    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="http-server", daemon=True
    )
    frozen = False
    with _handling_signals(stop, lambda signum, frame: reload.request()):
        thread.start()
        while thread.is_alive():
            thread.join(PARENT_CHECK_INTERVAL_S)
            if server.started and not frozen:
                # What start-up made lives as long as the process: out of the collector's
                # sight, a full collection walks only what requests made since (a miss
                # path's was 38 ms, 7.6% of a full-path load's time; bench/hits.py).
                gc.freeze()
                frozen = True
            if parent_pid is not None and os.getppid() != parent_pid and not server.should_exit:
                log.warning("the supervisor is gone; stopping")
                stop(signal.SIGTERM, None)
    return 0 if server.started else STARTUP_FAILED


def supervise(settings: Settings, sock: socket.socket, workers: int, logs: LogOptions) -> int:
    """Run ``workers`` processes on one socket; forward signals; replace dead workers.

    The first SIGTERM/SIGINT is passed on as SIGTERM (a clean stop); a second SIGINT
    (Ctrl+C again) as SIGINT, which stops waiting for open connections. Workers run in
    a process group of their own, so a terminal's Ctrl+C reaches them only through us.
    A worker that fails to start stops the whole server (a restart would fail again).
    """
    metrics_dir, owned = _prepare_metrics_dir()
    context = multiprocessing.get_context("spawn")
    args = (settings, sock, logs, os.getpid())

    def start() -> multiprocessing.process.BaseProcess:
        process = context.Process(target=_worker_main, args=args, name="proxy-worker")
        # A new worker inherits SIGHUP blocked, until its handler is in place: one
        # forwarded before would end it (the default action) instead of reloading.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        return process

    processes = [start() for _ in range(workers)]
    signals: list[int] = []
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)
        forward = signal.SIGINT if len(signals) > 1 and signum == signal.SIGINT else signal.SIGTERM
        stopping.set()
        for process in processes:
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, forward)

    reloads: list[int] = []  # (no lock in a signal handler: a list's append is atomic)

    def reload(signum: int, frame: FrameType | None) -> None:
        reloads.append(signum)  # a worker started from now on is told too (see restart)
        for process in processes:
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGHUP)

    def restart(i: int) -> None:
        process = processes[i] = start()
        # Its settings are those we started with: after a reload, the policy of the
        # file now is read again (the signal waits, blocked, until it can be handled;
        # a reload in between may tell it twice, which is harmless).
        if reloads and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGHUP)

    status = 0
    try:
        with _handling_signals(stop, reload):
            while not stopping.is_set():
                for i, process in enumerate(processes):
                    if process.is_alive() or stopping.is_set():
                        continue
                    _forget_worker_metrics(process.pid)
                    if process.exitcode == STARTUP_FAILED:
                        log.error("a worker failed to start; stopping the server")
                        status = 1
                        stop(signal.SIGTERM, None)
                        break
                    log.error(
                        "worker %s exited with status %s; starting another",
                        process.pid,
                        process.exitcode,
                    )
                    time.sleep(WORKER_RESTART_DELAY_S)
                    if not stopping.is_set():
                        restart(i)
                stopping.wait(PARENT_CHECK_INTERVAL_S)
            deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
            for process in processes:
                process.join(max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    log.error("worker %s did not stop in time; killing it", process.pid)
                    process.kill()
                    process.join(5)
    finally:
        sock.close()
        if owned:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return status


def _worker_main(
    settings: Settings, sock: socket.socket, logs: LogOptions, parent_pid: int
) -> None:
    os.setpgrp()  # a terminal's Ctrl+C goes to the supervisor, which passes it on once
    logs.configure()
    raise SystemExit(run_process(settings, sock, logs, parent_pid))


Handler = Callable[[int, FrameType | None], None]


@contextlib.contextmanager
def _handling_signals(stop: Handler, reload: Handler) -> Iterator[None]:
    """SIGTERM and SIGINT stop; SIGHUP reloads the release policy."""
    handlers = {signal.SIGTERM: stop, signal.SIGINT: stop, signal.SIGHUP: reload}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # see supervise's start
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _prepare_metrics_dir() -> tuple[str, bool]:
    """The folder where workers' metrics meet; ``(path, created here)``. An operator's
    ``PROMETHEUS_MULTIPROC_DIR`` has already been replaced by a private folder inside it
    (``cli.private_metrics_dir``), so nothing of theirs is read or removed."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        return given, False
    path = tempfile.mkdtemp(prefix="proxy-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path, True


def _forget_worker_metrics(pid: int | None) -> None:
    if pid is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
