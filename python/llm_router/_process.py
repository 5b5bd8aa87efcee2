"""Running the `router` binary: the launcher's exec, and the `Router` API."""

import atexit
import collections
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set

from ._binary import RouterError, binary_path
from ._mapping import RouterCommand, parse

#: Lines of the router's stderr kept for error messages.
STDERR_TAIL_LINES = 40


class PortInUseError(RouterError, OSError):
    """The router could not bind its port (or its metrics port)."""


class RouterExitedError(RouterError):
    """The router exited before it was ready. `returncode` and `stderr_tail`
    say how."""

    def __init__(self, message: str, returncode: Optional[int], stderr_tail: str):
        super().__init__(message)
        self.returncode = returncode
        self.stderr_tail = stderr_tail


class RouterNotReadyError(RouterError, TimeoutError):
    """The router did not become ready in time."""


class ConfigFile:
    """A config file for the router: an in-memory file (Linux memfd: never
    on disk, re-readable on SIGHUP, gone with the last process holding it)
    or, where there is none, a private temporary file removed by `close`.
    """

    def __init__(self, text: str, in_memory: Optional[bool] = None):
        self.fd: Optional[int] = None
        self._dir: Optional[str] = None
        data = text.encode()
        if in_memory is None:
            in_memory = hasattr(os, "memfd_create")
        if in_memory:
            self.fd = os.memfd_create("llm-router-config", 0)
            os.write(self.fd, data)
            self.path = f"/proc/self/fd/{self.fd}"
        else:
            self._dir = tempfile.mkdtemp(prefix="llm-router-")
            path = Path(self._dir) / "router.toml"
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
                file.write(data)
            self.path = str(path)

    @property
    def removed_by_exec(self) -> bool:
        """Whether exec-ing the router leaves nothing behind to clean up."""
        return self.fd is not None

    def pass_fds(self) -> Sequence[int]:
        return (self.fd,) if self.fd is not None else ()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _argv(binary: Path, command: RouterCommand, config: Optional[ConfigFile]) -> List[str]:
    argv = [str(binary)] + command.args
    if config is not None:
        argv += ["--config", config.path]
    return argv


def _environment(command: RouterCommand, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(command.env)
    if extra:
        env.update(extra)
    return env


def launch(argv: Sequence[str], binary: Optional[os.PathLike] = None) -> int:
    """Runs the router for sglang-router's command line `argv`: execs it
    (this process becomes the router), or, where the config file would
    outlive an exec, runs it as a child, forwards signals and cleans up.
    Returns only in the second case, with the router's exit code.
    """
    command = parse(argv)
    path = binary_path(binary)
    config = ConfigFile(command.config_toml) if command.config_toml is not None else None
    full_argv = _argv(path, command, config)
    env = _environment(command)
    if config is None or config.removed_by_exec:
        if config is not None and config.fd is not None:
            os.set_inheritable(config.fd, True)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(str(path), full_argv, env)
    return _supervise(full_argv, env, config)


def _supervise(argv: List[str], env: Dict[str, str], config: ConfigFile) -> int:
    child = subprocess.Popen(argv, env=env, pass_fds=config.pass_fds())
    forwarded = (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None))
    previous = {}
    for signum in filter(None, forwarded):
        previous[signum] = signal.signal(signum, lambda received, _frame: child.send_signal(received))
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        config.close()


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _connect_host(host: str) -> str:
    """Where to reach a router listening on `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _url(host: str, port: int, tls: bool = False) -> str:
    host = _connect_host(host)
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def _probe_context() -> ssl.SSLContext:
    """TLS for the readiness checks of a router this process started, on
    the port it chose: its certificate names the host clients use, which
    need not be the loopback address probed, so it is not verified here."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _flags(options: Dict[str, object]) -> List[str]:
    """`Router(**options)` -> sglang-router flags, validated by the launcher's parser."""
    flags: List[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags.append(flag)
            flags += [str(item) for item in value]
        else:
            flags += [flag, str(value)]
    return flags


#: Routers started by `Router` and not stopped yet: stopped when the
#: interpreter exits, so none outlives the program that started it.
_RUNNING: Set[subprocess.Popen] = set()


@atexit.register
def _stop_running() -> None:
    for process in list(_RUNNING):
        if process.poll() is None:
            process.kill()
            process.wait()


class Router:
    """A router over `worker_urls`, run from the wheel's binary, for tests
    and notebooks::

        with llm_router.Router(worker_urls=["http://127.0.0.1:30000"],
                               policy="least_load", port=0) as router:
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="-")

    Entering starts it and waits until it is ready (`/health` answers and
    every worker is in rotation); leaving stops it (SIGTERM, then SIGKILL).
    `port=0` (the default) takes a free port. Every other keyword is one of
    the launcher's sglang-router flags by its Python name
    (`request_timeout_secs=30`, `api_key="..."`, `prometheus_port=0`,
    `cache_threshold=0.3`, ...); an unknown or refused one raises
    `FlagError`. `env` adds environment variables (e.g.
    `ROUTER__LOAD_MONITOR__INTERVAL_MS`); `binary` runs another router
    binary than the wheel's.
    """

    def __init__(
        self,
        worker_urls: Iterable[str] = (),
        *,
        policy: str = "least_load",
        host: str = "127.0.0.1",
        port: int = 0,
        binary: Optional[os.PathLike] = None,
        env: Optional[Dict[str, str]] = None,
        startup_timeout: float = 60.0,
        wait_for_workers: bool = True,
        **options,
    ):
        self.worker_urls = list(worker_urls)
        self.host = host
        self._requested_port = port
        self._requested_metrics_port = options.get("prometheus_port")
        self._options = dict(options, policy=policy, host=host, worker_urls=self.worker_urls or None)
        # Checked now: a bad option fails here, not in start().
        parse(_flags(dict(self._options, port=port)))
        self.binary = binary_path(binary)
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.wait_for_workers = wait_for_workers
        self.port: Optional[int] = None
        self.metrics_port: Optional[int] = None
        self._command: Optional[RouterCommand] = None
        self._process: Optional[subprocess.Popen] = None
        self._config: Optional[ConfigFile] = None
        self._stderr: collections.deque = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._reader: Optional[threading.Thread] = None

    # -- what a caller reads ---------------------------------------------

    @property
    def url(self) -> str:
        """`http://host:port` of the running router (no trailing slash);
        `https://` with `tls_cert_path`."""
        if self.port is None:
            raise RouterError("the router is not started")
        return _url(self.host, self.port, self._command is not None and self._command.tls)

    @property
    def metrics_url(self) -> str:
        """Where `/metrics` is served."""
        if self._command is not None and self._command.metrics_port is not None:
            return _url(self._command.metrics_host or self.host, self._command.metrics_port) + "/metrics"
        return self.url + "/metrics"

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process is not None else None

    def stderr_tail(self) -> str:
        """The router's last lines of stderr."""
        return "\n".join(self._stderr)

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> "Router":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Router":
        """Starts the router and waits until it is ready. A free port taken
        by someone else between choosing and binding it is chosen again."""
        attempts = 3
        for attempt in range(attempts):
            picked = self._spawn()
            try:
                self.wait_ready(self.startup_timeout)
                return self
            except PortInUseError as error:
                self.stop()
                lost_a_race = any(f":{port}" in str(error) for port in picked)
                if not lost_a_race or attempt + 1 == attempts:
                    raise
            except BaseException:
                self.stop()
                raise
        return self

    def _spawn(self) -> List[int]:
        """Starts the process; returns the ports it chose itself."""
        picked = []
        port = self._requested_port or _free_port(self.host)
        if self._requested_port == 0:
            picked.append(port)
        else:
            self._check_port_free(port, "port")
        options = dict(self._options, port=port)
        if self._requested_metrics_port == 0:
            options["prometheus_port"] = _free_port(options.get("prometheus_host") or "127.0.0.1")
            picked.append(options["prometheus_port"])
        command = parse(_flags(options))
        self._command = command
        self.port = command.port
        self.metrics_port = command.metrics_port
        self._config = ConfigFile(command.config_toml) if command.config_toml is not None else None
        self._stderr.clear()
        try:
            self._process = subprocess.Popen(
                _argv(self.binary, command, self._config),
                env=_environment(command, self.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=self._config.pass_fds() if self._config is not None else (),
            )
        except OSError as error:
            self.stop()
            raise RouterError(f"could not run the router ({self.binary}): {error}") from error
        _RUNNING.add(self._process)
        self._reader = threading.Thread(target=self._read_stderr, args=(self._process,), daemon=True)
        self._reader.start()
        return picked

    def _check_port_free(self, port: int, what: str) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, port))
            except OSError as error:
                raise PortInUseError(f"{what} {port} on {self.host} is in use: {error}") from error

    def _read_stderr(self, process: subprocess.Popen) -> None:
        assert process.stderr is not None
        for raw in process.stderr:
            self._stderr.append(raw.decode(errors="replace").rstrip("\n"))

    def _exited(self) -> RouterError:
        assert self._process is not None
        if self._reader is not None:
            self._reader.join(timeout=5)
        tail = self.stderr_tail()
        code = self._process.returncode
        if "could not bind" in tail:
            return PortInUseError(f"the router could not bind its address; its stderr ends:\n{tail}")
        return RouterExitedError(
            f"the router ({self.binary}) exited with code {code} before it was ready; "
            f"its stderr ends:\n{tail or '(nothing)'}",
            code,
            tail,
        )

    def _open(self, path: str, timeout: float):
        context = _probe_context() if self.url.startswith("https://") else None
        return urllib.request.urlopen(self.url + path, timeout=timeout, context=context)

    def _get_json(self, path: str, timeout: float):
        with self._open(path, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Waits until `/health` answers and (unless `wait_for_workers` is
        false) every worker is in rotation, checking every 50 ms. Raises
        RouterExitedError (or PortInUseError) if the router exits first,
        RouterNotReadyError after `timeout` seconds."""
        if self._process is None:
            raise RouterError("the router is not started")
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            if self._process.poll() is not None:
                raise self._exited()
            try:
                with self._open("/health", timeout=2) as response:
                    healthy = response.status == 200
                if healthy and not (self.wait_for_workers and self.worker_urls):
                    return
                if healthy:
                    _, body = self._get_json("/admin/workers", timeout=2)
                    workers = body.get("workers", []) if isinstance(body, dict) else []
                    out = [w.get("url") for w in workers if not w.get("in_rotation")]
                    if len(workers) == len(self.worker_urls) and not out:
                        return
                    last = f"workers not in rotation: {', '.join(map(str, out)) or '(not added yet)'}"
            except (urllib.error.URLError, OSError, ValueError) as error:
                last = f"{self.url}: {error}"
            if time.monotonic() > deadline:
                raise RouterNotReadyError(
                    f"the router was not ready within {timeout} s ({last}); its stderr ends:\n"
                    f"{self.stderr_tail() or '(nothing)'}"
                )
            time.sleep(0.05)

    def stop(self, timeout: float = 15.0) -> Optional[int]:
        """Stops the router: SIGTERM (in-flight requests finish within its
        grace period), SIGKILL after `timeout` seconds. Returns its exit code."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            _RUNNING.discard(process)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            code = process.returncode
            if self._reader is not None:
                self._reader.join(timeout=5)
            if process.stderr is not None:
                process.stderr.close()
        if self._config is not None:
            self._config.close()
            self._config = None
        return code
