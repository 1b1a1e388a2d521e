"""The KV-cache cases shared by tests/kvcache/test_kvcache.py (the CPU kernels) and
tests/kvcache/test_kvcache_cuda.py (the CUDA kernels, emulated or on a GPU): caches with NaN in every
row a call must not read, the reference cases, tolerances and byte-level helpers."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TOL_F32, TOL_F64, from_f64, max_abs, to_f64

#: (lib, dtype) pairs of the reference checks; torch ones skip without torch.
LIB_DTYPES = [("numpy", "float64"), ("numpy", "float32"), ("torch", "float32"),
              ("torch", "bfloat16")]
#: Relative tolerances (against max(max|ref|, 1), like conftest.assert_close; the reference
#: is computed from the very bf16 values). bfloat16: out is stored in bfloat16 (an ulp is
#: 2**-8 relative) after float32 accumulation, so 2e-2 (measured worst 3.5e-3 over these
#: cases); lse is float32, accumulated in float32 (measured worst 1e-7): float32's rule.
TOL_OUT = {"float64": TOL_F64, "float32": TOL_F32, "bfloat16": 2e-2}
TOL_LSE = {"float64": TOL_F64, "float32": TOL_F32, "bfloat16": TOL_F32}
CONTIGUOUS = "contiguous"


# ============================================================================ helpers

def need_lib(lib):
    if lib == "torch":
        pytest.importorskip("torch")


def convert(x64, dtype, lib):
    """float64 NumPy -> dtype in lib (None passes through)."""
    return None if x64 is None else from_f64(np.ascontiguousarray(x64), dtype, lib)


def ints(x: np.ndarray, lib):
    """An integer NumPy array (its dtype kept) as a fresh array / tensor of lib."""
    x = np.ascontiguousarray(x).copy()
    if lib == "torch":
        import torch
        return torch.from_numpy(x)
    return x


def int32(x, lib):
    return ints(np.asarray(x, dtype=np.int32), lib)


def raw(x) -> bytes:
    """The bytes of an array / tensor (NaN-safe, dtype-exact comparisons)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    import torch
    return x.detach().contiguous().view(torch.uint8).numpy().tobytes()


def copy(x):
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def assert_near(name, actual, ref, tol):
    """max|actual - ref| <= tol * max(max|ref|, 1) on finite entries; -inf exactly where the
    reference has it, NaN nowhere."""
    actual = to_f64(actual)
    assert actual.shape == ref.shape, f"{name}: shape {actual.shape} != {ref.shape}"
    assert not np.isnan(actual).any(), f"{name}: NaN in result"
    assert np.array_equal(np.isneginf(actual), np.isneginf(ref)), f"{name}: -inf pattern"
    fin = np.isfinite(ref)
    assert np.all(np.isfinite(actual[fin])), f"{name}: non-finite where ref is finite"
    err = float(np.max(np.abs(actual[fin] - ref[fin]))) if fin.any() else 0.0
    bound = tol * max(max_abs(ref), 1.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


class Caches:
    """K/V caches holding ``lens[b]`` rows of sequence b, contiguous (``block_size`` None)
    or paged through a scattered block table; every other row is NaN and every table entry
    past a sequence's rows (+ ``reserve`` appended rows) is an out-of-range block id."""

    def __init__(self, rng, lens, capacity, heads_kv, d, dv, block_size=None, *,
                 reserve=0, spare_blocks=3):
        batch = len(lens)
        self.lens = np.asarray(lens, dtype=np.int32)
        self.block_size = block_size
        if block_size is None:
            self.capacity = capacity
        else:
            self.max_blocks = -(-capacity // block_size)
            self.capacity = self.max_blocks * block_size
        # The logical rows of each sequence (rows >= lens[b] are garbage: NaN).
        self.k_rows = rng.standard_normal((batch, self.capacity, heads_kv, d))
        self.v_rows = rng.standard_normal((batch, self.capacity, heads_kv, dv))
        for b, n in enumerate(self.lens):
            self.k_rows[b, n:] = np.nan
            self.v_rows[b, n:] = np.nan
        if block_size is None:
            self.table = None
            self.k64, self.v64 = self.k_rows.copy(), self.v_rows.copy()
            return
        num_blocks = batch * self.max_blocks + spare_blocks
        perm = rng.permutation(num_blocks)
        table = perm[:batch * self.max_blocks].reshape(batch, self.max_blocks).astype(np.int32)
        self.k64 = np.full((num_blocks, block_size, heads_kv, d), np.nan)
        self.v64 = np.full((num_blocks, block_size, heads_kv, dv), np.nan)
        for b in range(batch):
            for j in range(int(self.lens[b])):
                self.k64[table[b, j // block_size], j % block_size] = self.k_rows[b, j]
                self.v64[table[b, j // block_size], j % block_size] = self.v_rows[b, j]
            used = -(-(int(self.lens[b]) + reserve) // block_size)
            # Never read: past the sequence's rows.
            table[b, used:] = np.where(np.arange(self.max_blocks - used) % 2, -7,
                                       num_blocks + 5)
        self.table = table

    def arrays(self, dtype, lib):
        return (convert(self.k64, dtype, lib), convert(self.v64, dtype, lib),
                None if self.table is None else int32(self.table, lib))

    def expected_after_append(self, k_cache, v_cache, k, v):
        """Copies of the caches as the call must leave them: k, v written at rows
        lens[b] .., nothing else changed."""
        ek, ev = copy(k_cache), copy(v_cache)
        if k is None:
            return ek, ev
        for b in range(len(self.lens)):
            for t in range(k.shape[1]):
                j = int(self.lens[b]) + t
                if self.table is None:
                    ek[b, j], ev[b, j] = k[b, t], v[b, t]
                else:
                    blk, r = int(self.table[b, j // self.block_size]), j % self.block_size
                    ek[blk, r], ev[blk, r] = k[b, t], v[b, t]
        return ek, ev


# ============================================================================ 1. reference

# Each case: heads_q, heads_kv, seqlen_q, seqlen_new (0: no append), head_dim, head_dim_v,
# and the keywords of the call.
CASES = {
    "decode-mha": (2, 2, 1, 1, 16, 16, {}),
    "chunked-prefill-gqa-causal": (4, 2, 3, 3, 16, 16, dict(causal=True)),
    "mqa-causal-window-3-0": (4, 1, 2, 1, 16, 16, dict(causal=True, window=(3, 0))),
    "gqa-window-2-1-dv": (4, 2, 3, 3, 32, 16, dict(window=(2, 1))),
    "alibi-heads-softcap-scale": (4, 2, 2, 1, 16, 16, dict(alibi="heads", softcap=2.5,
                                                           scale=0.3)),
    "alibi-batch-causal-mqa": (4, 1, 3, 1, 16, 16, dict(alibi="batch", causal=True)),
    "no-append-gqa-causal": (4, 2, 2, 0, 16, 16, dict(causal=True)),
    "no-append-decode-softcap": (2, 1, 1, 0, 16, 16, dict(softcap=1.0)),
}
LAYOUTS = [CONTIGUOUS, 1, 7, 16, 256]


def _alibi(rng, kind, batch, heads_q, lib):
    if kind is None:
        return None
    shape = (heads_q,) if kind == "heads" else (batch, heads_q)
    return convert(rng.uniform(0.05, 1.0, shape), "float32", lib)


class Call:
    """One reference case's inputs: spec (heads_q, heads_kv, seqlen_q, seqlen_new, head_dim,
    head_dim_v, keywords) as CASES; layout CONTIGUOUS or a block size; lens default to
    ragged ones (empty, partial, full with the new rows). ``kw`` are the call's keywords
    (alibi replaced by the array ``alibi``); the caches are NaN wherever unread."""

    def __init__(self, rng, spec, layout, lib, dtype, capacity=37, lens=None):
        need_lib(lib)
        hq, hkv, sq, sn, d, dv, kw = spec
        self.kw = dict(kw)
        cap = capacity if layout == CONTIGUOUS else -(-capacity // layout) * layout
        if lens is None:
            lens = [0, int(rng.integers(1, cap - sn)), cap - sn]
        self.lens, self.sq, self.hq, self.dv = lens, sq, hq, dv
        self.batch = batch = len(lens)
        self.caches = Caches(rng, lens, capacity, hkv, d, dv,
                             None if layout == CONTIGUOUS else layout, reserve=sn)
        self.k_cache, self.v_cache, self.table = self.caches.arrays(dtype, lib)
        self.q = convert(rng.standard_normal((batch, sq, hq, d)), dtype, lib)
        self.k = self.v = None
        if sn:
            self.k = convert(rng.standard_normal((batch, sn, hkv, d)), dtype, lib)
            self.v = convert(rng.standard_normal((batch, sn, hkv, dv)), dtype, lib)
        self.alibi = _alibi(rng, self.kw.pop("alibi", None), batch, hq, lib)
        self.before = copy(self.k_cache), copy(self.v_cache)

    def reference(self):
        """(out, lse) of fmha.reference in float64, on the caches as they are now."""
        from fmha import reference
        kw = {n: x for n, x in self.kw.items() if n != "num_splits"}
        return reference.attention_with_kvcache(
            to_f64(self.q), to_f64(self.k_cache), to_f64(self.v_cache), to_f64(self.k),
            to_f64(self.v), cache_seqlens=self.lens, block_table=self.caches.table,
            alibi_slopes=to_f64(self.alibi), **kw)

    def assert_only_appended(self):
        """The caches hold the new rows at lens[b].., and nothing else changed."""
        want_k, want_v = self.caches.expected_after_append(*self.before, self.k, self.v)
        assert raw(self.k_cache) == raw(want_k)
        assert raw(self.v_cache) == raw(want_v)

