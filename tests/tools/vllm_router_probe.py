"""How the real vllm-router's `kv_aware` places a shared prefix under load.

Three times, on fresh pods each time: starts three `kvgate-sim` pods (KV events on) and
`vllm-router --policy kv_aware` fed their events, all on loopback ports the OS picks; warms
one pod with a prompt, then sends a burst of requests sharing its prefix, one every
`--spacing` seconds (300 output tokens each, so they stay in flight), and prints which pod
took each. The first fleet gets a burst answered whole, then — once the pods that computed
the prompt afresh hold it too — a burst streamed; the second fleet gets one streamed burst;
the third a long streamed burst (1,000 output tokens each), and prints which of its
requests first went to another pod. The first two fleets' ends print the router's own
decisions from its debug log (the chosen pod, the prompt tokens it computes and those its
cache credits).

    .kvgate/venv/bin/python tests/tools/vllm_router_probe.py [--prefix-repeat N] [--requests K]
        [--long-requests L] [--spacing S]

`--prefix-repeat` sets the prompt's length (its sentence N times: 60 ≈ 850 tokens),
`--requests` the size of the first two fleets' bursts (12), `--long-requests` the third's
(48), `--spacing` the seconds between a burst's requests (0.05).

Needs `cargo build --release -p kvgate-sim` and the project's venv (`make setup`).
"""

import argparse
import collections
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / ".kvgate/tokenizers/qwen3/tokenizer.json"
MODEL = "Qwen/Qwen3-8B"
SENTENCE = "You are a helpful assistant who answers questions about the history of shipping. "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pod(name: str) -> tuple[subprocess.Popen, dict]:
    pod = subprocess.Popen(
        [ROOT / "target/release/kvgate-sim", "--listen", "127.0.0.1:0", "--pod-id", name,
         "--tokenizer", TOKENIZER, "--model", MODEL, "--time-scale", "0.5", "--num-blocks", "1500",
         "--kv-events-endpoint", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    sockets = {}
    while len(sockets) < 2:
        line = pod.stdout.readline()
        if not line:
            sys.exit(f"{name} exited before saying its sockets")
        if m := re.match(r"listening (\S+) (\S+)", line):
            sockets[m.group(1)] = m.group(2)
    return pod, sockets


def probe(bursts: list[bool], prefix: str, requests: int, spacing: float, max_tokens: int = 300,
          show_decisions: bool = True) -> None:
    """One fleet: a warm-up, then a burst of `requests` per entry of `bursts` (streamed or not),
    each asking for `max_tokens`."""
    pods = [start_pod(f"pod-{i}") for i in range(3)]
    urls = [f"http://{s['http']}" for _, s in pods]
    port = free_port()
    args = [ROOT / ".kvgate/venv/bin/vllm-router", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", "kv_aware", "--kv-event-model", MODEL, "--kv-event-block-size", "16",
            "--log-level", "debug", "--worker-startup-timeout-secs", "30", "--worker-urls", *urls]
    for url, (_, s) in zip(urls, pods):
        args += ["--kv-event-source", f"{url}={s['kv-events']}"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    router = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(60):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            sys.exit("vllm-router did not answer /health within 30 s")
        time.sleep(2)  # its event subscriptions connect

        def send(question: str, max_tokens: int, out: list, stream: bool = False) -> None:
            body = {"model": MODEL, "prompt": prefix + question, "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": stream}
            req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as response:
                out.append((question, response.headers.get("x-kvgate-pod")))
                response.read()  # a stream stays in flight until its last token

        warm: list = []
        send(" warm", 4, warm)
        time.sleep(1.5)  # the pod's KV events reach the router
        print(f"warm-up request: {warm[0][1]}")
        for n, stream in enumerate(bursts):
            taken: list = []
            threads = [threading.Thread(target=send, args=(f" Q{n}.{k:03}: year {1800 + k}?", max_tokens, taken, stream))
                       for k in range(requests)]
            for t in threads:
                t.start()
                time.sleep(spacing)
            for t in threads:
                t.join()
            how = "streamed" if stream else "answered whole"
            order = [pod for _, pod in sorted(taken)]  # in sending order
            print(f"{requests} requests sharing its prefix, at once, {how}:", dict(collections.Counter(order)))
            if not show_decisions:
                left = next((i for i, pod in enumerate(order) if pod != warm[0][1]), None)
                print("  the first sent to another pod:", "none" if left is None else f"request {left + 1}")
            time.sleep(1.5)  # the pods' KV events reach the router
        if not show_decisions:
            return
        log.seek(0)
        pod_of = {url: f"pod-{i}" for i, url in enumerate(urls)}
        decisions = [re.sub(r"http://127\.0\.0\.1:\d+", lambda m: pod_of.get(m.group(0), m.group(0)),
                            re.sub(r"\x1b\[[0-9;]*m", "", line).split("outcome=", 1)[1].strip())
                     for line in log if "KV prefix decision" in line]
        print("the router's decisions:", *decisions, sep="\n  ")
    finally:
        router.terminate()
        for pod, _ in pods:
            pod.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-repeat", type=int, default=60, help="the prompt's sentence this many times")
    parser.add_argument("--requests", type=int, default=12, help="requests per burst")
    parser.add_argument("--long-requests", type=int, default=48, help="requests in the third fleet's burst")
    parser.add_argument("--spacing", type=float, default=0.05, help="seconds between a burst's requests")
    args = parser.parse_args()
    prefix = SENTENCE * args.prefix_repeat
    probe([False, True], prefix, args.requests, args.spacing)
    probe([True], prefix, args.requests, args.spacing)
    print("long answers:")
    probe([True], prefix, args.long_requests, args.spacing, max_tokens=1000, show_decisions=False)


if __name__ == "__main__":
    main()
