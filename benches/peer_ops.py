"""The Python-MLX side of benches/binding.rs: the same 1000-op chain, timed the same way.

Prints one JSON object: {"version", "build_us", "eval_us"} (medians over the runs).
"""
import json
import statistics
import sys
import time

import mlx.core as mx


def main() -> None:
    ops = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    build, ev = [], []
    for _ in range(runs + 2):
        t0 = time.perf_counter()
        x = mx.zeros((16,), dtype=mx.float32)
        for _ in range(ops):
            x = x + 1.0
        t1 = time.perf_counter()
        mx.eval(x)
        t2 = time.perf_counter()
        assert x[0].item() == float(ops)
        build.append((t1 - t0) * 1e6)
        ev.append((t2 - t1) * 1e6)
    build, ev = build[2:], ev[2:]
    print(json.dumps({"version": mx.__version__, "build_us": statistics.median(build), "eval_us": statistics.median(ev)}))


if __name__ == "__main__":
    main()
