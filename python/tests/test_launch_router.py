"""The launcher's flag mapping: pure (no router runs), except the last
class, which execs a stand-in binary to see what the router would get."""

import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import tomllib
import unittest
from pathlib import Path

from llm_router import FlagError, parse
from llm_router._mapping import REFUSED

WORKERS = ["--worker-urls", "http://10.0.0.1:30000", "http://10.0.0.2:30000"]


def refused(test: unittest.TestCase, argv, flag: str, *words: str) -> str:
    with test.assertRaises(FlagError) as caught:
        parse(argv)
    test.assertEqual(caught.exception.flag, flag, str(caught.exception))
    message = str(caught.exception)
    test.assertTrue(message.startswith(flag), message)
    for word in words:
        test.assertIn(word, message)
    return message


class Defaults(unittest.TestCase):
    def test_sglang_routers_defaults_where_they_differ(self):
        command = parse(WORKERS)
        self.assertEqual(
            command.args,
            ["--host", "127.0.0.1", "--port", "30000", "--policy", "cache_aware",
             "--worker", "sglang=http://10.0.0.1:30000", "--worker", "sglang=http://10.0.0.2:30000"],
        )
        self.assertEqual(command.env, {}, "nothing else is set: the router's own defaults")
        self.assertIsNone(command.config_toml)
        self.assertIsNone(command.metrics_port, "/metrics stays on the main port")

    def test_no_workers_is_a_router_with_none(self):
        command = parse([])
        self.assertNotIn("--worker", command.args)


class EachFlag(unittest.TestCase):
    def test_worker_urls(self):
        command = parse(["--worker-urls", "http://a:1", "--worker-urls", "http://b:2",
                         "vllm=http://c:3", "tokenspeed=http://d:4,loads=grpc://d:5"])
        workers = [command.args[i + 1] for i, arg in enumerate(command.args) if arg == "--worker"]
        self.assertEqual(workers, ["sglang=http://a:1", "sglang=http://b:2", "vllm=http://c:3",
                                   "tokenspeed=http://d:4,loads=grpc://d:5"])
        refused(self, ["--worker-urls", "a:1"], "--worker-urls", "http://host:port")
        refused(self, ["--worker-urls", "https://"], "--worker-urls", "https://host:port")
        refused(self, ["--worker-urls", "=http://a:1"], "--worker-urls", "backend")

    def test_https_workers_are_taken_as_they_are(self):
        command = parse(["--worker-urls", "https://a:8443", "vllm=https://b:8443/engine"])
        workers = [command.args[i + 1] for i, arg in enumerate(command.args) if arg == "--worker"]
        self.assertEqual(workers, ["sglang=https://a:8443", "vllm=https://b:8443/engine"])
        self.assertEqual(command.env, {}, "the system's roots unless --ca-cert-paths says otherwise")
        self.assertFalse(command.tls, "https workers say nothing of the router's own port")

    def test_tls_on_the_routers_port(self):
        command = parse(["--tls-cert-path", "/etc/router/cert.pem", "--tls-key-path", "/etc/router/key.pem"])
        self.assertEqual(command.env, {
            "ROUTER__SERVER__TLS__CERT_FILE": "/etc/router/cert.pem",
            "ROUTER__SERVER__TLS__KEY_FILE": "/etc/router/key.pem",
        })
        self.assertTrue(command.tls)
        refused(self, ["--tls-cert-path", "c.pem"], "--tls-cert-path", "--tls-key-path")
        refused(self, ["--tls-key-path", "k.pem"], "--tls-key-path", "--tls-cert-path")
        refused(self, ["--tls-cert-path", " ", "--tls-key-path", "k.pem"], "--tls-cert-path", "file path")

    def test_ca_cert_paths_is_the_trust_in_https_workers(self):
        command = parse(["--worker-urls", "https://a:8443", "--ca-cert-paths", "/etc/router/workers-ca.pem"])
        self.assertEqual(command.env, {"ROUTER__WORKER_TLS__CA_FILE": "/etc/router/workers-ca.pem"})
        self.assertFalse(command.tls)
        self.assertEqual(parse(["--ca-cert-paths"]).env, {}, "no path: the system's roots")
        message = refused(self, ["--ca-cert-paths", "a.pem", "b.pem"], "--ca-cert-paths", "one PEM file")
        self.assertIn("concatenate", message)

    def test_traces_go_to_the_otlp_endpoint(self):
        command = parse(["--enable-trace"])
        self.assertEqual(command.env, {
            "ROUTER__TRACING__ENABLED": "true",
            "ROUTER__TRACING__OTLP_ENDPOINT": "http://localhost:4317",
        })
        command = parse(["--enable-trace", "--otlp-traces-endpoint", "collector:4317"])
        self.assertEqual(command.env["ROUTER__TRACING__OTLP_ENDPOINT"], "http://collector:4317")
        command = parse(["--enable-trace", "--otlp-traces-endpoint", "http://collector:4317"])
        self.assertEqual(command.env["ROUTER__TRACING__OTLP_ENDPOINT"], "http://collector:4317")
        refused(self, ["--otlp-traces-endpoint", "c:4317"], "--otlp-traces-endpoint", "--enable-trace")
        refused(self, ["--enable-trace", "--otlp-traces-endpoint", "https://c:4317"],
                "--otlp-traces-endpoint", "host:port")

    def test_policy(self):
        for policy in ("cache_aware", "round_robin", "random", "power_of_two",
                       "least_load", "least_requests", "consistent_hash"):
            args = parse(["--policy", policy]).args
            self.assertEqual(args[args.index("--policy") + 1], policy)
        refused(self, ["--policy", "manual"], "--policy", "no manual policy")
        refused(self, ["--policy", "bucket"], "--policy", "no bucket policy")
        refused(self, ["--policy", "fastest"], "--policy", "not a policy")

    def test_host_and_port(self):
        args = parse(["--host", "0.0.0.0", "--port", "8080"]).args
        self.assertEqual(args[:4], ["--host", "0.0.0.0", "--port", "8080"])
        refused(self, ["--port", "70000"], "--port", "not a port")
        refused(self, ["--port", "x"], "--port", "invalid int")
        refused(self, ["--host", " "], "--host")

    def test_prometheus_host_and_port(self):
        command = parse(["--prometheus-port", "29001"])
        self.assertEqual(command.env["ROUTER__SERVER__METRICS_PORT"], "29001")
        self.assertEqual(command.env["ROUTER__SERVER__METRICS_HOST"], "127.0.0.1")
        command = parse(["--prometheus-host", "0.0.0.0"])
        self.assertEqual(command.env["ROUTER__SERVER__METRICS_PORT"], "29000", "sglang-router's default port")
        self.assertEqual(command.env["ROUTER__SERVER__METRICS_HOST"], "0.0.0.0")
        self.assertEqual((command.metrics_host, command.metrics_port), ("0.0.0.0", 29000))
        refused(self, ["--port", "9000", "--prometheus-port", "9000"], "--prometheus-port", "port of its own")
        refused(self, ["--prometheus-port", "-1"], "--prometheus-port", "not a port")

    def test_request_timeout_secs_is_the_whole_requests_deadline(self):
        env = parse(["--request-timeout-secs", "1800"]).env
        self.assertEqual(env, {"ROUTER__SERVER__REQUEST_DEADLINE_MS": "1800000"})
        env = parse(["--request-timeout-secs", "10"]).env
        self.assertEqual(
            env,
            {"ROUTER__SERVER__REQUEST_DEADLINE_MS": "10000", "ROUTER__SERVER__FIRST_BYTE_TIMEOUT_MS": "10000"},
            "the first-byte deadline may not exceed the whole request's",
        )
        refused(self, ["--request-timeout-secs", "0"], "--request-timeout-secs", "> 0")
        refused(self, ["--request-timeout-secs", "nan"], "--request-timeout-secs")

    def test_max_payload_size(self):
        env = parse(["--max-payload-size", str(512 * 1024 * 1024)]).env
        self.assertEqual(env, {"ROUTER__SERVER__BODY_LIMIT_BYTES": "536870912"})
        refused(self, ["--max-payload-size", "0"], "--max-payload-size")

    def test_health_checks(self):
        env = parse(["--health-check-interval-secs", "60", "--health-check-timeout-secs", "5",
                     "--health-failure-threshold", "3", "--health-success-threshold", "2",
                     "--health-check-endpoint", "/health"]).env
        self.assertEqual(env, {
            "ROUTER__HEALTH__INTERVAL_MS": "60000",
            "ROUTER__HEALTH__TIMEOUT_MS": "5000",
            "ROUTER__HEALTH__FAILURE_THRESHOLD": "3",
            "ROUTER__HEALTH__SUCCESS_THRESHOLD": "2",
        })
        refused(self, ["--health-check-interval-secs", "0"], "--health-check-interval-secs")
        refused(self, ["--health-failure-threshold", "0"], "--health-failure-threshold")
        refused(self, ["--health-check-endpoint", "/ping"], "--health-check-endpoint", "GET /health")

    def test_api_key_goes_to_every_worker(self):
        command = parse(["--worker-urls", "http://a:1", "vllm=http://b:2",
                         "tokenspeed=http://c:3,loads=grpc://c:4", "--api-key", 'sk-"quoted"\\'])
        self.assertNotIn("--worker", command.args, "the workers are in the config file")
        self.assertNotIn("sk-", " ".join(command.args), "the key is never on a command line")
        config = tomllib.loads(command.config_toml)
        self.assertEqual(config["workers"], [
            {"url": "http://a:1", "backend": "sglang", "api_key": 'sk-"quoted"\\'},
            {"url": "http://b:2", "backend": "vllm", "api_key": 'sk-"quoted"\\'},
            {"url": "http://c:3", "backend": "tokenspeed", "load_url": "grpc://c:4",
             "api_key": 'sk-"quoted"\\'},
        ])
        refused(self, ["--api-key", "k"], "--api-key", "no --worker-urls")
        refused(self, WORKERS + ["--api-key", "k\ninjected"], "--api-key", "control characters")
        refused(self, WORKERS + ["--api-key", ""], "--api-key")

    def test_log_level(self):
        for level, rust_log in (("debug", "debug,async_nats=warn"), ("info", "info,async_nats=warn"),
                                ("warn", "warn"), ("warning", "warn"), ("error", "error"),
                                ("critical", "error")):
            self.assertEqual(parse(["--log-level", level]).env, {"RUST_LOG": rust_log})
        refused(self, ["--log-level", "trace"], "--log-level", "invalid choice")

    def test_retries(self):
        self.assertEqual(parse(["--retry-max-retries", "5"]).env, {"ROUTER__SERVER__MAX_RETRIES": "4"})
        self.assertEqual(parse(["--retry-max-retries", "1"]).env, {"ROUTER__SERVER__MAX_RETRIES": "0"})
        self.assertEqual(parse(["--disable-retries"]).env, {"ROUTER__SERVER__MAX_RETRIES": "0"})
        refused(self, ["--retry-max-retries", "0"], "--retry-max-retries", "at least 1")
        refused(self, ["--disable-retries", "--retry-max-retries", "3"], "--retry-max-retries")

    def test_shutdown_grace_period(self):
        env = parse(["--shutdown-grace-period-secs", "180"]).env
        self.assertEqual(env, {"ROUTER__SERVER__SHUTDOWN_GRACE_MS": "180000"})
        refused(self, ["--shutdown-grace-period-secs", "-1"], "--shutdown-grace-period-secs")

    def test_cache_aware_knobs(self):
        env = parse(["--policy", "cache_aware", "--cache-threshold", "0.3", "--balance-abs-threshold", "64",
                     "--balance-rel-threshold", "1.5", "--eviction-interval-secs", "120",
                     "--max-tree-size", "67108864"]).env
        self.assertEqual(env, {
            "ROUTER__POLICY__CACHE_AWARE__CACHE_THRESHOLD": "0.3",
            "ROUTER__POLICY__CACHE_AWARE__BALANCE_ABS_THRESHOLD": "64",
            "ROUTER__POLICY__CACHE_AWARE__BALANCE_REL_THRESHOLD": "1.5",
            "ROUTER__POLICY__CACHE_AWARE__EVICTION_INTERVAL_SECS": "120",
            "ROUTER__POLICY__CACHE_AWARE__MAX_TREE_TOKENS": "67108864",
        })
        self.assertEqual(parse(["--eviction-interval", "60"]).env,
                         {"ROUTER__POLICY__CACHE_AWARE__EVICTION_INTERVAL_SECS": "60"},
                         "the older sglang-router name")
        self.assertIn("ROUTER__POLICY__CACHE_AWARE__CACHE_THRESHOLD", parse(["--cache-threshold", "0.5"]).env,
                      "cache_aware is the default policy")
        refused(self, ["--policy", "least_load", "--cache-threshold", "0.3"], "--cache-threshold",
                "only to --policy cache_aware")
        refused(self, ["--cache-threshold", "1.5"], "--cache-threshold", "from 0 to 1")
        refused(self, ["--balance-rel-threshold", "0.5"], "--balance-rel-threshold", ">= 1")
        refused(self, ["--max-tree-size", "0"], "--max-tree-size", ">= 1")


class Refusals(unittest.TestCase):
    def test_every_sglang_router_flag_without_meaning_is_refused_by_name(self):
        for flag, reason in REFUSED.items():
            with self.subTest(flag=flag):
                # Flags with and without a value; before and after the workers.
                message = refused(self, [flag, "x"] + WORKERS, flag, "not supported")
                self.assertIn(reason, message)
                refused(self, WORKERS + [flag], flag)
                refused(self, WORKERS + [f"{flag}=x"], flag)

    def test_the_issues_examples(self):
        for flag in ("--dp-aware", "--pd-disaggregation", "--balance-abs-threshold"):
            with self.subTest(flag=flag):
                if flag == "--balance-abs-threshold":
                    # A cache_aware knob here: refused only beside another policy.
                    refused(self, ["--policy", "round_robin", flag, "64"], flag)
                else:
                    refused(self, WORKERS + [flag], flag)

    def test_unknown_flags_are_refused_by_name(self):
        refused(self, ["--worker-url", "http://a:1"], "--worker-url", "unknown flag")
        refused(self, ["--no-such-flag"], "--no-such-flag", "unknown flag")
        refused(self, ["--router-policy", "random"], "--router-policy", "--policy")
        refused(self, ["--work", "http://a:1"], "--work", "unknown flag")  # no abbreviations
        refused(self, ["http://a:1"], "launch_router", "unrecognized arguments")
        refused(self, ["-x"], "launch_router", "unrecognized arguments")


FAKE_ROUTER = textwrap.dedent(
    """\
    #!{python}
    # A stand-in for the router binary: reports what it was given.
    import json, os, sys
    args = sys.argv[1:]
    config = None
    if "--config" in args:
        with open(args[args.index("--config") + 1]) as file:
            config = file.read()
    env = {{k: v for k, v in os.environ.items() if k.startswith("ROUTER__") or k == "RUST_LOG"}}
    with open(os.environ["FAKE_ROUTER_REPORT"], "w") as report:
        json.dump({{"pid": os.getpid(), "args": args, "config": config, "env": env}}, report)
    sys.exit(7)
    """
)


class Exec(unittest.TestCase):
    """`python -m llm_router.launch_router` becomes the binary (exec)."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.binary = Path(self.dir.name) / "router"
        self.binary.write_text(FAKE_ROUTER.format(python=sys.executable))
        self.binary.chmod(self.binary.stat().st_mode | stat.S_IXUSR)
        self.report = Path(self.dir.name) / "report.json"

    def tearDown(self):
        self.dir.cleanup()

    def launch(self, *argv):
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTER__") and k != "RUST_LOG"}
        env.update(LLM_ROUTER_BINARY=str(self.binary), FAKE_ROUTER_REPORT=str(self.report))
        process = subprocess.Popen([sys.executable, "-m", "llm_router.launch_router", *argv],
                                   env=env, stderr=subprocess.PIPE, text=True)
        _, stderr = process.communicate(timeout=120)
        return process, stderr

    def test_the_launcher_execs_the_binary_with_the_mapped_command(self):
        process, stderr = self.launch(*WORKERS, "--port", "31000", "--api-key", "sk-1",
                                      "--request-timeout-secs", "60")
        self.assertEqual(process.returncode, 7, "the binary's own exit code: " + stderr)
        report = json.loads(self.report.read_text())
        self.assertEqual(report["pid"], process.pid, "exec: the launcher's process became the router")
        args = report["args"]
        self.assertEqual(args[:6], ["--host", "127.0.0.1", "--port", "31000", "--policy", "cache_aware"])
        self.assertEqual(args[6], "--config")
        config = tomllib.loads(report["config"])
        self.assertEqual([w["api_key"] for w in config["workers"]], ["sk-1", "sk-1"])
        self.assertEqual(report["env"], {"ROUTER__SERVER__REQUEST_DEADLINE_MS": "60000"})

    def test_a_refused_flag_exits_2_naming_it_and_runs_nothing(self):
        process, stderr = self.launch(*WORKERS, "--dp-aware")
        self.assertEqual(process.returncode, 2)
        self.assertIn("--dp-aware", stderr)
        self.assertFalse(self.report.exists(), "the binary never ran")

    def test_without_an_in_memory_file_the_launcher_supervises_and_cleans_up(self):
        # Where there is no memfd (not Linux), the config is a private
        # temporary file: the launcher runs the router as a child, passes
        # its exit code on, and removes the file.
        from llm_router._process import ConfigFile, _supervise

        config = ConfigFile("[server]\nport = 1\n", in_memory=False)
        path = Path(config.path)
        self.assertEqual(stat.S_IMODE(path.stat().st_mode), 0o600)
        env = dict(os.environ, FAKE_ROUTER_REPORT=str(self.report))
        code = _supervise([str(self.binary), "--config", config.path], env, config)
        self.assertEqual(code, 7)
        self.assertEqual(json.loads(self.report.read_text())["config"], "[server]\nport = 1\n")
        self.assertFalse(path.exists(), "removed once the router exited")
        self.assertFalse(path.parent.exists())

    def test_a_missing_binary_is_a_clear_error(self):
        self.binary.unlink()
        process, stderr = self.launch(*WORKERS)
        self.assertEqual(process.returncode, 1)
        self.assertIn("LLM_ROUTER_BINARY", stderr)
        self.assertIn("not an executable file", stderr)


if __name__ == "__main__":
    unittest.main()
