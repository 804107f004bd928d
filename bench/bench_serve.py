"""`sdnpu serve` under load: requests from several clients at once against one converted folder.

    python bench/bench_serve.py --models models/tiny-sdxl [--requests 20] [--clients 4] [--steps 2]

Two runs of `sdnpu serve` in a process of its own on 127.0.0.1: one with a queue that holds every client
(`--queue CLIENTS`: nothing may be refused, nothing lost), one with `--queue 1` (beyond the running request
and one waiting, requests are answered 429). Each client sends its share of the requests one after another,
each a `POST /v1/images/generations` of one image; the server's resident memory is read after every image it sends.
Printed: the answers by status, the latency (median, worst), and the server's memory after the first image
and at its highest after it (flat means the sessions are opened once and kept).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(folder: Path, queue: int, requests: int, clients: int, steps: int) -> dict:
    import httpx
    import psutil

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "sdnpu", "serve", str(folder), "--port", str(port),
                               "--queue", str(queue)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        proc = psutil.Process(server.pid)
        answers: list[tuple[int, float]] = []
        memory: list[int] = []
        lock = threading.Lock()

        def client(k: int) -> None:
            for j in range(k, requests, clients):
                t = time.perf_counter()
                r = httpx.post(f"{url}/v1/images/generations", timeout=600,
                               json={"prompt": "a cat", "steps": steps, "seed": j})
                with lock:
                    answers.append((r.status_code, time.perf_counter() - t))
                    if r.status_code == 200:  # a 429 comes before any session opens
                        memory.append(proc.memory_info().rss)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        still = httpx.get(f"{url}/health", timeout=10).status_code
    finally:
        server.terminate()
        server.wait(30)
    ok = [s for s, _ in answers if s == 200]
    return {"queue": queue, "answers": answers, "memory": memory, "ok": len(ok), "health after": still}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="models/tiny-sdxl")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    folder = Path(args.models)
    print(f"{folder}: {args.requests} requests from {args.clients} clients, {args.steps} steps each")
    print("| --queue | answered | 200 | 429 | other | latency median s | worst s | RSS after the first MB | "
          "highest after MB | /health after |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    series = []
    for queue in (args.clients, 1):
        r = _run(folder, queue, args.requests, args.clients, args.steps)
        statuses = [s for s, _ in r["answers"]]
        lat = [t for s, t in r["answers"] if s == 200]
        first, rest = r["memory"][0], r["memory"][1:] or r["memory"]
        print(f"| {queue} | {len(statuses)} | {statuses.count(200)} | {statuses.count(429)} | "
              f"{len(statuses) - statuses.count(200) - statuses.count(429)} | {statistics.median(lat):.2f} | "
              f"{max(lat):.2f} | {first / 1e6:.0f} | {max(rest) / 1e6:.0f} | {r['health after']} |")
        series.append(f"--queue {queue}: " + " ".join(f"{m / 1e6:.0f}" for m in r["memory"]))
    print("\nthe server's RSS in MB after each image, in order:")
    print("\n".join(series))


if __name__ == "__main__":
    main()
