"""tools/gpu_check.sh runs the CUDA cases of the Hugging Face serving tests: its serving phase
selects cases that exist (one per path and pool kind), under a time limit, with its own log;
and it times the previous backward design against this one (tools/bwd_ab.sh)."""

from __future__ import annotations

import re

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "tools" / "gpu_check.sh").read_text()


def test_gpu_check_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_check.sh")], check=True)


def test_serving_phase_runs_the_cuda_cases():
    phase = SCRIPT[SCRIPT.index("run_phase serving"):]
    phase = phase[:phase.index("\n\n")]
    assert '"$OUT/serving.log"' in phase and '--junitxml="$OUT/serving.xml"' in phase
    assert "-k cuda" in phase and "tests/integrations/test_serving.py" in phase
    limit = int(phase.split()[2])
    assert limit <= 90, "the serving phase must stay short (the device session is 15 minutes)"
    # after the GPU test suite, before the benchmarks
    assert SCRIPT.index("run_phase tests") < SCRIPT.index("run_phase serving") < \
        SCRIPT.index("run_phase bench")
    # a skipped case is not a pass; a missing transformers is reported, not hidden
    assert "grep -q '<skipped' \"$OUT/serving.xml\"" in SCRIPT
    assert 'skip_phase serving "transformers is not installed' in SCRIPT


def test_serving_phase_selects_every_serving_path():
    """What ``-k cuda`` collects: both paths for every model family, the 8-bit and bf16
    pools, beam search and the float32 refusal (collected here, skipped without a GPU)."""
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-k", "cuda",
                          "-p", "no:cacheprovider", "tests/integrations/test_serving.py"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    ids = [line for line in out.splitlines() if "::" in line]
    assert all("cuda" in i for i in ids)
    for test, count in (("test_generate_batch_matches_reference", 5),
                        ("test_generate_on_paged_cache_matches_reference", 5),
                        ("test_8bit_paged_cache_token_agreement_and_logit_error", 2),
                        ("test_bf16_paged_cache_logits_within_tolerance", 1),
                        ("test_beam_search_on_paged_cache_on_cuda", 1),
                        ("test_float32_off_the_cpu_is_refused_naming_the_dtype", 1)):
        assert sum(f"::{test}[" in i or i.endswith(f"::{test}") for i in ids) == count, test


def test_runs_both_forward_kernels_and_both_sdpa_backends():
    # correctness first: the GPU cases in the kernel fmha picks (the Hopper forward on sm_90)
    # and again with the sm_80 forward forced, before any benchmark
    phase = SCRIPT[SCRIPT.index("run_phase tests-sm80"):]
    phase = phase[:phase.index("\n\n")]
    assert "FMHA_CUDA_KERNEL=sm80" in phase and "tests/kernels/test_cuda_gpu.py" in phase
    assert SCRIPT.index("run_phase tests ") < SCRIPT.index("run_phase tests-sm80") < \
        SCRIPT.index("run_phase bench")
    bench = SCRIPT[SCRIPT.index("run_phase bench"):]
    bench = bench[:bench.index("\n")] + bench[bench.index("\n"):].split("\n")[1]
    assert "--peers sm80,cudnn" in bench
    assert "--dtypes float16,bfloat16,float8_e4m3fn" in bench  # the e4m3 forward timed too
    # the whole script within its budget (the device session is 15 minutes): the phases' own
    # limits are capped by what is left of it
    assert 'BUDGET="${GPU_CHECK_BUDGET_S:-530}"' in SCRIPT
    assert int(re.search(r"run_phase tests-sm80 (\d+) ", SCRIPT).group(1)) <= 60
    assert int(re.search(r"run_phase bench (\d+) ", SCRIPT).group(1)) <= 180


def test_bwd_ab_phase_times_old_against_new():
    phase = SCRIPT[SCRIPT.index("run_phase bwd-ab"):]
    phase = phase[:phase.index("\n")]
    assert 'tools/bwd_ab.sh "$arch" "$OUT/bwd-ab"' in phase and '"$OUT/bwd-ab.log"' in phase
    assert int(phase.split()[2]) <= 150, "the device session is 15 minutes"
    assert SCRIPT.index("run_phase bench") < SCRIPT.index("run_phase bwd-ab")
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "bwd_ab.sh")], check=True)


def test_bwd_ab_default_old_revision_is_the_previous_design():
    """The default OLD_REV is the last commit before the backward's warp count per head dim:
    its kernel has 4 warps everywhere, the commit after it does not."""
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT,
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    old = subprocess.run([str(ROOT / "tools" / "bwd_ab.sh"), "--old-rev"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    show = lambda rev: subprocess.run(["git", "show", f"{rev}:csrc/cuda/flash_bwd.cuh"], cwd=ROOT,
                                      capture_output=True, text=True, check=True).stdout
    old_config = "static constexpr int kBlockN = 64;  // keys per CTA: 4 warps x 16"
    assert old_config in show(old) and "kWarps = !kExtras_" not in show(old)
    # The first later change to the kernel (other branches may have merged in between).
    child = subprocess.run(["git", "rev-list", "--ancestry-path", "--reverse", f"{old}..HEAD",
                            "--", "csrc/cuda/flash_bwd.cuh"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()[0]
    assert "static constexpr int kWarps = !kExtras_" in show(child)
    assert old_config not in show(child)


def test_gpu_check_phases_selects_what_runs(tmp_path):
    """GPU_CHECK_PHASES runs only the phases it names (the build and import always run) and
    records the others as not run, without failing the check for them."""
    body = SCRIPT[SCRIPT.index("run_phase() {"):]
    body = body[:body.index("\n}\n") + 3]
    probe = (f"{body}\nOUT={tmp_path}; BUDGET=100; T0=$(date +%s); failed=0\n"
             "run_phase tests 20 $OUT/t.log true; echo tests=$?\n"
             "run_phase bench 20 $OUT/b.log true; echo bench=$?\n"
             "run_phase build 20 $OUT/c.log true; echo build=$?\n"
             "echo failed=$failed\n")
    env = {"PATH": "/usr/bin:/bin", "GPU_CHECK_PHASES": "tests,decode"}
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "tests=0" in out and "bench=1" in out and "build=0" in out and "failed=0" in out
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"^bench\s+not run\s.*not in GPU_CHECK_PHASES", summary, re.M)
    assert re.search(r"^tests\s+ok", summary, re.M)
    env.pop("GPU_CHECK_PHASES")
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "bench=0" in out
