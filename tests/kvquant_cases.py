"""Shared helpers of the 8-bit KV-cache tests (test_kvquant.py on the CPU,
test_kvquant_cuda.py on the CUDA kernels): caches filled by quantising random rows, and
their dequantised float64 values."""

from __future__ import annotations

import numpy as np
import torch

from fmha import kvquant

TORCH_DTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn,
                "float8_e5m2": torch.float8_e5m2}


def make_cache(rng, fmt, scales, *, b=2, cap=40, hkv=2, d=16, paged=False, block=8):
    """An 8-bit cache (torch) filled by quantising random rows, with its scales: (k_codes,
    v_codes, k_scale, v_scale, block_table or None)."""
    shape = (b, cap, hkv, d)
    k, v = (rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(2))
    if scales == "static":
        ks = kvquant.calibrate_scales(k, fmt)
        vs = kvquant.calibrate_scales(v, fmt)
    else:
        ks, vs = kvquant.dynamic_scales(k, fmt), kvquant.dynamic_scales(v, fmt)
    kc, vc = kvquant.quantize(k, fmt, ks), kvquant.quantize(v, fmt, vs)
    table = None
    if paged:
        nblk = b * cap // block
        perm = rng.permutation(nblk)
        table = perm.reshape(b, cap // block).astype(np.int32)
        pool = lambda x: x.reshape((nblk, block) + x.shape[2:])[np.argsort(perm)]
        kc, vc = pool(kc), pool(vc)
        if scales == "dynamic":
            ks, vs = pool(ks), pool(vs)
    td = TORCH_DTYPES[fmt]
    as_t = lambda c: torch.from_numpy(np.ascontiguousarray(c)).view(td)
    return (as_t(kc), as_t(vc), torch.from_numpy(np.ascontiguousarray(ks)),
            torch.from_numpy(np.ascontiguousarray(vs)),
            None if table is None else torch.from_numpy(table))


def dense(codes, scale, fmt, table, scales):
    """The dequantised float64 cache (b, cap, hkv, d) of a (paged) 8-bit cache."""
    c = codes.view(torch.uint8).numpy()
    s = scale.numpy()
    x = kvquant.dequantize(c, fmt, s)
    if table is not None:
        t = table.numpy()
        x = x[t].reshape((t.shape[0], -1) + x.shape[2:])
    return x


def assert_appended(kc, kc0, ks, kn, fmt, scales, lens, table, block=8):
    """The append of kn (batch, new, heads_kv, d) at rows lens[b]... of the 8-bit cache kc
    (kc0 before it): the new rows' codes (and dynamic scales) are fmha.kvquant's, bit for
    bit, and (contiguous caches) no other row changed."""
    x = kn.float().numpy()
    new = x.shape[1]
    if scales == "dynamic":
        want_s = kvquant.dynamic_scales(x, fmt)
        want_c = kvquant.quantize(x, fmt, want_s)
    else:
        want_c = kvquant.quantize(x, fmt, ks.numpy())
    kd, kd0 = (c.view(torch.uint8).numpy() for c in (kc, kc0))
    for bi in range(x.shape[0]):
        rows = np.arange(int(lens[bi]), int(lens[bi]) + new)
        if table is None:
            got_c, base = kd[bi, rows], kd0[bi].copy()
            base[rows] = got_c
            np.testing.assert_array_equal(base, kd[bi])
        else:
            t = table.numpy()[bi]
            got_c = kd[t[rows // block], rows % block]
        np.testing.assert_array_equal(got_c, kvquant.as_codes(want_c[bi]))
        if scales == "dynamic":
            s = ks.numpy()
            got_s = (s[bi, rows] if table is None
                     else s[table.numpy()[bi][rows // block], rows % block])
            np.testing.assert_array_equal(got_s, want_s[bi])
