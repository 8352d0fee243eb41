"""Which event loop should a synchronous reward stage use for HttpRewardSource? (docs/reward.md)

A: one loop in a daemon thread per source, one ClientSession kept across calls (what the source does);
B: ``asyncio.run`` per call, which must build a new ClientSession (and new TCP connections) every call.
Both score the same micro-batches against a real loopback server with no simulated latency, so the
difference is the per-call overhead. Prints times and their ratio measured in this run.

    python bench/reward_http_loop.py [--calls 200] [--items 32] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

from expstream.rewards.http_client import HttpRewardSource, score_with_session
from expstream.rewards.server import FnScorer, ServerThread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--items", type=int, default=32, help="samples per call (one micro-batch)")
    ap.add_argument("--batch-size", type=int, default=8, help="items per request")
    args = ap.parse_args()
    srv = ServerThread(FnScorer("expstream.rewards:response_length"))
    srv.start()
    items = [{"id": f"g{i}#0", "prompt": "p", "response": "r" * i} for i in range(args.items)]
    src = HttpRewardSource("bench", srv.url, batch_size=args.batch_size, max_in_flight=8)
    try:
        src.score_items(items)  # warm-up: the thread, the session, the connections
        t = time.perf_counter()
        for _ in range(args.calls):
            src.score_items(items)
        thread_s = (time.perf_counter() - t) / args.calls

        async def once() -> None:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8)) as session:
                await score_with_session(src, session, items)

        asyncio.run(once())
        t = time.perf_counter()
        for _ in range(args.calls):
            asyncio.run(once())
        run_s = (time.perf_counter() - t) / args.calls
    finally:
        src.close()
        srv.stop()
    print(f"{args.calls} calls of {args.items} items ({args.batch_size} per request), server on loopback:")
    print(f"  A loop thread + kept session : {thread_s * 1e3:7.2f} ms/call")
    print(f"  B asyncio.run per call       : {run_s * 1e3:7.2f} ms/call")
    print(f"  B / A                        : {run_s / thread_s:7.2f}x")


if __name__ == "__main__":
    main()
