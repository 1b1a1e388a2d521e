"""The build's CUDA options and the CUDA benchmarks, checked without a GPU.

* cmake/cuda_config.cmake (run in CMake's script mode, no compiler needed): the head-dim
  option becomes the mask that csrc/cuda/head_dims.h reads, selects the instantiation files,
  and bad values stop the configure with a message naming the option; architectures become
  SASS for each and PTX for the highest.
* fmha-bench --cuda: a clear message and a non-zero exit without a GPU; a timed line with one.
* python -m fmha.bench --cuda: its whole measuring and reporting path, run on the CPU
  (--device cpu) on a tiny shape.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CMAKE = shutil.which("cmake")
needs_cmake = pytest.mark.skipif(CMAKE is None, reason="cmake not found")


def cmake_script(tmp_path, body: str, **env):
    """Runs `body` after include(cmake/cuda_config.cmake) in script mode; (rc, output)."""
    script = tmp_path / "probe.cmake"
    script.write_text(f'include("{ROOT / "cmake" / "cuda_config.cmake"}")\n{body}\n')
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("FMHA_CUDA_HEAD_DIMS", "FMHA_CUDA_ARCHS")}
    full_env.update(env)
    p = subprocess.run([CMAKE, "-P", str(script)], capture_output=True, text=True, env=full_env)
    return p.returncode, p.stdout + p.stderr


@needs_cmake
def test_tile_order_matches_head_dims_h(tmp_path):
    """Bit i of FMHA_CUDA_HDIM_MASK must mean the same tile in CMake and in head_dims.h."""
    text = (ROOT / "csrc" / "cuda" / "head_dims.h").read_text()
    tiles_h = re.search(r"kHeadDimTiles\[\]\s*=\s*\{([^}]*)\}", text).group(1)
    rc, out = cmake_script(tmp_path, 'message("tiles=${FMHA_KNOWN_HEAD_DIM_TILES}")')
    assert rc == 0, out
    assert re.search(r"tiles=(\S+)", out).group(1).split(";") == \
        [t.strip() for t in tiles_h.split(",")]


@needs_cmake
@pytest.mark.parametrize("value, mask", [("", "0x1f"), ("64;128", "0xa"), ("128,64", "0xa"),
                                         ("32", "0x1"), ("256 96", "0x14")])
def test_head_dims_mask(tmp_path, value, mask):
    env = {"FMHA_CUDA_HEAD_DIMS": value} if value else {}
    rc, out = cmake_script(tmp_path, 'message("mask=${FMHA_CUDA_HDIM_MASK}")', **env)
    assert rc == 0, out
    assert f"mask={mask}" in out


@needs_cmake
def test_head_dims_select_instantiation_files(tmp_path):
    files = ["csrc/cuda/device.cu", "csrc/cuda/flash_fwd.cu",
             "csrc/cuda/instantiations/flash_fwd_hdim64_fp16.cu",
             "csrc/cuda/instantiations/flash_fwd_hdim64_bf16_split.cu",
             "csrc/cuda/instantiations/flash_bwd_hdim128_bf16.cu",
             "csrc/cuda/instantiations/flash_fwd_hdim256_fp16.cu",
             "csrc/cuda/instantiations/flash_bwd_hdim32_fp16_extras.cu"]
    rc, out = cmake_script(
        tmp_path, f'set(src "{";".join(files)}")\n'
                  'fmha_filter_head_dims(src "${FMHA_CUDA_HEAD_DIMS}")\nmessage("kept=${src}")',
        FMHA_CUDA_HEAD_DIMS="64;128")
    assert rc == 0, out
    kept = re.search(r"kept=(\S+)", out).group(1).split(";")
    assert kept == files[:5]


@needs_cmake
@pytest.mark.parametrize("var, value, expect", [
    ("FMHA_CUDA_HEAD_DIMS", "65", 'FMHA_CUDA_HEAD_DIMS contains "65"'),
    ("FMHA_CUDA_HEAD_DIMS", "64;512", 'FMHA_CUDA_HEAD_DIMS contains "512"'),
    ("FMHA_CUDA_ARCHS", "75", 'FMHA_CUDA_ARCHS contains "75"'),
    ("FMHA_CUDA_ARCHS", "90a", 'FMHA_CUDA_ARCHS contains "90a"'),
])
def test_bad_options_stop_the_configure(tmp_path, var, value, expect):
    rc, out = cmake_script(tmp_path, "", **{var: value})
    assert rc != 0
    flat = " ".join(out.split())
    assert expect in flat and "expected" in flat, out


@needs_cmake
@pytest.mark.parametrize("archs, cmake_archs", [("80;90", "80-real;90"), ("90,80", "80-real;90"),
                                                ("80", "80"), ("80;86;90", "80-real;86-real;90"),
                                                ("90;100", "90-real;100")])
def test_sass_for_every_arch_ptx_for_the_highest(tmp_path, archs, cmake_archs):
    rc, out = cmake_script(
        tmp_path, 'fmha_cuda_architectures("${FMHA_CUDA_ARCHS}" a)\nmessage("archs=${a}")',
        FMHA_CUDA_ARCHS=archs)
    assert rc == 0, out
    assert f"archs={cmake_archs}\n" in out


def _configure_copy(tmp_path, **env_overrides):
    """A real configure (CPU-only, so no nvcc needed) of a copy of the build files with three
    stand-in instantiation files (configure only globs them; nothing is compiled). Returns
    (cmake's stdout, build.ninja)."""
    pybind11 = pytest.importorskip("pybind11")
    if shutil.which("ninja") is None and shutil.which("ninja", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("ninja not found")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "cmake", src / "cmake")
    shutil.copytree(ROOT / "csrc", src / "csrc", ignore=shutil.ignore_patterns("instantiations"))
    shutil.copy(ROOT / "CMakeLists.txt", src / "CMakeLists.txt")
    inst = src / "csrc" / "cuda" / "instantiations"
    inst.mkdir()
    for name in ("flash_fwd_hdim64_fp16", "flash_bwd_hdim96_bf16", "flash_fwd_hdim256_bf16_split"):
        (inst / f"{name}.cu").write_text("// stand-in\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("FMHA_BUILD_TESTING", "FMHA_BUILD_EMULATOR", "FMHA_EMU_HEAD_DIMS")}
    env.update(FMHA_DISABLE_CUDA="1", PATH=os.path.dirname(sys.executable) + os.pathsep +
               os.environ.get("PATH", ""), **env_overrides)
    p = subprocess.run([CMAKE, "-S", str(src), "-B", str(tmp_path / "b"), "-G", "Ninja",
                        f"-DPython_EXECUTABLE={sys.executable}",
                        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "CUDA disabled" in p.stdout
    return p.stdout, (tmp_path / "b" / "build.ninja").read_text()


@needs_cmake
def test_configure_passes_the_mask_to_the_emulator_targets(tmp_path):
    """A testing build's emulator kernels are compiled with the mask of FMHA_EMU_HEAD_DIMS and
    only the matching instantiation files."""
    out, ninja = _configure_copy(tmp_path, FMHA_BUILD_TESTING="ON", FMHA_EMU_HEAD_DIMS="64,256")
    assert "fmha._cuda_emu (head-dim tiles 64;256)" in out
    masks = set(re.findall(r"-DFMHA_CUDA_HDIM_MASK=(\S+)", ninja))
    assert masks == {"0x12"}, masks
    emulated = set(re.findall(r"csrc_cuda_instantiations_(\w+?)_cu\.emu\.cpp\.o:", ninja))
    assert emulated == {"flash_fwd_hdim64_fp16", "flash_fwd_hdim256_bf16_split"}, emulated


@needs_cmake
@pytest.mark.parametrize("testing", ["OFF", "ON"])
def test_test_machinery_builds_only_when_asked(tmp_path, testing):
    """A default configure builds the library alone: no fmha._cuda_emu target and no test
    probes compiled into fmha._C. FMHA_BUILD_TESTING=ON brings both."""
    env = {} if testing == "OFF" else {"FMHA_BUILD_TESTING": "ON"}
    out, ninja = _configure_copy(tmp_path, **env)
    assert f"test machinery (FMHA_BUILD_TESTING): {testing}" in out
    emulator = re.search(r"^build \S*_cuda_emu\S*\.so", ninja, re.M) is not None
    probes = "-DFMHA_TESTING_PROBES=1" in ninja
    assert (emulator, probes) == ((testing == "ON"),) * 2, (emulator, probes)
    assert re.search(r"^build \S*_C\S*\.so", ninja, re.M), "fmha._C is always built"


def _fmha_bench():
    exe = shutil.which("fmha-bench", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("fmha-bench is not installed next to this Python")
    return exe


def test_fmha_bench_cuda_mode():
    import fmha

    exe = _fmha_bench()
    if "cuda" in fmha.backends():
        p = subprocess.run([exe, "--cuda", "--case", "1,2,256,64", "--pass", "fwd", "--reps", "3"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert re.search(r"f16\s+fwd .* TFLOP/s", p.stdout), p.stdout
        return
    p = subprocess.run([exe, "--cuda"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert ("this build has no CUDA" in p.stderr) or ("no GPU" in p.stderr), p.stderr
    # Argument errors name the argument and what it accepts.
    p = subprocess.run([exe, "--cuda", "--dtype", "f32"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode in (1, 2)
    if "this build has no CUDA" not in p.stderr:
        assert "--dtype f32; expected f16, bf16 or all" in p.stderr, p.stderr


def test_bench_cuda_smoke_on_cpu(tmp_path):
    """The benchmark's measuring, comparing and writing, on a tiny shape on the CPU."""
    torch = pytest.importorskip("torch")
    from fmha.bench import cuda as bench_cuda

    out = tmp_path / "gpu" / "bench.json"
    case = ("tiny-causal", 1, 2, 64, 32, True)
    rows = bench_cuda.run([case], ["bfloat16"], ["fwd", "fwd+bwd"], 2, str(out), device="cpu")
    assert [(r.pass_, r.impl) for r in rows] == [
        ("fwd", "fmha"), ("fwd", "torch_sdpa_flash"),
        ("fwd+bwd", "fmha"), ("fwd+bwd", "torch_sdpa_flash")]
    for r in rows:
        assert r.error is None, r.error
        assert r.median_s > 0 and r.gflops > 0
    for r in rows[::2]:
        assert r.ratio_vs_sdpa > 0
        # Same inputs, same semantics: the two agree to bfloat16 rounding.
        assert r.max_abs_diff < 0.05, r
    data = json.loads(out.read_text())
    assert data["meta"]["peer"].startswith("torch SDPA")
    assert len(data["rows"]) == 4
    assert (tmp_path / "gpu" / "bench.csv").read_text().count("\n") == 5
    assert "| tiny-causal | bfloat16 | fwd+bwd |" in (tmp_path / "gpu" / "bench.md").read_text()
    del torch


def test_bench_cuda_peers_on_cpu(tmp_path):
    """--peers sm80: fmha with FMHA_CUDA_KERNEL=sm80 beside the default choice, its ratio to
    SDPA flash on its own row (the cuDNN peer needs a GPU: elsewhere its row records the error);
    an unknown peer is refused by name."""
    pytest.importorskip("torch")
    from fmha.bench import cuda as bench_cuda

    case = ("tiny", 1, 2, 64, 32, False)
    rows = bench_cuda.run([case], ["bfloat16"], ["fwd"], 2, None, device="cpu",
                          peers=["sm80", "cudnn"])
    by = {r.impl: r for r in rows}
    assert set(by) == {"fmha", "torch_sdpa_flash", "fmha_sm80", "torch_sdpa_cudnn"}
    assert by["fmha_sm80"].error is None and by["fmha_sm80"].ratio_vs_sdpa > 0
    assert by["torch_sdpa_cudnn"].ratio_vs_sdpa is None
    assert "FMHA_CUDA_KERNEL" not in __import__("os").environ
    with pytest.raises(SystemExit):
        bench_cuda.main(["--peers", "sm100"])


def test_bench_cuda_float8_on_cpu(tmp_path):
    """float8_e4m3fn rows: fmha on e4m3 codes with per-(batch, head) descales, forward only
    (a fwd+bwd pass is left out), within e4m3's rounding of SDPA on the bfloat16 tensors;
    the sm_80 peer, which has no float8 path, is left out of them."""
    pytest.importorskip("torch")
    from fmha.bench import cuda as bench_cuda

    case = ("tiny", 1, 2, 64, 32, False)
    rows = bench_cuda.run([case], ["float8_e4m3fn"], ["fwd", "fwd+bwd"], 2, None,
                          device="cpu", peers=["sm80"])
    assert [(r.dtype, r.pass_, r.impl) for r in rows] == [
        ("float8_e4m3fn", "fwd", "fmha"), ("float8_e4m3fn", "fwd", "torch_sdpa_flash")]
    assert rows[0].error is None and rows[0].ratio_vs_sdpa > 0
    assert 0 < rows[0].max_abs_diff < 0.1, rows[0]


def test_bench_cuda_without_gpu_says_so(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from fmha.bench import cuda as bench_cuda

    assert bench_cuda.main(["--quick"]) == 2
    assert "no GPU" in capsys.readouterr().err
