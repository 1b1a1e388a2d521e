"""Times the CPU kernels on the cases the non-finite rule could slow down (plain, causal,
bfloat16, a key-padding mask; forward and forward+backward) and prints one JSON line of
median seconds. Run it with two builds' interpreters in alternation to compare them, e.g.

    for r in 1 2 3 4 5; do
      echo "new $(.venv/bin/python tools/nonfinite_overhead.py)"
      echo "old $(/path/to/old/.venv/bin/python tools/nonfinite_overhead.py)"
    done > runs.txt
    python tools/nonfinite_overhead.py --summarize runs.txt

(docs/cpu_kernels.md, "Non-finite inputs", quotes such a comparison)."""

import json
import statistics
import sys
import time


def measure():
    import numpy as np
    import torch

    import fmha
    torch.manual_seed(0)
    res = {}
    cases = [("f32", torch.float32, 2048, {}), ("f32c", torch.float32, 2048, {"causal": True}),
             ("bf16", torch.bfloat16, 2048, {}), ("f32mask", torch.float32, 1024, "mask")]
    for name, dt, s, kw in cases:
        q, k, v = [torch.randn(1, s, 8, 64, dtype=dt) for _ in range(3)]
        if kw == "mask":
            kw = {"mask": torch.rand(1, 1, 1, s) < 0.9}
        qg, kg, vg = [x.clone().requires_grad_() for x in (q, k, v)]

        def fwd():
            with torch.no_grad():
                fmha.attention(q, k, v, **kw)

        def fwd_bwd():
            fmha.attention(qg, kg, vg, **kw).sum().backward()

        for tag, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            f()
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t)
            res[f"{name} {tag}"] = float(np.median(ts))
    print(json.dumps(res))


def summarize(path):
    rows = {}
    for line in open(path):
        tag, js = line.split(" ", 1)
        rows.setdefault(tag, []).append(json.loads(js))
    old, new = rows["old"], rows["new"]
    print("| case | old ms | new ms | new/old |\n|---|---|---|---|")
    for key in new[0]:
        o = statistics.median(r[key] for r in old) * 1e3
        n = statistics.median(r[key] for r in new) * 1e3
        print(f"| {key} | {o:.2f} | {n:.2f} | {n / o:.3f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        summarize(sys.argv[2])
    else:
        measure()
