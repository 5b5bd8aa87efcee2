"""The `Router` API against the real router binary (the installed wheel's,
or $LLM_ROUTER_BINARY), with no workers or with unreachable ones: startup,
readiness, stop, and each error it explains."""

import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import unittest
import urllib.error
import urllib.request

import llm_router
from llm_router import (
    BinaryNotFoundError,
    FlagError,
    PortInUseError,
    Router,
    RouterExitedError,
    RouterNotReadyError,
)

#: Nothing listens here: a worker that never passes a health check.
DEAD_WORKER = "http://127.0.0.1:1"


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


class Lifecycle(unittest.TestCase):
    def test_a_router_with_no_workers_starts_answers_and_stops(self):
        router = Router(port=0)
        with router:
            self.assertNotEqual(router.port, 0, "a free port was chosen")
            self.assertEqual(status(router.url + "/health"), 200)
            self.assertEqual(get_json(router.url + "/admin/policy")["kind"], "least_load")
            self.assertEqual(status(router.metrics_url), 200)
            pid = router.pid
        self.assertIsNone(router.pid)
        with self.assertRaises(OSError, msg="the process is gone"):
            os.kill(pid, 0)

    def test_stop_returns_the_exit_code_of_a_clean_shutdown(self):
        router = Router(port=0).start()
        self.assertEqual(router.stop(), 0)
        self.assertIsNone(router.stop(), "stopping twice is harmless")

    def test_options_are_the_launchers_flags(self):
        with Router([DEAD_WORKER], policy="cache_aware", cache_threshold=0.25, api_key="sk-1",
                    prometheus_port=0, request_timeout_secs=120, wait_for_workers=False) as router:
            policy = get_json(router.url + "/admin/policy")
            self.assertEqual(policy["kind"], "cache_aware")
            self.assertEqual(policy["params"]["cache_threshold"], 0.25)
            workers = get_json(router.url + "/admin/workers")["workers"]
            self.assertEqual([w["url"] for w in workers], [DEAD_WORKER], "from the in-memory config file")
            self.assertNotEqual(router.metrics_port, router.port)
            self.assertEqual(status(router.metrics_url), 200, "/metrics on its own listener")
            self.assertEqual(status(router.url + "/metrics"), 404)

    def test_a_refused_option_fails_at_once(self):
        with self.assertRaises(FlagError) as caught:
            Router(port=0, dp_aware=True)
        self.assertEqual(caught.exception.flag, "--dp-aware")


class Errors(unittest.TestCase):
    def test_binary_not_found(self):
        with self.assertRaises(BinaryNotFoundError) as caught:
            Router(port=0, binary="/nonexistent/router")
        self.assertIn("/nonexistent/router", str(caught.exception))

    def test_the_wheels_binary_is_found(self):
        path = llm_router.binary_path()
        self.assertTrue(path.is_file(), path)

    def test_port_in_use(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with self.assertRaises(PortInUseError) as caught:
                Router(port=port).start()
            self.assertIn(str(port), str(caught.exception))

    def test_metrics_port_in_use_is_the_routers_own_error(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with self.assertRaises(PortInUseError) as caught:
                Router(port=0, prometheus_port=port).start()
            self.assertIn(f"could not bind 127.0.0.1:{port}", str(caught.exception), "the router's stderr")

    def test_an_early_exit_shows_the_stderr_tail(self):
        router = Router(port=0, env={"ROUTER__SERVER__BODY_LIMIT_BYTES": "0"})
        with self.assertRaises(RouterExitedError) as caught:
            router.start()
        self.assertEqual(caught.exception.returncode, 2)
        self.assertIn("invalid server.body_limit_bytes = 0", caught.exception.stderr_tail)
        self.assertIn("invalid server.body_limit_bytes = 0", str(caught.exception))
        self.assertIsNone(router.pid, "nothing left running")

    def test_not_ready_in_time_names_the_workers_out_of_rotation(self):
        router = Router([DEAD_WORKER], port=0, startup_timeout=1.0)
        with self.assertRaises(RouterNotReadyError) as caught:
            router.start()
        self.assertIn(DEAD_WORKER, str(caught.exception))
        self.assertIsNone(router.pid, "stopped after the timeout")


def self_signed_certificate(directory: str):
    """A certificate for localhost and 127.0.0.1 and its key, made by openssl."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )
    return cert, key


@unittest.skipUnless(shutil.which("openssl"), "openssl makes the test certificate")
class Tls(unittest.TestCase):
    def test_tls_cert_path_serves_https_on_the_port(self):
        with tempfile.TemporaryDirectory() as directory:
            cert, key = self_signed_certificate(directory)
            with Router(port=0, tls_cert_path=cert, tls_key_path=key) as router:
                self.assertTrue(router.url.startswith("https://127.0.0.1:"), router.url)
                trusting = ssl.create_default_context(cafile=cert)
                with urllib.request.urlopen(router.url + "/health", timeout=10, context=trusting) as response:
                    self.assertEqual(response.status, 200)
                # Closed, after at most a TLS alert: never an HTTP answer.
                with self.assertRaises((OSError, http.client.HTTPException), msg="plain HTTP gets no answer"):
                    urllib.request.urlopen(router.url.replace("https://", "http://") + "/health", timeout=10)

    def test_a_missing_certificate_stops_the_router_naming_it(self):
        with tempfile.TemporaryDirectory() as directory:
            _, key = self_signed_certificate(directory)
            missing = os.path.join(directory, "no-such-cert.pem")
            router = Router(port=0, tls_cert_path=missing, tls_key_path=key)
            with self.assertRaises(RouterExitedError) as caught:
                router.start()
            self.assertIn(f"{missing} does not exist", caught.exception.stderr_tail)


if __name__ == "__main__":
    unittest.main()
