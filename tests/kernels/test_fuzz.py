"""Differential fuzzing: random configurations against fmha.reference, forward and backward.

Hypothesis draws a configuration -- dtype, entry point (NumPy / torch), shapes (odd sizes and
1, GQA/MQA, seqlen_q != seqlen_k, head_dim_v != head_dim), every feature and any combination
of them (causal, window, both alignments, scale, bias of any broadcast shape with -inf
entries and its gradient, boolean masks of any broadcast shape with fully masked rows,
softcap, ALiBi, dropout), strided layouts, and varlen batches with empty sequences -- plus
a seed for the values, and checks fmha against the float64 reference with the suite's
tolerance rule (conftest.check_against_reference / assert_close, docs/testing.md).

* ``test_fuzz_cpu*``: the CPU kernels at the current level (tests/run_all_isas.py reruns them
  at every lower level), every dtype.
* ``test_fuzz_cuda*``: the CUDA kernels, under the emulator (and on a GPU where there is one:
  conftest's ``backend``), float16/bfloat16, head_dim <= 256, small shapes.
* ``test_fuzz_*nonfinite*``: NaN, +inf and -inf planted in q, k, v, bias and dout: the
  non-finite pattern of every result equals the reference's and the finite entries are within
  tolerance (docs/semantics.md). float32/float64 on the CPU, float16/bfloat16 on the CUDA
  kernels.

Reproducible: the examples are derandomized (a fixed sequence per test) and hypothesis keeps
no database. CI runs a bounded count per test (the ``examples=`` below); FMHA_FUZZ_EXAMPLES=N
runs N examples of every fuzz test instead (a long run:
``FMHA_FUZZ_EXAMPLES=20000 python -m pytest -q tests/kernels/test_fuzz.py -k cpu``). A failure prints
the falsifying configuration (shrunk on the CPU tests, where shrinking is cheap).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

import fmha
from cases import layouts_numpy, layouts_torch
from conftest import (LOW_PRECISION, assert_close, check_against_reference, fmha_results,
                      from_f64, leaf_copy, naive_baseline, naive_results, reference_results,
                      to_f64)
from fmha import _philox, reference

torch = pytest.importorskip("torch")  # torch inputs, bfloat16, the naive 16-bit baseline



# ENVELOPE: the draws stay where the tolerance rule (conftest.assert_close) is known to hold.
# The backward takes D = rowsum(dO o O) from the stored out, rounded to the input dtype
# (FlashAttention-2's formulation, the same on every backend). The rounding of O is an error
# the naive baseline does not make (torch's softmax backward never reads O). Where the naive
# error is small -- rows that see a single key (0 in exact arithmetic), made worse by
# dropout's 1/(1-p) scaling of O, and tiny 16-bit problems with a few keys -- fmha's
# dq/dk/dbias error is that rounding. For 16-bit inputs the rule's floor now includes it
# (assert_close's d_rounded: the reference with D from round(out)); float32's floor does not:
#   * float32 dropout with a row that sees exactly one key is discarded;
#   * 16-bit dropout_p <= 0.6 (1/(1-p) <= 2.5) and an explicit scale of at most 2x the
#     default 1/sqrt(head_dim), the draws of the runs that measured the gap (widening them is
#     a change of the drawn examples, to be measured with a long run first).


def fuzz_settings(examples: int, shrink: bool = True):
    """``examples`` per run in CI, FMHA_FUZZ_EXAMPLES instead when set; derandomized."""
    env = os.environ.get("FMHA_FUZZ_EXAMPLES", "")
    n = int(env) if env else examples
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    print_blob=True, phases=phases, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))


# ============================================================================ configurations

@dataclasses.dataclass(frozen=True)
class Limits:
    """What one backend's fuzz draws from."""
    dtypes: Tuple[str, ...]
    batch: int
    seqlen: int
    heads_kv: int
    group: int                  # heads_q / heads_kv
    head_dims: Tuple[int, ...]
    max_cells: int = 10**9      # batch * heads_q * tiles_q * tiles_k bound (emulator time)
    # only what the Hopper forward claims (csrc/cuda/flash_fwd_sm90.cu): no softcap, dropout,
    # bias, mask or ALiBi, a positive scale, contiguous 16-byte aligned rows
    sm90: bool = False


CPU = Limits(dtypes=("float64", "float32", "bfloat16", "float16"), batch=3, seqlen=140,
             heads_kv=3, group=3,
             head_dims=(1, 2, 3, 5, 8, 13, 16, 24, 32, 40, 59, 64, 80, 96, 111, 128, 200, 256))
#: The emulator runs every CUDA thread of a block in turn (~0.05 s per 64x64 tile step).
CUDA = Limits(dtypes=("float16", "bfloat16"), batch=2, seqlen=72, heads_kv=2, group=2,
              head_dims=(1, 3, 8, 16, 24, 32, 40, 59, 64, 96, 111, 128, 200, 256), max_cells=4)
#: NaN/Inf: float32/float64 (the naive 16-bit baseline is not defined with NaN).
CPU_WIDE = dataclasses.replace(CPU, dtypes=("float64", "float32"))
CUDA_NONFINITE = CUDA
#: The Hopper forward (backend emu90): head dims that are multiples of 8 (16-byte rows), up to
#: 128 (its windowed and varlen calls at d = 256 run in the sm_80 kernel).
CUDA_SM90 = dataclasses.replace(CUDA, head_dims=(8, 16, 24, 40, 64, 96, 128), sm90=True)

WINDOW_SIDE = st.one_of(st.just(-1), st.integers(0, 6), st.integers(0, 150))
SPECIALS = (math.nan, math.inf, -math.inf)


@dataclasses.dataclass
class Case:
    """One random configuration; ``seed`` draws the values."""
    lib: str
    dtype: str
    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    dv: int
    kw: dict                         # causal, window, alignment, scale, softcap, dropout_p
    bias: Optional[tuple] = None     # shape
    bias_dtype: str = ""
    bias_grad: bool = False
    bias_neg_inf: bool = False       # some -inf entries and some all -inf rows
    mask: Optional[tuple] = None     # shape
    mask_density: float = 1.0
    mask_empty_rows: bool = False
    alibi: Optional[str] = None      # "h" | "b_h"
    layout: str = "contiguous"
    seed: int = 0
    lens_q: Optional[tuple] = None   # varlen: sequence lengths (b sequences)
    lens_k: Optional[tuple] = None
    plants: tuple = ()               # (tensor, flat position, value) NaN/Inf plants
    small_scores: bool = False       # |scores| < ~50 (NaN/Inf cases): small ALiBi slopes


def _seqlen(limits):
    return st.one_of(st.integers(1, 8), st.integers(1, limits.seqlen),
                     st.sampled_from([s for s in (63, 64, 65, 127, 128, 129)
                                      if s <= limits.seqlen]))


def _broadcast_shape(draw, full):
    """A NumPy-broadcastable shape for ``full``: 1 to 4 trailing dims, each full or 1."""
    ndim = draw(st.integers(1, 4))
    dims = full[4 - ndim:]
    return tuple(n if draw(st.booleans()) else 1 for n in dims)


def _tiles(n):
    return -(-n // 64)


@st.composite
def features(draw, case_args, limits):
    """The feature keywords and extras of a case (drawn independently, so any combination)."""
    b, sq, sk, hq, d = (case_args[n] for n in ("b", "sq", "sk", "hq", "d"))
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.integers(0, 2)) == 0:
        kw["window"] = (draw(WINDOW_SIDE), draw(WINDOW_SIDE))
    if draw(st.booleans()):
        kw["alignment"] = "top_left"
    if draw(st.integers(0, 3)) == 0:
        # in units of the default 1/sqrt(head_dim); see ENVELOPE
        kw["scale"] = (draw(st.floats(0.05, 2.0)) * draw(st.sampled_from([1.0, -1.0]))
                       / math.sqrt(d))
        if limits.sm90:
            kw["scale"] = abs(kw["scale"])
    if limits.sm90:
        return kw, {}
    if draw(st.integers(0, 3)) == 0:
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 5.0, 30.0]))
    if draw(st.integers(0, 3)) == 0:
        low = case_args["dtype"] in LOW_PRECISION
        kw["dropout_p"] = draw(st.sampled_from([0.1, 0.3, 0.6] + ([] if low else [0.9])))
    extra = {}
    full = (b, hq, sq, sk)
    if draw(st.integers(0, 2)) == 0:
        extra["bias"] = _broadcast_shape(draw, full)
        # any float dtype; not below q's precision for float64, whose dbias (returned in the
        # bias's dtype) is held to float64's tolerance
        dt = case_args["dtype"]
        extra["bias_dtype"] = draw(st.sampled_from(
            {"float64": ["float64"], "float32": ["float32", "float64"]}.get(dt, [dt, "float32"])))
        extra["bias_grad"] = draw(st.booleans())
        extra["bias_neg_inf"] = draw(st.integers(0, 3)) == 0
    if draw(st.integers(0, 2)) == 0:
        extra["mask"] = _broadcast_shape(draw, full)
        extra["mask_density"] = draw(st.sampled_from([0.0, 0.2, 0.6, 0.9, 1.0]))
        extra["mask_empty_rows"] = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:
        extra["alibi"] = draw(st.sampled_from(["h", "b_h"]))
    return kw, extra


@st.composite
def dense_cases(draw, limits: Limits):
    dtype = draw(st.sampled_from(limits.dtypes))
    lib = "torch" if dtype == "bfloat16" else draw(st.sampled_from(["numpy", "torch"]))
    hkv = draw(st.integers(1, limits.heads_kv))
    args = dict(lib=lib, dtype=dtype, b=draw(st.integers(1, limits.batch)),
                sq=draw(_seqlen(limits)), sk=draw(_seqlen(limits)), hkv=hkv,
                hq=hkv * draw(st.integers(1, limits.group)),
                d=draw(st.sampled_from(limits.head_dims)))
    args["dv"] = args["d"] if draw(st.booleans()) else draw(st.sampled_from(limits.head_dims))
    # over the emulator's budget: fewer batches, then heads, then tiles (not a rejection)
    for cut in (dict(b=1), dict(hq=args["hkv"]), dict(hq=1, hkv=1), dict(sk=min(args["sk"], 64)),
                dict(sq=min(args["sq"], 64))):
        if args["b"] * args["hq"] * _tiles(args["sq"]) * _tiles(args["sk"]) <= limits.max_cells:
            break
        args.update(cut)
    kw, extra = draw(features(args, limits))
    kinds = ["contiguous", "transposed", "sliced", "lastdim", "dim_transposed"]
    if lib == "numpy":
        kinds.append("reversed")
    layout = "contiguous" if limits.sm90 else draw(st.sampled_from(kinds))
    return Case(**args, kw=kw, **extra, layout=layout, seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def varlen_cases(draw, limits: Limits):
    dtype = draw(st.sampled_from(limits.dtypes))
    lib = "torch" if dtype == "bfloat16" else draw(st.sampled_from(["numpy", "torch"]))
    nseq = draw(st.integers(1, 4))
    length = st.one_of(st.just(0), st.integers(1, 6), st.integers(0, limits.seqlen // 2))
    lens_q = draw(st.lists(length, min_size=nseq, max_size=nseq))
    lens_k = draw(st.lists(length, min_size=nseq, max_size=nseq))
    # at least one query row and one key row in the batch: a packed tensor with no rows at
    # all is the empty-input case, not this file's subject
    if sum(lens_q) == 0:
        lens_q[draw(st.integers(0, nseq - 1))] = 1
    if sum(lens_k) == 0:
        lens_k[draw(st.integers(0, nseq - 1))] = 1
    hkv = draw(st.integers(1, limits.heads_kv))
    args = dict(lib=lib, dtype=dtype, b=nseq, sq=max(lens_q), sk=max(lens_k), hkv=hkv,
                hq=hkv * draw(st.integers(1, limits.group)),
                d=draw(st.sampled_from(limits.head_dims)))
    args["dv"] = args["d"] if draw(st.booleans()) else draw(st.sampled_from(limits.head_dims))
    cells = sum(_tiles(a) * _tiles(c) for a, c in zip(lens_q, lens_k)) * args["hq"]
    if cells > limits.max_cells:
        args.update(hkv=1, hq=1)
    kw, extra = draw(features(args, limits))
    return Case(**args, kw=kw, **extra, seed=draw(st.integers(0, 2**32 - 1)),
                lens_q=tuple(lens_q), lens_k=tuple(lens_k))


@st.composite
def nonfinite_cases(draw, limits: Limits):
    """A dense case with 1-4 NaN/+inf/-inf values planted in q, k, v, bias or dout."""
    case = dataclasses.replace(draw(dense_cases(limits)), small_scores=True)
    sizes = dict(q=case.b * case.sq * case.hq * case.d, k=case.b * case.sk * case.hkv * case.d,
                 v=case.b * case.sk * case.hkv * case.dv, dout=case.b * case.sq * case.hq * case.dv)
    if case.bias is not None:
        sizes["bias"] = int(np.prod(case.bias))
    plants = []
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(sorted(sizes)))
        plants.append((name, draw(st.integers(0, sizes[name] - 1)),
                       draw(st.sampled_from(SPECIALS))))
    return dataclasses.replace(case, plants=tuple(plants))


# ============================================================================ building inputs

def _convert(x64, case, kind):
    """float64 (b, s, h, d) -> the case's lib/dtype in layout ``kind``."""
    if kind == "contiguous":
        return from_f64(x64, case.dtype, case.lib)
    if case.lib == "torch":
        return layouts_torch(x64, kind, case.dtype)
    return layouts_numpy(x64, kind).astype(case.dtype, copy=False)


def _plant(x64, name, case):
    for tensor, pos, value in case.plants:
        if tensor == name:
            x64.reshape(-1)[pos] = value
    return x64


def build_dense(case: Case):
    """(q, k, v, dout, keyword arguments of the call, keywords of the reference only)."""
    rng = np.random.default_rng(case.seed)
    shapes = dict(q=(case.b, case.sq, case.hq, case.d), k=(case.b, case.sk, case.hkv, case.d),
                  v=(case.b, case.sk, case.hkv, case.dv), dout=(case.b, case.sq, case.hq, case.dv))
    arrays = [_convert(_plant(rng.standard_normal(shapes[n]), n, case), case, case.layout)
              for n in ("q", "k", "v", "dout")]
    kw, ref_kw = build_extras(case, rng, (case.b, case.hq, case.sq, case.sk))
    return (*arrays, kw, ref_kw)


def build_extras(case: Case, rng, full):
    """The bias / mask / alibi / dropout arguments of a case, in its lib."""
    kw = dict(case.kw)
    ref_kw = {}
    if case.bias is not None:
        bias = rng.standard_normal(case.bias) * 1.5
        if case.bias_neg_inf:
            bias[rng.random(case.bias) < 0.2] = -math.inf
            if case.bias[-1] > 1 and bias.ndim >= 2:
                bias[(0,) * (bias.ndim - 1)] = -math.inf      # one row: every key -inf
        bias = _plant(bias, "bias", case)
        kw["bias"] = from_f64(bias, case.bias_dtype, case.lib)
    if case.mask is not None:
        mask = rng.random(case.mask) < case.mask_density
        if case.mask_empty_rows and mask.ndim >= 2:
            mask[(slice(None),) * (mask.ndim - 2) + (rng.integers(0, mask.shape[-2]),)] = False
        kw["mask"] = torch.from_numpy(mask) if case.lib == "torch" else mask
    if case.alibi is not None:
        b, hq = full[0], full[1]
        slopes = rng.uniform(0.0, 0.5, (hq,) if case.alibi == "h" else (b, hq))
        if case.small_scores:
            slopes *= 0.1   # keep |ALiBi| small next to planted NaN/Inf (|s| < ~50)
        kw["alibi_slopes"] = from_f64(slopes, "float32", case.lib)
    if kw.get("dropout_p"):
        if case.lib == "torch":
            ref_kw["torch_seed"] = case.seed
        else:
            kw["seed"] = case.seed
            ref_kw.update(seed=case.seed, offset=0)
    return kw, ref_kw


def torch_dropout_seed_offset(torch_seed):
    """The (seed, offset) a torch call draws after torch.manual_seed(torch_seed)
    (python/fmha/_torch.py: two int64 from torch's default CPU generator). Pinned by
    test_torch_dropout_draw."""
    torch.manual_seed(torch_seed)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    torch.manual_seed(torch_seed)   # the call under test draws the same pair
    return seed, offset


def single_key_rows(q, k, v, bias=None, **kw):
    """Does some row see exactly one key (one nonzero probability)?"""
    rkw = {n: to_f64(x) if n in ("mask", "alibi_slopes") else x for n, x in kw.items()
           if n not in ("seed", "dropout_p")}
    with np.errstate(all="ignore"):
        p = reference.attention_probs(*(to_f64(x) for x in (q, k, v)), bias=to_f64(bias), **rkw)
    return bool(np.any((p > 0).sum(axis=-1) == 1))


def skip_exact_naive_with_dropout(case, *args, **kw):
    """Outside the tolerance rule (see ENVELOPE): float32 dropout where a row sees a single
    key."""
    if case.dtype == "float32" and case.kw.get("dropout_p"):
        assume(not single_key_rows(*args, **kw))


def run_dense(case: Case, nonfinite=False):
    q, k, v, do, kw, ref_kw = build_dense(case)
    bias = kw.pop("bias", None)
    skip_exact_naive_with_dropout(case, q, k, v, bias=bias, **kw)
    if "torch_seed" in ref_kw:
        seed, offset = torch_dropout_seed_offset(ref_kw.pop("torch_seed"))
        ref_kw.update(seed=seed, offset=offset)
    seed = kw.pop("seed", None)
    with np.errstate(all="ignore"):
        check_against_reference(q, k, v, do, bias=bias,
                                bias_grad=case.bias_grad and bias is not None, seed=seed,
                                ref_kw=ref_kw, nonfinite=nonfinite, **kw)


def run_dense_nonfinite_16bit(case: Case):
    """NaN/Inf with 16-bit inputs: the pattern against the reference, the finite entries
    within 2x/3x the error of the naive 16-bit computation on the same inputs without the
    planted values (which the naive formula cannot take: torch.softmax of a NaN row)."""
    q, k, v, do, kw, ref_kw = build_dense(case)
    cq, ck, cv, cdo, ckw, _ = build_dense(dataclasses.replace(case, plants=()))
    if "torch_seed" in ref_kw:
        seed, offset = torch_dropout_seed_offset(ref_kw.pop("torch_seed"))
        ref_kw.update(seed=seed, offset=offset)
    bias, cbias = kw.pop("bias", None), ckw.pop("bias", None)
    skip_exact_naive_with_dropout(case, cq, ck, cv, bias=cbias, **ckw)
    bias_grad = case.bias_grad and bias is not None
    seed = kw.pop("seed", None)
    ckw.pop("seed", None)
    res = fmha_results(q, k, v, do, bias=bias, bias_grad=bias_grad, seed=seed, **kw)
    with np.errstate(all="ignore"):
        ref = reference_results(q, k, v, do, bias=bias, bias_grad=bias_grad, **kw, **ref_kw)
        d_rounded = reference_results(q, k, v, do, bias=bias, bias_grad=bias_grad,
                                      d_from=case.dtype, **kw, **ref_kw)
        cref = reference_results(cq, ck, cv, cdo, bias=cbias, bias_grad=bias_grad, **ckw,
                                 **ref_kw)
    naive = naive_baseline(cq, ck, cv, cdo, bias=cbias, bias_grad=bias_grad, ref_kw=ref_kw,
                           **ckw)
    for key in ref:
        rdt = "float32" if key == "lse" else None
        assert_close(key, res[key], ref[key], case.dtype, naive=naive[key], naive_ref=cref[key],
                     grad=key.startswith("d"), result_dtype=rdt, nonfinite=True,
                     d_rounded=d_rounded[key] if key.startswith("d") else None)


# ============================================================================ varlen

def _packed(rng, lens, heads, dim, case):
    x64 = rng.standard_normal((sum(lens), heads, dim))
    return from_f64(x64, case.dtype, case.lib)


def _sum_to(x, shape):
    """Sum a (b, h, sq, sk) array over the axes a ``shape`` bias broadcasts."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape) if axes else x.reshape(shape)


def per_sequence(fn, q, k, v, do, cu_q, cu_k, kw, bias, bias_grad, full, dtype_lib):
    """Packed results of ``fn`` (conftest.reference_results or naive_results) run on each
    sequence as a dense batch: sequence b is batch index b of a (b + 1)-batch whose other
    entries are zeros (zero dout: they add nothing to dbias), so that dropout sees batch
    index b as the varlen kernels do; bias and mask are the sequence's (b, :, :lq, :lk)
    block. Empty sequences keep out 0, lse -inf, zero gradients."""
    nseq = len(cu_q) - 1
    hq, dv = q.shape[1], v.shape[2]
    res = dict(out=np.zeros((q.shape[0], hq, dv)), lse=np.full((hq, q.shape[0]), -math.inf),
               dq=np.zeros(q.shape), dk=np.zeros(k.shape), dv=np.zeros(v.shape))
    bias_full = None if bias is None else np.broadcast_to(to_f64(bias), full)
    dbias_full = np.zeros(full)
    mask = kw.get("mask")
    mask_full = None if mask is None else np.broadcast_to(to_f64(mask), full)
    slopes = kw.get("alibi_slopes")
    for b in range(nseq):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        lq, lk = rq.stop - rq.start, rk.stop - rk.start
        if lq == 0 or lk == 0:
            continue

        def pad(x, rows):
            x = to_f64(x)[rows]
            y = np.zeros((b + 1,) + x.shape)
            y[b] = x
            return dtype_lib(y)

        skw = {n: x for n, x in kw.items() if n not in ("mask", "alibi_slopes", "dropout_z")}
        if mask_full is not None:
            m = np.ones((b + 1, hq, lq, lk), bool)
            m[b] = mask_full[b, :, :lq, :lk]
            skw["mask"] = m if fn is reference_results else torch.from_numpy(m)
        if slopes is not None:
            s = to_f64(slopes)
            if s.ndim == 2:
                s2 = np.zeros((b + 1, hq))
                s2[b] = s[b]
                s = s2
            skw["alibi_slopes"] = s
        if "dropout_z" in kw:   # the naive baseline: dropout as an explicit multiplier
            z = np.zeros((b + 1, hq, lq, lk))
            z[b] = _philox.dropout_keep_mask(kw["dropout_z"][0], kw["dropout_z"][1], 1, hq,
                                             lq, lk, kw["dropout_p"], batch_index_start=b)[0]
            skw["dropout_z"] = torch.from_numpy(z / (1.0 - kw["dropout_p"]))
            skw.pop("dropout_p")
        sb = None
        if bias_full is not None:
            sbias = np.zeros((b + 1, hq, lq, lk))
            sbias[b] = bias_full[b, :, :lq, :lk]
            sb = dtype_lib(sbias)
        r = fn(pad(q, rq), pad(k, rk), pad(v, rk), pad(do, rq), bias=sb, bias_grad=bias_grad,
               **skw)
        r = {n: to_f64(x) for n, x in r.items()}
        res["out"][rq] = r["out"][b]
        res["lse"][:, rq] = r["lse"][b]
        res["dq"][rq] = r["dq"][b]
        res["dk"][rk] = r["dk"][b]
        res["dv"][rk] = r["dv"][b]
        if bias_grad:
            dbias_full[b, :, :lq, :lk] = r["dbias"][b]
    if bias_grad:
        res["dbias"] = _sum_to(dbias_full, np.shape(bias))
    return res


def varlen_single_key_rows(q, k, v, cu_q, cu_k, bias, kw, full):
    """single_key_rows of any sequence of a varlen call."""
    bias_full = None if bias is None else np.broadcast_to(to_f64(bias), full)
    mask = kw.get("mask")
    mask_full = None if mask is None else np.broadcast_to(to_f64(mask), full)
    slopes = None if kw.get("alibi_slopes") is None else to_f64(kw["alibi_slopes"])
    skw = {n: x for n, x in kw.items() if n not in ("mask", "alibi_slopes")}
    for b in range(len(cu_q) - 1):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        lq, lk = rq.stop - rq.start, rk.stop - rk.start
        if lq == 0 or lk == 0:
            continue
        extra = dict(skw)
        if bias_full is not None:
            extra["bias"] = bias_full[b:b + 1, :, :lq, :lk]
        if mask_full is not None:
            extra["mask"] = mask_full[b:b + 1, :, :lq, :lk]
        if slopes is not None:
            extra["alibi_slopes"] = slopes if slopes.ndim == 1 else slopes[b]
        if single_key_rows(to_f64(q)[None, rq], to_f64(k)[None, rk], to_f64(v)[None, rk],
                           **extra):
            return True
    return False


def run_varlen(case: Case):
    rng = np.random.default_rng(case.seed)
    lens_q, lens_k = case.lens_q, case.lens_k
    q = _packed(rng, lens_q, case.hq, case.d, case)
    k = _packed(rng, lens_k, case.hkv, case.d, case)
    v = _packed(rng, lens_k, case.hkv, case.dv, case)
    do = _packed(rng, lens_q, case.hq, case.dv, case)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    full = (case.b, case.hq, case.sq, case.sk)
    kw, ref_kw = build_extras(case, rng, full)
    bias = kw.pop("bias", None)
    bias_grad = case.bias_grad and bias is not None
    if case.lib == "torch":
        if "torch_seed" in ref_kw:
            seed, offset = torch_dropout_seed_offset(ref_kw.pop("torch_seed"))
            ref_kw.update(seed=seed, offset=offset)
        leaves = [leaf_copy(x) for x in (q, k, v)]
        tb = None if bias is None else leaf_copy(bias, bias_grad)
        out, lse = fmha.attention_varlen(*leaves, torch.from_numpy(cu_q), torch.from_numpy(cu_k),
                                         bias=tb, return_lse=True, **kw)
        out.backward(do)
        res = dict(out=out, lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
        if bias_grad:
            res["dbias"] = tb.grad
    else:
        out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, bias=bias, return_lse=True, **kw)
        grads = fmha.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, bias=bias,
                                               bias_grad=bias_grad, **kw)
        res = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
        if bias_grad:
            res["dbias"] = grads[3]
    assert res["out"].dtype == q.dtype
    assert tuple(res["out"].shape) == tuple(q.shape[:2]) + (case.dv,)
    assert tuple(res["lse"].shape) == (case.hq, q.shape[0])
    if bias_grad:
        assert tuple(res["dbias"].shape) == tuple(bias.shape)
    rkw = {n: x for n, x in kw.items() if n != "seed"}
    rkw.update(ref_kw)
    if case.dtype == "float32" and kw.get("dropout_p"):
        assume(not varlen_single_key_rows(q, k, v, cu_q, cu_k, bias, kw, full))
    ref = per_sequence(reference_results, q, k, v, do, cu_q, cu_k, rkw, bias, bias_grad, full,
                       lambda y: y)
    naive, d_rounded = {}, {}
    if case.dtype in LOW_PRECISION:
        d_rounded = per_sequence(reference_results, q, k, v, do, cu_q, cu_k,
                                 dict(rkw, d_from=case.dtype), bias, bias_grad, full, lambda y: y)
        nkw = {n: x for n, x in kw.items() if n != "seed"}
        if nkw.get("dropout_p"):
            nkw["dropout_z"] = (ref_kw["seed"], ref_kw["offset"])
        tdt = getattr(torch, case.dtype)
        naive = per_sequence(naive_results, q, k, v, do, cu_q, cu_k, nkw, bias, bias_grad, full,
                             lambda y: torch.from_numpy(y).to(tdt))
    for key in ref:
        rdt = ("float64" if case.dtype == "float64" else "float32") if key == "lse" else None
        assert_close(key, res[key], ref[key], case.dtype, naive=naive.get(key),
                     grad=key.startswith("d"), result_dtype=rdt,
                     d_rounded=d_rounded.get(key) if key.startswith("d") else None)


# ============================================================================ the tests

@fuzz_settings(examples=150)
@given(case=dense_cases(CPU))
def test_fuzz_cpu(case):
    run_dense(case)


@fuzz_settings(examples=60)
@given(case=varlen_cases(CPU))
def test_fuzz_cpu_varlen(case):
    run_varlen(case)


@fuzz_settings(examples=100)
@given(case=nonfinite_cases(CPU_WIDE))
def test_fuzz_cpu_nonfinite(case):
    run_dense(case, nonfinite=True)


@pytest.mark.backends("emu", "gpu")
@fuzz_settings(examples=8, shrink=False)
@given(case=dense_cases(CUDA))
def test_fuzz_cuda(backend, case):
    run_dense(case)


@pytest.mark.backends("emu", "gpu")
@fuzz_settings(examples=6, shrink=False)
@given(case=varlen_cases(CUDA))
def test_fuzz_cuda_varlen(backend, case):
    run_varlen(case)


@pytest.mark.backends("emu", "gpu")
@fuzz_settings(examples=8, shrink=False)
@given(case=nonfinite_cases(CUDA_NONFINITE))
def test_fuzz_cuda_nonfinite(backend, case):
    run_dense_nonfinite_16bit(case)


# The Hopper forward (emu90: FMHA_CUDA_KERNEL=sm90), on what it claims; conftest checks that
# each case's forward ran in it.
@pytest.mark.backends("emu90")
@fuzz_settings(examples=8, shrink=False)
@given(case=dense_cases(CUDA_SM90))
def test_fuzz_cuda_sm90(backend, case):
    run_dense(case)


@pytest.mark.backends("emu90")
@fuzz_settings(examples=6, shrink=False)
@given(case=varlen_cases(CUDA_SM90))
def test_fuzz_cuda_sm90_varlen(backend, case):
    run_varlen(case)


@pytest.mark.backends("emu90")
@fuzz_settings(examples=8, shrink=False)
@given(case=nonfinite_cases(CUDA_SM90))
def test_fuzz_cuda_sm90_nonfinite(backend, case):
    run_dense_nonfinite_16bit(case)


@st.composite
def fp8_cases(draw):
    """float8_e4m3fn calls the Hopper forward claims: head dims that are multiples of 16
    (16-byte rows), GQA, causal and windows, key splits, descales of either sign, and NaN
    codes planted in v now and then."""
    hkv = draw(st.integers(1, 2))
    d = draw(st.sampled_from((16, 32, 64, 96, 128, 192, 256)))
    return dict(
        b=draw(st.integers(1, 2)), sq=draw(st.integers(1, 140)),
        sk=draw(st.one_of(st.integers(1, 300), st.sampled_from((127, 128, 129, 256, 257)))),
        hkv=hkv, hq=hkv * draw(st.integers(1, 2)), d=d,
        dv=d if draw(st.booleans()) else draw(st.sampled_from((16, 64, 128, 256))),
        window=draw(st.sampled_from(((-1, -1), (-1, 0), (-1, 0), (40, 0), (70, 20)))),
        num_splits=draw(st.sampled_from((0, 1, 1, 3))),
        descale_sign=draw(st.sampled_from((1.0, 1.0, 1.0, -1.0))),
        nan_keys=draw(st.sampled_from((0, 0, 0, 1, 2))), seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.backends("emu90")
@fuzz_settings(examples=12, shrink=False)
@given(case=fp8_cases())
def test_fuzz_cuda_sm90_fp8(backend, case):
    """Against the exact attention of the dequantised inputs under the fp8 rule with the P
    term; without NaN codes and key splits, also against the kernel's own P model without it.
    NaN codes: the non-finite pattern is the exact attention's (the strong zero)."""
    c = case
    torch = pytest.importorskip("torch")
    f8 = torch.float8_e4m3fn
    rng = np.random.default_rng(c["seed"])
    shape = lambda s, h, d: (c["b"], s, h, d)  # noqa: E731
    q, k, v = (torch.from_numpy(rng.standard_normal(shape(*x)).astype(np.float32)).to(f8)
               for x in ((c["sq"], c["hq"], c["d"]), (c["sk"], c["hkv"], c["d"]),
                         (c["sk"], c["hkv"], c["dv"])))
    for _ in range(c["nan_keys"]):
        v.view(torch.uint8)[rng.integers(c["b"]), rng.integers(c["sk"]), rng.integers(c["hkv"]),
                            rng.integers(c["dv"])] = 0x7F
    dq, dk, dv = (torch.from_numpy(rng.uniform(0.3, 2.0, (c["b"], c["hkv"])).astype(np.float32))
                  for _ in range(3))
    dq = dq * c["descale_sign"]
    out, lse = fmha.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv,
                              window=c["window"], num_splits=c["num_splits"], return_lse=True)
    codes = [x.view(torch.uint8).numpy() for x in (q, k, v)]
    kw = dict(descale_q=dq.numpy(), descale_k=dk.numpy(), descale_v=dv.numpy(),
              window=c["window"])
    with np.errstate(all="ignore"):
        ref, ref_lse = reference.attention_fp8_forward(*codes, **kw)
    nonfinite = c["nan_keys"] > 0
    assert_close("out", out, ref, "float8_e4m3fn", result_dtype="bfloat16", p_quantised=True,
                 nonfinite=nonfinite)
    assert_close("lse", lse, ref_lse, "float32", nonfinite=nonfinite)
    if not nonfinite and c["num_splits"] == 1:
        model, _ = reference.attention_fp8_forward(*codes, quantize_p=True, block_k=128, **kw)
        assert_close("out (the P model)", out, model, "float8_e4m3fn", result_dtype="bfloat16")


def test_torch_dropout_draw():
    """torch_dropout_seed_offset is the pair a torch call uses: the mask read back through an
    identity V (q = k = 0: out[b, i, h, j] = keep / (1 - p) / sk) is Philox's for that pair."""
    b, h, sq, sk, p = 1, 2, 5, 12, 0.5
    q = torch.zeros(b, sq, h, 4, dtype=torch.float64)
    v = torch.eye(sk, dtype=torch.float64)[None, :, None, :].expand(b, sk, h, sk).contiguous()
    seed, offset = torch_dropout_seed_offset(1234)
    out = fmha.attention(q, torch.zeros(b, sk, h, 4, dtype=torch.float64), v, dropout_p=p)
    keep = _philox.dropout_keep_mask(seed, offset, b, h, sq, sk, p)
    np.testing.assert_array_equal(out.permute(0, 2, 1, 3).numpy() > 0, keep)
    assert 0 < keep.mean() < 1
