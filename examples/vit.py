"""Image classification with a ViT-B/16 on fmha: forward and a training step, fmha vs SDPA.

    python examples/vit.py --out benchmarks/examples/vit.json

A ViT-B/16-shaped classifier (transformers' ViTForImageClassification, default config: 12
layers, 12 heads of 64, 224x224 images in 16x16 patches = 197 tokens, 1000 classes; random
weights, nothing downloaded), batch 32, in float32 and bfloat16, run with
attn_implementation="fmha" and "sdpa" on the same weights and images, alternating the two:

- inference: the median time of a forward pass, and images/s;
- training: the median time of forward + backward + an SGD step (cross-entropy on random
  labels), and images/s;
- the logits of both implementations side by side (largest difference), so the speed is
  that of the same computation.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

import fmha
import fmha.integrations.transformers  # noqa: F401  (registers attn_implementation="fmha")


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(batch: int, dtypes, reps: int, small: bool = False):
    from transformers import ViTConfig, ViTForImageClassification
    cfg = (ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, image_size=32, patch_size=8, num_labels=10)
           if small else ViTConfig(num_labels=1000))
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        model = ViTForImageClassification(cfg).to(dtype)
        g = torch.Generator().manual_seed(1)
        pixels = torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=g).to(dtype)
        labels = torch.randint(0, cfg.num_labels, (batch,), generator=g)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        logits = {}
        for impl in ("fmha", "sdpa"):
            model.set_attn_implementation(impl)
            model.eval()
            with torch.no_grad():
                logits[impl] = model(pixel_values=pixels).logits.float()
        diff = (logits["fmha"] - logits["sdpa"]).abs().max().item()
        scale = logits["sdpa"].abs().max().item()
        times = {("inference", i): [] for i in ("fmha", "sdpa")}
        times.update({("training", i): [] for i in ("fmha", "sdpa")})
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def infer():
            with torch.no_grad():
                model(pixel_values=pixels)

        def train():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(
                model(pixel_values=pixels).logits.float(), labels)
            loss.backward()
            opt.step()

        for rep in range(reps + 1):  # alternate, so drift affects both alike
            for impl in ("fmha", "sdpa"):
                model.set_attn_implementation(impl)
                model.eval()
                t_infer = _seconds(infer)
                model.train()
                t_train = _seconds(train)
                model.load_state_dict(state)  # each training step starts from the same weights
                if rep:  # the first round warms up
                    times[("inference", impl)].append(t_infer)
                    times[("training", impl)].append(t_train)
        for (mode, impl), ts in times.items():
            s = statistics.median(ts)
            rows.append(dict(dtype=dtype_name, mode=mode, impl=impl, seconds=s,
                             images_per_second=batch / s))
        rows.append(dict(dtype=dtype_name, mode="logits", max_abs_diff=diff, max_abs=scale))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each")
    ap.add_argument("--small", action="store_true", help="a 2-layer stand-in (for tests)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = run(a.batch, a.dtypes.split(","), a.reps, a.small)
    print(f"{'dtype':9} {'mode':9} {'impl':5} {'s/batch':>9} {'images/s':>9}")
    ratios = {}
    for r in rows:
        if r["mode"] == "logits":
            print(f"{r['dtype']:9} logits: max |fmha - sdpa| = {r['max_abs_diff']:.2e} "
                  f"(max |logit| {r['max_abs']:.2f})")
            continue
        print(f"{r['dtype']:9} {r['mode']:9} {r['impl']:5} {r['seconds']:9.3f} "
              f"{r['images_per_second']:9.1f}")
        ratios.setdefault((r["dtype"], r["mode"]), {})[r["impl"]] = r["seconds"]
    for (dt, mode), s in ratios.items():
        print(f"{dt} {mode}: sdpa / fmha time = {s['sdpa'] / s['fmha']:.2f}")
    if a.out:
        meta = dict(command=" ".join(["python"] + sys.argv), batch=a.batch, reps=a.reps,
                    model="ViTForImageClassification, default ViTConfig (ViT-B/16, 224x224, "
                          "197 tokens, 1000 classes), random weights" if not a.small else
                          "2-layer stand-in",
                    fmha=fmha.__version__, torch=torch.__version__, cpu_isa=fmha.cpu_isa(),
                    threads=torch.get_num_threads(),
                    machine=platform.processor() or platform.machine(),
                    date=time.strftime("%Y-%m-%d %H:%M:%S"))
        from fmha.bench import cpu_model
        meta["cpu_model"] = cpu_model()
        with open(a.out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
