"""The OpenAI Python client through a running router, then through one the
`Router` API starts: run by `cargo xtask python` against engine-sim engines
(not a unittest module: it needs the router and the engines it is given).

    python openai_e2e.py --router http://127.0.0.1:P --metrics http://127.0.0.1:Q/metrics \\
        --workers http://127.0.0.1:A http://127.0.0.1:B

Exits non-zero, saying which check failed, on the first failure.
"""

import argparse
import sys
import time
import urllib.request

import openai

import llm_router


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"openai_e2e: FAILED: {what}")
    print(f"openai_e2e: ok: {what}", flush=True)


def exercise(base_url: str, label: str) -> int:
    """Models, chat, streamed chat, completions, streamed completions;
    returns how many generation requests it sent."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-unused", timeout=60, max_retries=0)
    models = [model.id for model in client.models.list()]
    check(len(models) >= 1, f"{label}: GET /v1/models lists {models}")
    model = models[0]

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Say hello."}],
        max_tokens=8,
    )
    text = chat.choices[0].message.content or ""
    check(bool(text) and chat.usage.completion_tokens > 0,
          f"{label}: chat completion: {text!r}, {chat.usage.completion_tokens} tokens")

    chunks = []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=8,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(chunk.choices[0].delta.content)
    check(len(chunks) >= 2, f"{label}: streamed chat: {len(chunks)} content chunks, {''.join(chunks)!r}")

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8)
    check(bool(completion.choices[0].text), f"{label}: completion: {completion.choices[0].text!r}")

    pieces = [c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=8, stream=True) if c.choices]
    check(len(pieces) >= 2, f"{label}: streamed completion: {len(pieces)} chunks")
    return 4


def proxied_requests(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("router_requests_total{")
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--router", required=True, help="the launched router's base URL")
    parser.add_argument("--metrics", required=True, help="its /metrics URL")
    parser.add_argument("--workers", nargs="+", required=True, help="the engines behind it")
    args = parser.parse_args()

    started = time.monotonic()
    sent = exercise(args.router, "launch_router")
    counted = proxied_requests(args.metrics)
    check(counted >= sent, f"launch_router: /metrics on its own port counts {counted:.0f} proxied requests")

    # The Python API over the same engines, with this router's own policy.
    with llm_router.Router(worker_urls=args.workers, policy="least_load", port=0,
                           prometheus_port=0) as router:
        check(router.url != args.router, f"Router API: a second router at {router.url}")
        sent = exercise(router.url, "Router API")
        counted = proxied_requests(router.metrics_url)
        check(counted >= sent, f"Router API: {router.metrics_url} counts {counted:.0f} proxied requests")
    print(f"openai_e2e: all checks passed in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
