"""The C++ core and its CPU kernels without Python in the process, on another processor and
under the sanitizers: tests/cpu_core/run_case (a standalone CMake project sharing
cmake/cpu_core.cmake with the package) runs fmha's CPU forward and backward on cases this
file writes, and the results are compared with fmha.reference by the suite's tolerance rule
(assert_close in tests/conftest.py).

* aarch64: the core cross-compiled with g++-aarch64-linux-gnu (only the portable scalar level
  exists there: CMake adds no x86 flag for that target) and run under qemu-aarch64.
* AddressSanitizer + UndefinedBehaviorSanitizer (float-cast-overflow included; every report is
  fatal), natively, once per CPU kernel level this CPU has (FMHA_CPU_ISA).

The cases cover every dtype and feature: causal (both alignments, rows with no visible key),
windows, GQA, head_dim_v != head_dim, strided layouts, bias with dbias (broadcast, -inf
entries), boolean masks, softcap, ALiBi, dropout, varlen with empty sequences, two threads.
Every array the runner hands the kernels is aligned to its element only, and outputs start as
NaN, so an unwritten element fails the comparison.

Without the cross compiler or qemu-aarch64 (Debian: g++-aarch64-linux-gnu, qemu-user) the
aarch64 tests skip and say so, except with CI=true, where they fail (.ci/run installs both).
FMHA_CPU_CORE_BUILD_DIR=<dir> keeps the two builds in <dir> (reused by later runs).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from fmha import kvquant, reference
from fmha._philox import dropout_keep_mask

from conftest import LOW_PRECISION, assert_close, naive_results, round_to

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tests" / "cpu_core"
LEVELS = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]
AARCH64_CXX = "aarch64-linux-gnu-g++"
AARCH64_SYSROOT = "/usr/aarch64-linux-gnu"
SANITIZER_ENV = {
    # LeakSanitizer needs ptrace, which containers often forbid; leaks are not the point here.
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}
SANITIZER_REPORT = ("ERROR: AddressSanitizer", "runtime error:", "SUMMARY: UndefinedBehavior",
                    "SUMMARY: AddressSanitizer")

# name -> settings; sizes small enough for qemu, odd on purpose, and large enough to span
# several key tiles and (with two threads) several tasks.
CASES = {
    "f64_cross": dict(dtype="float64", b=2, sq=37, sk=53, hq=2, hkv=2, d=24, dv=24),
    "f64_tiny_dims": dict(dtype="float64", b=1, sq=1, sk=5, hq=1, hkv=1, d=1, dv=3),
    "f32_causal_gqa_empty_rows": dict(dtype="float32", b=2, sq=70, sk=45, hq=4, hkv=2, d=40,
                                      dv=33, causal=True),
    "f32_window_top_left_softcap_alibi": dict(dtype="float32", b=2, sq=66, sk=66, hq=2, hkv=1,
                                              d=32, dv=32, window=(8, 3), alignment="top_left",
                                              softcap=5.0, alibi="bh"),
    "f64_bias_dbias_mask": dict(dtype="float64", b=2, sq=29, sk=41, hq=3, hkv=3, d=16, dv=20,
                                bias=(2, 1, 29, 41), mask=(2, 1, 1, 41), neg_inf_bias=True),
    "f32_dropout_full_bias_threads": dict(dtype="float32", b=1, sq=50, sk=131, hq=4, hkv=2, d=64,
                                          dv=64, bias=(1, 4, 50, 131), dropout_p=0.2, seed=1234,
                                          threads=2),
    "f32_strided_long_keys": dict(dtype="float32", b=1, sq=33, sk=300, hq=2, hkv=2, d=128,
                                  dv=72, layout="bhsd", threads=2, causal=True,
                                  alignment="top_left"),
    "f64_varlen": dict(dtype="float64", varlen=[(5, 9), (0, 4), (17, 1), (12, 0), (30, 30)],
                       hq=2, hkv=1, d=16, dv=16, causal=True, alibi="bh", dropout_p=0.1,
                       seed=77),
    "f32_varlen_window_strided": dict(dtype="float32", varlen=[(40, 70), (3, 3), (64, 20)], hq=2,
                                      hkv=2, d=48, dv=48, window=(10, 10), softcap=3.0,
                                      layout="bhsd", threads=2),
    "bf16_causal_bias_mask": dict(dtype="bfloat16", b=1, sq=45, sk=77, hq=2, hkv=1, d=64, dv=64,
                                  causal=True, bias=(1, 2, 45, 77), mask=(1, 2, 45, 77)),
    "f16_window_alibi_dropout": dict(dtype="float16", b=2, sq=38, sk=38, hq=2, hkv=2, d=32,
                                     dv=32, window=(6, -1), alibi="h", dropout_p=0.15, seed=5),
    # float8 inputs (forward only): descales per (batch, kv head), one broadcast (stride 0)
    "fp8_causal_gqa_descales_strided": dict(dtype="float8_e4m3fn", b=2, sq=37, sk=53, hq=4,
                                            hkv=2, d=40, dv=24, causal=True, layout="bhsd",
                                            threads=2),
}

# Run under the sanitizers only, with no comparison of values: NaN and Inf inputs (in q, k, v
# and dout) must reach the kernels' float-to-int steps (the exponent of exp) without
# undefined behaviour at any level. What fmha must return for them is the NaN/Inf rule of
# docs/semantics.md, checked against the reference by the kernel suites.
NONFINITE_CASES = {
    "f32_nonfinite_inputs": dict(dtype="float32", b=1, sq=40, sk=70, hq=2, hkv=1, d=32, dv=32,
                                 causal=True, bias=(1, 2, 40, 70), threads=2, nonfinite=True),
    "bf16_nonfinite_inputs": dict(dtype="bfloat16", b=1, sq=21, sk=33, hq=2, hkv=2, d=16, dv=16,
                                  softcap=4.0, nonfinite=True),
}

_NP = {"float64": "<f8", "float32": "<f4", "float16": "<f2"}


FP8 = "float8_e4m3fn"


def _elem(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, FP8: 1}[dtype]


def _to_bytes(x64: np.ndarray, dtype: str) -> bytes:
    """float64 values (already representable in dtype) as dtype's bytes, C order."""
    x64 = np.ascontiguousarray(x64)
    if dtype == FP8:  # exact values: their codes
        return kvquant.quantize(x64, FP8, np.float32(1)).tobytes()
    if dtype == "bfloat16":
        return (x64.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    return x64.astype(_NP[dtype]).tobytes()


def _from_bytes(raw: bytes, dtype: str, shape) -> np.ndarray:
    if dtype == "bfloat16":
        bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64).reshape(shape)
    return np.frombuffer(raw, _NP[dtype]).astype(np.float64).reshape(shape)


def _contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return strides


class Case:
    """One case on disk (case.txt and the inputs) and its expected results."""

    def __init__(self, name: str, spec: dict, directory: Path):
        self.name, self.spec, self.dir = name, spec, directory
        directory.mkdir(parents=True, exist_ok=True)
        s = spec
        self.dtype = dt = s["dtype"]
        self.acc = "float64" if dt == "float64" else "float32"
        self.out_dtype = "bfloat16" if dt == FP8 else dt  # float8 inputs: bfloat16 out
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        hq, hkv, d, dv = s["hq"], s["hkv"], s["d"], s["dv"]
        self.varlen = s.get("varlen")
        if self.varlen:
            lens_q = [lq for lq, _ in self.varlen]
            lens_k = [lk for _, lk in self.varlen]
            b, tq, tk = len(self.varlen), sum(lens_q), sum(lens_k)
            sq, sk = max(max(lens_q), 1), max(max(lens_k), 1)
            self.cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
            self.cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
            lead_q, lead_k = (tq,), (tk,)
        else:
            b, sq, sk = s["b"], s["sq"], s["sk"]
            lead_q, lead_k = (b, sq), (b, sk)
        self.full = (b, hq, sq, sk)
        draw = lambda shape: (  # noqa: E731
            reference.fp8_dequantize(kvquant.quantize(rng.standard_normal(shape), FP8, 1))
            if dt == FP8 else round_to(rng.standard_normal(shape), dt))
        self.q, self.k = draw(lead_q + (hq, d)), draw(lead_k + (hkv, d))
        self.v, self.dout = draw(lead_k + (hkv, dv)), draw(lead_q + (hq, dv))
        if s.get("nonfinite"):
            self.q[..., 3, 0, 5], self.k[..., 7, 0, 2] = np.nan, np.inf
            self.v[..., 11, 0, 1], self.dout[..., 5, 1, 0] = -np.inf, np.nan

        settings = dict(dtype=dt, o_dtype=self.out_dtype, batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk,
                        head_dim=d, head_dim_v=dv, scale=s.get("scale", 1.0 / np.sqrt(d)),
                        softcap=s.get("softcap", 0.0), dropout_p=s.get("dropout_p", 0.0),
                        seed=s.get("seed", 0), offset=0, num_threads=s.get("threads", 1),
                        bottom_right=int(s.get("alignment", "bottom_right") == "bottom_right"))
        left, right = s.get("window", (-1, -1))
        settings.update(window_left=left, window_right=0 if s.get("causal") else right)
        if self.varlen:  # the packed row counts, which bound every sequence (score::seq_of)
            settings.update(total_q=lead_q[0], total_k=lead_k[0])
        lines = [f"{key} {value}" for key, value in settings.items()]

        def array(field, x64, prefix, layout):
            """An input in (batch, seqlen, heads, dim) order -- (tokens, heads, dim) when
            varlen -- stored contiguously ("bshd") or heads-major ("bhsd", a transposed view);
            its batch, row and head strides go to <prefix>_*_stride."""
            if layout == "bhsd":
                order = (1, 0, 2) if self.varlen else (0, 2, 1, 3)
                stored = x64.transpose(order)
                st = _contiguous_strides(stored.shape)
                strides = [0, st[1], st[0]] if self.varlen else [st[0], st[2], st[1]]
            else:
                stored, st = x64, _contiguous_strides(x64.shape)
                strides = [0, st[0], st[1]] if self.varlen else st[:3]
            (directory / f"{field}.in").write_bytes(_to_bytes(stored, dt))
            lines.append(f"in {field} {_elem(dt)} {field}.in")
            lines.extend(f"{prefix}_{n}_stride {v}" for n, v in zip(("batch", "row", "head"),
                                                                     strides))

        layout = s.get("layout", "bshd")
        self.fields = ("q", "k", "v") if dt == FP8 else ("q", "k", "v", "dout")  # no backward
        for field in self.fields:
            array(field, getattr(self, field), "do" if field == "dout" else field, layout)
        self.descales = {}
        if dt == FP8:  # (b, hkv) float32; k's one factor for all, a broadcast (stride 0)
            for field, shape in (("q_descale", (b, hkv)), ("k_descale", (1, 1)),
                                 ("v_descale", (b, hkv))):
                x = rng.uniform(0.3, 2.0, shape).astype(np.float32)
                self.descales[field] = x
                (directory / f"{field}.in").write_bytes(x.astype("<f4").tobytes())
                lines.append(f"in {field} 4 {field}.in")
                st = [0, 0] if shape == (1, 1) else [hkv, 1]
                lines += [f"{field}_batch_stride {st[0]}", f"{field}_head_stride {st[1]}"]
        # Outputs: contiguous, in the kernels' layout.
        outputs = (("o", lead_q, hq, dv), ("dq", lead_q, hq, d), ("dk", lead_k, hkv, d),
                   ("dv", lead_k, hkv, dv))
        for field, lead, heads, dim in outputs[:1] if dt == FP8 else outputs:
            shape = lead + (heads, dim)
            st = _contiguous_strides(shape)
            st = ([0] + st) if self.varlen else st
            for n, value in zip(("batch", "row", "head"), st[:3]):
                lines.append(f"{field}_{n}_stride {value}")
            lines.append(f"out {field} {_elem(self.out_dtype if field == 'o' else dt)} "
                         f"{int(np.prod(shape))}")
        self.lse_shape = (hq, lead_q[0]) if self.varlen else (b, hq, sq)
        if self.varlen:
            lines += ["lse_batch_stride 0", f"lse_head_stride {lead_q[0]}", "lse_row_stride 1"]
        else:
            lines += [f"lse_batch_stride {hq * sq}", f"lse_head_stride {sq}", "lse_row_stride 1"]
        lines.append(f"out lse {_elem(self.acc)} {int(np.prod(self.lse_shape))}")

        self.kw = dict(causal=bool(s.get("causal")), window=s.get("window", (-1, -1)),
                       alignment=s.get("alignment", "bottom_right"), scale=settings["scale"],
                       softcap=settings["softcap"], dropout_p=settings["dropout_p"],
                       seed=settings["seed"], offset=0)
        self.bias = self.mask = self.alibi = None
        if self.varlen:
            for field, cu in (("cu_seqlens_q", self.cu_q), ("cu_seqlens_k", self.cu_k)):
                (directory / f"{field}.in").write_bytes(cu.astype("<i4").tobytes())
                lines.append(f"in {field} 4 {field}.in")
        if s.get("bias"):
            bias_dtype = "float64" if dt == "float64" else "float32"
            self.bias = rng.standard_normal(s["bias"])
            if s.get("neg_inf_bias"):  # some scores of -inf: weight exactly zero
                self.bias[..., ::7] = -np.inf
            self.bias = round_to(self.bias, bias_dtype)
            (directory / "bias.in").write_bytes(_to_bytes(self.bias, bias_dtype))
            lines += [f"in bias {_elem(bias_dtype)} bias.in", f"bias.dtype {bias_dtype}"]
            lines += self._broadcast_strides("bias", s["bias"])
            self.dbias_shape = tuple(1 if n == 1 else f for n, f in zip(s["bias"], self.full))
            lines += [f"dbias_{n} {v}" for n, v in zip(("batch", "heads", "rows", "cols"),
                                                       self.dbias_shape)]
            lines.append(f"out dbias {_elem(self.acc)} {int(np.prod(self.dbias_shape))}")
        if s.get("mask"):
            self.mask = rng.random(s["mask"]) < 0.8
            if s["mask"][0] > 1:
                self.mask[-1] = False  # a whole batch entry sees no key
            (directory / "mask.in").write_bytes(self.mask.astype(np.uint8).tobytes())
            lines.append("in mask 1 mask.in")
            lines += self._broadcast_strides("mask", s["mask"])
        if s.get("alibi"):
            shape = (hq,) if s["alibi"] == "h" else (b, hq)
            self.alibi = rng.uniform(0.01, 0.5, shape)
            (directory / "alibi_slopes.in").write_bytes(self.alibi.astype("<f8").tobytes())
            lines.append("in alibi_slopes 8 alibi_slopes.in")
            lines += (["alibi_batch_stride 0", "alibi_head_stride 1"] if s["alibi"] == "h" else
                      [f"alibi_batch_stride {hq}", "alibi_head_stride 1"])
        (directory / "case.txt").write_text("\n".join(lines) + "\n")

    @staticmethod
    def _broadcast_strides(field, shape):
        st = _contiguous_strides(shape)
        return [f"{field}.{n}_stride {0 if size == 1 else stride}"
                for n, size, stride in zip(("batch", "head", "row", "col"), shape, st)]

    @functools.cached_property
    def expected(self) -> dict:
        kw = dict(self.kw, alibi_slopes=self.alibi)
        if self.dtype == FP8:  # the exact attention of the dequantised inputs
            assert not self.varlen and self.bias is None and self.mask is None
            group = self.q.shape[2] // self.k.shape[2]
            q, k, v = (x * np.repeat(np.broadcast_to(self.descales[f"{n}_descale"],
                                                     (x.shape[0], self.k.shape[2])),
                                     group if n == "q" else 1, axis=1)[:, None, :, None]
                       for n, x in (("q", self.q), ("k", self.k), ("v", self.v)))
            del kw["dropout_p"], kw["seed"], kw["offset"]
            out, lse = reference.attention_forward(q, k, v, **kw)
            return dict(o=out, lse=lse)
        if self.varlen:
            out, lse = reference.attention_varlen_forward(self.q, self.k, self.v, self.cu_q,
                                                          self.cu_k, **kw)
            dq, dk, dv = reference.attention_varlen_backward(self.dout, self.q, self.k, self.v,
                                                             self.cu_q, self.cu_k, **kw)
            return dict(o=out, lse=lse, dq=dq, dk=dk, dv=dv)
        kw.update(bias=self.bias, mask=self.mask)
        out, lse = reference.attention_forward(self.q, self.k, self.v, **kw)
        dq, dk, dv, dbias = reference.attention_backward(self.dout, self.q, self.k, self.v, **kw)
        res = dict(o=out, lse=lse, dq=dq, dk=dk, dv=dv)
        if self.bias is not None:
            res["dbias"] = dbias.reshape(self.dbias_shape)
        return res

    @functools.cached_property
    def naive(self) -> dict | None:
        """The same computation done naively in the low precision (the tolerance baseline)."""
        if self.dtype not in LOW_PRECISION:
            return None
        import torch
        t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(getattr(torch, self.dtype))
        kw = {key: self.kw[key] for key in ("causal", "window", "alignment", "scale", "softcap")}
        if self.kw["dropout_p"] > 0:
            b, hq, sq, sk = self.full
            keep = dropout_keep_mask(self.kw["seed"], 0, b, hq, sq, sk, self.kw["dropout_p"])
            kw["dropout_z"] = torch.from_numpy(keep / (1.0 - self.kw["dropout_p"]))
        res = naive_results(t(self.q), t(self.k), t(self.v), t(self.dout),
                            bias=None if self.bias is None else torch.from_numpy(self.bias),
                            bias_grad=self.bias is not None,
                            mask=None if self.mask is None else torch.from_numpy(self.mask),
                            alibi_slopes=self.alibi, **kw)
        res["o"] = res.pop("out")
        return res

    def check(self, tag: str):
        """The outputs the runner wrote under `tag` against the reference."""
        shapes = dict(o=self.q.shape[:-1] + self.v.shape[-1:], lse=self.lse_shape,
                      dq=self.q.shape, dk=self.k.shape, dv=self.v.shape)
        if self.dtype == FP8:
            for field in ("dq", "dk", "dv"):
                del shapes[field]
        if self.bias is not None:
            shapes["dbias"] = self.dbias_shape
        naive = self.naive
        for field, shape in shapes.items():
            stored = (self.out_dtype if field == "o" else self.dtype
                      if field in ("dq", "dk", "dv") else self.acc)
            got = _from_bytes((self.dir / f"{tag}.{field}.bin").read_bytes(), stored, shape)
            assert_close(f"{self.name}: {field}", got, self.expected[field],
                         "float32" if self.dtype == FP8 and field == "lse" else self.dtype,
                         naive=None if naive is None else naive[field],
                         grad=field.startswith("d"), result_dtype=stored)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_core_cases")
    made = {}

    def get(name):
        if name not in made:
            if CASES.get(name, NONFINITE_CASES.get(name))["dtype"] in LOW_PRECISION + (FP8,):
                pytest.importorskip("torch", reason="bfloat16 rounding and the low-precision "
                                                    "tolerance rule need torch")
            made[name] = Case(name, {**CASES, **NONFINITE_CASES}[name], root / name)
        return made[name]

    return get


# ----------------------------------------------------------------------------- builds


def _unavailable(reason: str):
    """Skip locally; with CI=true the run must happen, so fail saying what is missing."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: this test must run; .ci/run installs what it needs)")
    pytest.skip(reason)


def _find_cmake() -> str | None:
    exe = shutil.which("cmake")
    if exe:
        return exe
    try:
        import cmake  # the PyPI distribution of cmake
    except ImportError:
        return None
    cand = Path(cmake.CMAKE_BIN_DIR) / "cmake"
    return str(cand) if cand.exists() else None


def _build(tmp_path_factory, name: str, *args: str) -> Path:
    cmake = _find_cmake()
    if cmake is None:
        _unavailable("cmake not found: cannot build tests/cpu_core")
    keep = os.environ.get("FMHA_CPU_CORE_BUILD_DIR")
    build = Path(keep) / name if keep else tmp_path_factory.mktemp(f"cpu_core_{name}")
    for cmd in ([cmake, "-S", str(PROJECT), "-B", str(build), *args],
                [cmake, "--build", str(build), "-j", "2"]):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return build / "run_case"


@pytest.fixture(scope="module")
def aarch64(tmp_path_factory):
    """A command prefix that runs the aarch64 build of run_case under qemu."""
    missing = [tool for tool in (AARCH64_CXX, "qemu-aarch64") if shutil.which(tool) is None]
    if missing:
        _unavailable(f"{' and '.join(missing)} not found: cannot cross-compile and run the "
                     f"aarch64 build (Debian packages g++-aarch64-linux-gnu, qemu-user)")
    exe = _build(tmp_path_factory, "aarch64",
                 f"-DCMAKE_TOOLCHAIN_FILE={PROJECT / 'aarch64-linux-gnu.cmake'}")
    return ["qemu-aarch64", "-L", AARCH64_SYSROOT, str(exe)]


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    return [str(_build(tmp_path_factory, "asan", "-DFMHA_SANITIZE=ON"))]


def _run(cmd, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def _run_case(runner, case: Case, tag: str, isa: str | None, sanitizers: bool):
    env = dict(SANITIZER_ENV) if sanitizers else {}
    env["FMHA_CPU_ISA"] = isa or ""
    p = _run(runner + [tag, str(case.dir)], env)
    report = [m for m in SANITIZER_REPORT if m in p.stderr]
    assert not report, f"sanitizer report running {case.name} at {isa}:\n{p.stderr[-6000:]}"
    assert p.returncode == 0, f"run_case {case.name} failed ({p.returncode}):\n" \
                              f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    assert p.stdout.startswith(f"isa {isa or 'scalar'}\n"), p.stdout
    if not case.spec.get("nonfinite"):
        case.check(tag)


# ----------------------------------------------------------------------------- aarch64


def test_aarch64_build_has_only_the_portable_level(aarch64):
    info = _run(aarch64 + ["--info"], {"FMHA_CPU_ISA": ""})
    assert info.returncode == 0, info.stderr
    assert info.stdout.splitlines()[:2] == ["best scalar", "active scalar"], info.stdout
    forced = _run(aarch64 + ["--info"], {"FMHA_CPU_ISA": "avx2"})
    assert forced.returncode != 0
    assert "FMHA_CPU_ISA=avx2: this build has no avx2 kernels" in forced.stderr, forced.stderr


@pytest.mark.parametrize("name", sorted(CASES))
def test_aarch64_matches_reference(aarch64, cases, name):
    _run_case(aarch64, cases(name), "aarch64", None, sanitizers=False)


# ----------------------------------------------------------------------------- sanitizers


@pytest.fixture(scope="module")
def best_native_level(sanitized) -> str:
    info = _run(sanitized + ["--info"], dict(SANITIZER_ENV, FMHA_CPU_ISA=""))
    assert info.returncode == 0, info.stderr
    return info.stdout.splitlines()[0].split()[1]


@pytest.mark.parametrize("name", sorted(CASES) + sorted(NONFINITE_CASES))
@pytest.mark.parametrize("isa", LEVELS)
def test_sanitizers_clean_and_match_reference(sanitized, best_native_level, cases, isa, name):
    # amx runs wherever avx512bf16 does: through the AMX model without AMX hardware
    reach = "amx" if best_native_level == "avx512bf16" else best_native_level
    if LEVELS.index(isa) > LEVELS.index(reach):
        pytest.skip(f"this CPU has no {isa} (best level: {best_native_level})")
    _run_case(sanitized, cases(name), f"asan-{isa}", isa, sanitizers=True)


def test_sanitizers_catch_a_planted_overflow(sanitized, cases, tmp_path):
    """The harness can fail: q one row short of what its strides address makes the kernels
    read past its allocation, which AddressSanitizer must report."""
    case = cases("f64_cross")
    planted = tmp_path / "planted"
    shutil.copytree(case.dir, planted)
    q = (planted / "q.in").read_bytes()
    row = case.q.shape[2] * case.q.shape[3] * 8
    (planted / "q.in").write_bytes(q[:-row])
    p = _run(sanitized + ["planted", str(planted)], dict(SANITIZER_ENV, FMHA_CPU_ISA="scalar"))
    assert p.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in p.stderr, p.stderr[-4000:]
