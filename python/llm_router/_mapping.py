"""sglang-router's command line, mapped onto this router's configuration.

`parse(argv)` reads sglang-router's flags (`python -m
sglang_router.launch_router ...`) and returns a `RouterCommand`: the
`router` binary's own flags, the `ROUTER__SECTION__KEY` environment it
needs, and, only when `--api-key` is given, a TOML config holding the
workers with their key. A flag this router has no equivalent for, or a
value it cannot honour, raises `FlagError`, which names the flag; nothing
is ignored silently.
"""

import argparse
import dataclasses
import math
from typing import Dict, List, Optional, Sequence

#: sglang-router's defaults where they differ from this router's and the
#: launcher keeps sglang-router's (a drop-in command line behaves the same).
SGLANG_HOST = "127.0.0.1"
SGLANG_PORT = 30000
SGLANG_POLICY = "cache_aware"
SGLANG_PROMETHEUS_HOST = "127.0.0.1"
SGLANG_PROMETHEUS_PORT = 29000
SGLANG_OTLP_ENDPOINT = "localhost:4317"

#: This router's policies (`[policy] kind`); sglang-router's four are among them.
POLICIES = (
    "cache_aware",
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "least_requests",
    "consistent_hash",
)

#: sglang-router's log levels and the `RUST_LOG` filter each becomes.
LOG_LEVELS = {
    "debug": "debug,async_nats=warn",
    "info": "info,async_nats=warn",
    "warn": "warn",
    "warning": "warn",
    "error": "error",
    "critical": "error",
}

#: The router's first-byte deadline (`server.first_byte_timeout_ms`); a
#: shorter `--request-timeout-secs` lowers it too, since it may not exceed
#: the whole request's deadline.
FIRST_BYTE_TIMEOUT_MS = 30_000

#: Flags that tune `[policy.cache_aware]`: sglang-router flag -> key.
CACHE_AWARE_KEYS = {
    "cache_threshold": "cache_threshold",
    "balance_abs_threshold": "balance_abs_threshold",
    "balance_rel_threshold": "balance_rel_threshold",
    "eviction_interval_secs": "eviction_interval_secs",
    "max_tree_size": "max_tree_tokens",
}

_NO_MTLS = (
    "this router presents no client certificate to its workers (no mutual TLS); "
    "it verifies https:// workers against --ca-cert-paths or the system's roots"
)
_NO_PD = "this router has no prefill-decode disaggregation; route to whole workers with --worker-urls"
_NO_K8S = "this router has no Kubernetes service discovery; list workers with --worker-urls, or add them with POST /admin/workers"
_NO_TOKENIZER = "this router does not tokenize, parse or template requests: it forwards them to the workers as they are"
_NO_HISTORY = "this router stores no conversation history"
_NO_RATE_LIMIT = (
    "this router has no concurrency limit or token bucket; at saturation requests "
    "wait in its admission queue (the [admission] section: max_queue_requests, TTFT deadlines)"
)
_NO_BACKOFF = (
    "this router retries at once on another worker, never the same one after a backoff; "
    "--retry-max-retries sets how many attempts"
)
_NO_BREAKER = (
    "this router ejects failing workers instead of a circuit breaker (the "
    "[outlier_detection] section of a config file)"
)
_NO_AUTH = "this router has no control-plane keys or JWT; set [admin] api_key in a config file"

#: sglang-router flags that have no meaning here, and why.
REFUSED: Dict[str, str] = {
    "--pd-disaggregation": _NO_PD,
    "--prefill": _NO_PD,
    "--decode": _NO_PD,
    "--prefill-policy": _NO_PD,
    "--decode-policy": _NO_PD,
    "--mini-lb": _NO_PD,
    "--bootstrap-port-annotation": _NO_PD,
    "--worker-startup-timeout-secs": (
        "this router does not wait for workers at start: it serves at once and takes "
        "each worker into rotation when its health check passes"
    ),
    "--worker-startup-check-interval": (
        "this router does not wait for workers at start (see --health-check-interval-secs)"
    ),
    "--dp-aware": "this router has no data-parallel-rank-aware scheduling; list each DP rank's server as a worker",
    "--enable-igw": "this router serves one fleet of one model, not an inference gateway of several",
    "--max-idle-secs": "this router has no manual (routing-key) policy",
    "--assignment-mode": "this router has no manual (routing-key) policy",
    "--bucket-adjust-interval-secs": "this router has no bucket policy",
    "--log-dir": "this router logs to stderr only; redirect it, or let your supervisor collect it",
    "--service-discovery": _NO_K8S,
    "--selector": _NO_K8S,
    "--service-discovery-port": _NO_K8S,
    "--service-discovery-namespace": _NO_K8S,
    "--prefill-selector": _NO_K8S,
    "--decode-selector": _NO_K8S,
    "--prometheus-duration-buckets": "this router's histogram buckets are fixed",
    "--request-id-headers": "this router does not read request-id headers",
    "--max-concurrent-requests": _NO_RATE_LIMIT,
    "--queue-size": _NO_RATE_LIMIT,
    "--queue-timeout-secs": _NO_RATE_LIMIT,
    "--rate-limit-tokens-per-second": _NO_RATE_LIMIT,
    "--cors-allowed-origins": "this router sends no CORS headers",
    "--retry-initial-backoff-ms": _NO_BACKOFF,
    "--retry-max-backoff-ms": _NO_BACKOFF,
    "--retry-backoff-multiplier": _NO_BACKOFF,
    "--retry-jitter-factor": _NO_BACKOFF,
    "--cb-failure-threshold": _NO_BREAKER,
    "--cb-success-threshold": _NO_BREAKER,
    "--cb-timeout-duration-secs": _NO_BREAKER,
    "--cb-window-duration-secs": _NO_BREAKER,
    "--disable-circuit-breaker": _NO_BREAKER,
    "--disable-health-check": "this router always checks its workers' health",
    "--model-path": _NO_TOKENIZER,
    "--tokenizer-path": _NO_TOKENIZER,
    "--chat-template": _NO_TOKENIZER,
    "--tokenizer-cache-enable-l0": _NO_TOKENIZER,
    "--tokenizer-cache-l0-max-entries": _NO_TOKENIZER,
    "--tokenizer-cache-enable-l1": _NO_TOKENIZER,
    "--tokenizer-cache-l1-max-memory": _NO_TOKENIZER,
    "--reasoning-parser": _NO_TOKENIZER,
    "--tool-call-parser": _NO_TOKENIZER,
    "--mcp-config-path": "this router has no MCP integration",
    "--backend": "this router routes to SGLang, vLLM and TokenSpeed workers (name one as BACKEND=URL in --worker-urls), not to OpenAI",
    "--history-backend": _NO_HISTORY,
    "--oracle-wallet-path": _NO_HISTORY,
    "--oracle-tns-alias": _NO_HISTORY,
    "--oracle-connect-descriptor": _NO_HISTORY,
    "--oracle-username": _NO_HISTORY,
    "--oracle-password": _NO_HISTORY,
    "--oracle-pool-min": _NO_HISTORY,
    "--oracle-pool-max": _NO_HISTORY,
    "--oracle-pool-timeout-secs": _NO_HISTORY,
    "--postgres-db-url": _NO_HISTORY,
    "--postgres-pool-max": _NO_HISTORY,
    "--redis-url": _NO_HISTORY,
    "--redis-key-prefix": "this router has no manual (routing-key) policy",
    "--redis-pool-max": _NO_HISTORY,
    "--redis-retention-days": _NO_HISTORY,
    "--client-cert-path": _NO_MTLS,
    "--client-key-path": _NO_MTLS,
    "--control-plane-api-keys": _NO_AUTH,
    "--control-plane-audit-enabled": _NO_AUTH,
    "--jwt-issuer": _NO_AUTH,
    "--jwt-audience": _NO_AUTH,
    "--jwt-jwks-uri": _NO_AUTH,
    "--jwt-role-mapping": _NO_AUTH,
}


class FlagError(ValueError):
    """A flag this router cannot take: it names the flag and says why."""

    def __init__(self, flag: str, reason: str):
        super().__init__(f"{flag}: {reason}")
        self.flag = flag
        self.reason = reason


@dataclasses.dataclass
class RouterCommand:
    """How to run the `router` binary for a command line.

    `args` are its flags (without the program name); `env` is added to the
    environment it runs in; `config_toml`, when not None, is a config file
    to pass as `--config PATH` (it holds the workers when they carry an API
    key, which no flag or environment variable can set).
    """

    args: List[str]
    env: Dict[str, str]
    config_toml: Optional[str]
    host: str
    port: int
    metrics_host: Optional[str]
    metrics_port: Optional[int]
    worker_specs: List[str]
    #: Whether the router's port speaks TLS (`--tls-cert-path`): its URL is
    #: https://. The metrics listener stays plain HTTP.
    tls: bool = False


class _Parser(argparse.ArgumentParser):
    """argparse, raising FlagError instead of exiting."""

    def error(self, message):  # noqa: D401 - argparse's signature
        # argparse says "argument --port: invalid int value: 'x'".
        flag = "launch_router"
        if message.startswith("argument "):
            flag, _, message = message[len("argument "):].partition(": ")
        raise FlagError(flag, message)


def build_parser(prog: str = "python -m llm_router.launch_router") -> argparse.ArgumentParser:
    """The launcher's parser: sglang-router's flags that mean something here."""
    parser = _Parser(
        prog=prog,
        allow_abbrev=False,
        description=(
            "Start llm-router with sglang-router's command line. Flags of "
            "sglang-router that have no meaning here are refused (exit code 2), "
            "never ignored; python/README.md has the whole table."
        ),
    )
    add = parser.add_argument
    add("--worker-urls", nargs="+", action="extend", default=[], metavar="URL",
        help="SGLang workers (http://host:port or https://host:port); BACKEND=URL names "
        "another backend (vllm=..., tokenspeed=URL,loads=grpc://...)")
    add("--policy", default=None,
        help=f"{', '.join(POLICIES)} (default: {SGLANG_POLICY}, as sglang-router)")
    add("--host", default=None, help=f"listen address (default: {SGLANG_HOST})")
    add("--port", type=int, default=None, help=f"listen port (default: {SGLANG_PORT})")
    add("--prometheus-host", default=None,
        help=f"serve /metrics on a listener of its own at this address (default: {SGLANG_PROMETHEUS_HOST})")
    add("--prometheus-port", type=int, default=None,
        help=f"serve /metrics on a listener of its own at this port (with only "
        f"--prometheus-host: {SGLANG_PROMETHEUS_PORT}); without either, /metrics is on --port")
    add("--request-timeout-secs", type=float, default=None,
        help="the whole request's deadline (server.request_deadline_ms)")
    add("--max-payload-size", type=int, default=None,
        help="largest request body, bytes (server.body_limit_bytes)")
    add("--health-check-interval-secs", type=float, default=None, help="health.interval_ms")
    add("--health-check-timeout-secs", type=float, default=None, help="health.timeout_ms")
    add("--health-failure-threshold", type=int, default=None, help="health.failure_threshold")
    add("--health-success-threshold", type=int, default=None, help="health.success_threshold")
    add("--health-check-endpoint", default=None, help="only /health (what this router checks)")
    add("--api-key", default=None, help="the key the router sends to every worker (Authorization: Bearer)")
    add("--log-level", default=None, choices=sorted(LOG_LEVELS), help="RUST_LOG")
    add("--retry-max-retries", type=int, default=None,
        help="attempts per request, the first included (server.max_retries = N - 1)")
    add("--disable-retries", action="store_true", help="server.max_retries = 0")
    add("--shutdown-grace-period-secs", type=float, default=None, help="server.shutdown_grace_ms")
    add("--cache-threshold", type=float, default=None, help="policy.cache_aware.cache_threshold")
    add("--balance-abs-threshold", type=int, default=None, help="policy.cache_aware.balance_abs_threshold")
    add("--balance-rel-threshold", type=float, default=None, help="policy.cache_aware.balance_rel_threshold")
    add("--eviction-interval-secs", "--eviction-interval", dest="eviction_interval_secs",
        type=int, default=None, help="policy.cache_aware.eviction_interval_secs")
    add("--max-tree-size", type=int, default=None, help="policy.cache_aware.max_tree_tokens")
    add("--tls-cert-path", default=None,
        help="serve TLS on --port with this PEM certificate chain (server.tls.cert_file; "
        "with --tls-key-path)")
    add("--tls-key-path", default=None,
        help="the PEM private key of --tls-cert-path (server.tls.key_file)")
    add("--enable-trace", action="store_true",
        help="export OpenTelemetry traces over OTLP/gRPC (tracing.enabled)")
    add("--otlp-traces-endpoint", default=None, metavar="HOST:PORT",
        help="the OTLP/gRPC collector, host:port or http://host:port (tracing.otlp_endpoint; "
        f"default {SGLANG_OTLP_ENDPOINT}, as sglang-router)")
    add("--ca-cert-paths", nargs="*", default=[], metavar="PATH",
        help="one PEM file of the CA certificates https:// workers are verified against "
        "(worker_tls.ca_file; default: the system's roots)")
    return parser


def parse(argv: Sequence[str]) -> RouterCommand:
    """The `RouterCommand` for sglang-router's command line `argv`."""
    argv = list(argv)
    _refuse_unknown(argv)
    args = build_parser().parse_args(argv)
    return _map(args)


def _refuse_unknown(argv: List[str]) -> None:
    """Refuses the first flag the launcher does not map, by name."""
    known = set()
    for action in build_parser()._actions:
        known.update(action.option_strings)
    for token in argv:
        if token == "--":
            raise FlagError("--", "the launcher takes no positional arguments")
        if not token.startswith("--"):
            continue
        flag = token.split("=", 1)[0]
        if flag in known:
            continue
        if flag in REFUSED:
            raise FlagError(flag, f"not supported: {REFUSED[flag]}")
        if flag.startswith("--router-") and ("--" + flag[len("--router-"):]) in known | set(REFUSED):
            raise FlagError(flag, f"use {('--' + flag[len('--router-'):])} (the launcher takes no --router- prefix)")
        raise FlagError(flag, "unknown flag (not one of sglang-router's that this router maps; see --help)")


def _positive(flag: str, value, what: str = "a number > 0") -> None:
    if value is None:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise FlagError(flag, f"{value!r} cannot be honoured: must be {what}")


def _millis(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


def _port(flag: str, value: int) -> int:
    if not 0 <= value <= 65535:
        raise FlagError(flag, f"{value} is not a port (0 to 65535)")
    return value


def _worker_spec(url: str) -> str:
    """`--worker-urls` entry -> the router's `--worker` spec."""
    head = url.split(",", 1)[0]
    backend, sep, address = head.partition("=")
    if not sep:
        # sglang-router's workers are SGLang servers; naming the backend
        # means a worker that is down at start is only out of rotation.
        backend, address, url = "sglang", head, "sglang=" + url
    scheme = next((s for s in ("http://", "https://") if address.startswith(s)), None)
    if scheme is None or len(address) <= len(scheme):
        raise FlagError("--worker-urls", f"{url!r} is not an http://host:port or https://host:port URL "
                        "(or BACKEND=URL)")
    if not backend:
        raise FlagError("--worker-urls", f"{url!r} names no backend before '='")
    return url


def toml_string(value: str) -> str:
    """`value` as a TOML basic string."""
    out = ['"']
    for char in value:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _workers_toml(specs: List[str], api_key: str) -> str:
    lines = ["# Written by llm_router.launch_router: the workers with --api-key."]
    for spec in specs:
        head, _, rest = spec.partition(",")
        backend, _, url = head.partition("=")
        lines += ["", "[[workers]]", f"url = {toml_string(url)}", f"backend = {toml_string(backend)}"]
        for part in filter(None, rest.split(",")):
            name, _, value = part.partition("=")
            if name.strip() != "loads":
                raise FlagError("--worker-urls", f"{spec!r}: only loads=LOAD_URL may follow the URL")
            lines.append(f"load_url = {toml_string(value.strip())}")
        lines.append(f"api_key = {toml_string(api_key)}")
    return "\n".join(lines) + "\n"


def _map(args: argparse.Namespace) -> RouterCommand:
    env: Dict[str, str] = {}
    router_args: List[str] = []

    host = args.host if args.host is not None else SGLANG_HOST
    if not host.strip():
        raise FlagError("--host", "must be a host name or IP address")
    port = _port("--port", args.port if args.port is not None else SGLANG_PORT)
    router_args += ["--host", host, "--port", str(port)]

    policy = args.policy if args.policy is not None else SGLANG_POLICY
    if policy in ("manual", "bucket"):
        raise FlagError("--policy", f"{policy!r} is not supported: this router has no {policy} policy; "
                        f"choose one of {', '.join(POLICIES)}")
    if policy not in POLICIES:
        raise FlagError("--policy", f"{policy!r} is not a policy; choose one of {', '.join(POLICIES)}")
    router_args += ["--policy", policy]

    for name, key in CACHE_AWARE_KEYS.items():
        value = getattr(args, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if policy != "cache_aware":
            raise FlagError(flag, f"applies only to --policy cache_aware (this command line has --policy {policy})")
        checks = {
            "cache_threshold": (lambda v: math.isfinite(v) and 0 <= v <= 1, "a number from 0 to 1"),
            "balance_abs_threshold": (lambda v: v >= 0, "an integer >= 0"),
            "balance_rel_threshold": (lambda v: math.isfinite(v) and v >= 1, "a finite number >= 1"),
            "eviction_interval_secs": (lambda v: v >= 0, "an integer >= 0"),
            "max_tree_size": (lambda v: v >= 1, "an integer >= 1 (read as prompt tokens)"),
        }
        valid, allowed = checks[name]
        if not valid(value):
            raise FlagError(flag, f"{value!r} cannot be honoured: must be {allowed}")
        env[f"ROUTER__POLICY__CACHE_AWARE__{key.upper()}"] = repr(value) if isinstance(value, float) else str(value)

    metrics_host = metrics_port = None
    if args.prometheus_host is not None or args.prometheus_port is not None:
        metrics_host = args.prometheus_host if args.prometheus_host is not None else SGLANG_PROMETHEUS_HOST
        if not metrics_host.strip():
            raise FlagError("--prometheus-host", "must be a host name or IP address")
        metrics_port = _port(
            "--prometheus-port",
            args.prometheus_port if args.prometheus_port is not None else SGLANG_PROMETHEUS_PORT,
        )
        if metrics_port != 0 and metrics_port == port and metrics_host == host:
            raise FlagError("--prometheus-port", f"{metrics_port} is also --port: /metrics needs a port of its own")
        env["ROUTER__SERVER__METRICS_HOST"] = metrics_host
        env["ROUTER__SERVER__METRICS_PORT"] = str(metrics_port)

    if args.request_timeout_secs is not None:
        _positive("--request-timeout-secs", args.request_timeout_secs)
        deadline_ms = int(_millis(args.request_timeout_secs))
        env["ROUTER__SERVER__REQUEST_DEADLINE_MS"] = str(deadline_ms)
        if deadline_ms < FIRST_BYTE_TIMEOUT_MS:
            env["ROUTER__SERVER__FIRST_BYTE_TIMEOUT_MS"] = str(deadline_ms)
    if args.max_payload_size is not None:
        _positive("--max-payload-size", args.max_payload_size, "a number of bytes >= 1")
        env["ROUTER__SERVER__BODY_LIMIT_BYTES"] = str(args.max_payload_size)
    if args.health_check_interval_secs is not None:
        _positive("--health-check-interval-secs", args.health_check_interval_secs)
        env["ROUTER__HEALTH__INTERVAL_MS"] = _millis(args.health_check_interval_secs)
    if args.health_check_timeout_secs is not None:
        _positive("--health-check-timeout-secs", args.health_check_timeout_secs)
        env["ROUTER__HEALTH__TIMEOUT_MS"] = _millis(args.health_check_timeout_secs)
    for flag, value, key in (
        ("--health-failure-threshold", args.health_failure_threshold, "FAILURE_THRESHOLD"),
        ("--health-success-threshold", args.health_success_threshold, "SUCCESS_THRESHOLD"),
    ):
        if value is not None:
            _positive(flag, value, "an integer >= 1")
            env[f"ROUTER__HEALTH__{key}"] = str(value)
    if args.health_check_endpoint is not None and args.health_check_endpoint != "/health":
        raise FlagError("--health-check-endpoint",
                        f"{args.health_check_endpoint!r} cannot be honoured: this router checks GET /health")

    if args.disable_retries and args.retry_max_retries is not None:
        raise FlagError("--retry-max-retries", "contradicts --disable-retries")
    if args.disable_retries:
        env["ROUTER__SERVER__MAX_RETRIES"] = "0"
    elif args.retry_max_retries is not None:
        _positive("--retry-max-retries", args.retry_max_retries, "at least 1 (attempts, the first included)")
        env["ROUTER__SERVER__MAX_RETRIES"] = str(args.retry_max_retries - 1)
    if args.shutdown_grace_period_secs is not None:
        grace = args.shutdown_grace_period_secs
        if not (math.isfinite(grace) and grace >= 0):
            raise FlagError("--shutdown-grace-period-secs", f"{grace!r} cannot be honoured: must be >= 0")
        env["ROUTER__SERVER__SHUTDOWN_GRACE_MS"] = str(round(grace * 1000))

    if args.log_level is not None:
        env["RUST_LOG"] = LOG_LEVELS[args.log_level]

    tls = _map_tls(args, env)
    _map_tracing(args, env)

    specs = [_worker_spec(url) for url in args.worker_urls]
    config_toml = None
    if args.api_key is not None:
        key = args.api_key
        if not key or any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
            raise FlagError("--api-key", "cannot be honoured: must be non-empty, without control characters")
        if not specs:
            raise FlagError("--api-key", "is the key sent to the workers, and no --worker-urls were given")
        config_toml = _workers_toml(specs, key)
    else:
        for spec in specs:
            router_args += ["--worker", spec]

    return RouterCommand(
        args=router_args,
        env=env,
        config_toml=config_toml,
        host=host,
        port=port,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        worker_specs=specs,
        tls=tls,
    )


def _map_tracing(args: argparse.Namespace, env: Dict[str, str]) -> None:
    """`[tracing]` from sglang-router's trace flags. sglang-router takes the
    endpoint as host:port; the router's key is a URL."""
    endpoint = args.otlp_traces_endpoint
    if endpoint is not None and not args.enable_trace:
        raise FlagError("--otlp-traces-endpoint", "is used only with --enable-trace")
    if not args.enable_trace:
        return
    endpoint = endpoint if endpoint is not None else SGLANG_OTLP_ENDPOINT
    if not endpoint.strip() or "://" in endpoint and not endpoint.startswith("http://"):
        raise FlagError("--otlp-traces-endpoint",
                        f"{endpoint!r} cannot be honoured: must be host:port or http://host:port (OTLP/gRPC)")
    env["ROUTER__TRACING__ENABLED"] = "true"
    env["ROUTER__TRACING__OTLP_ENDPOINT"] = endpoint if "://" in endpoint else f"http://{endpoint}"


def _map_tls(args: argparse.Namespace, env: Dict[str, str]) -> bool:
    """`[server.tls]` and `[worker_tls]` from sglang-router's TLS flags;
    whether the router's port speaks TLS."""
    cert, key = args.tls_cert_path, args.tls_key_path
    if (cert is None) != (key is None):
        given, missing = ("--tls-cert-path", "--tls-key-path") if key is None else ("--tls-key-path", "--tls-cert-path")
        raise FlagError(given, f"needs {missing} too: the certificate and its key")
    for flag, value in (("--tls-cert-path", cert), ("--tls-key-path", key)):
        if value is not None and not value.strip():
            raise FlagError(flag, "must be a file path")
    if cert is not None:
        env["ROUTER__SERVER__TLS__CERT_FILE"] = cert
        env["ROUTER__SERVER__TLS__KEY_FILE"] = key
    ca_paths = args.ca_cert_paths
    if len(ca_paths) > 1:
        raise FlagError("--ca-cert-paths", f"{len(ca_paths)} files cannot be honoured: this router reads "
                        "one PEM file of CA certificates (worker_tls.ca_file); concatenate them into one")
    if ca_paths:
        if not ca_paths[0].strip():
            raise FlagError("--ca-cert-paths", "must be a file path")
        env["ROUTER__WORKER_TLS__CA_FILE"] = ca_paths[0]
    return cert is not None
