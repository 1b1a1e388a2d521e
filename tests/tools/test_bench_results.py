"""Where python -m fmha.bench puts a result: the host class named from the CPU (family, model,
AMX flags) or the GPU, the commit, and --save's results file, whose one section per mode a
new run of that mode replaces while the other sections stay. The default run is the short
suite and --full the standard one. Times are only checked to be positive."""

import json

import pytest

from fmha.bench import _host

torch = pytest.importorskip("torch")

from fmha.bench import cli, suite  # noqa: E402


def _cpuinfo(vendor, family, model, flags="fpu sse avx2"):
    return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: some cpu\nflags\t\t: {flags}\n\nprocessor\t: 1\nvendor_id\t: other\n")


@pytest.mark.parametrize("vendor, family, model, flags, expected", [
    ("AuthenticAMD", 25, 0x11, "", "zen4"),            # Genoa
    ("AuthenticAMD", 25, 0x61, "", "zen4"),            # Raphael
    ("AuthenticAMD", 25, 0xA0, "", "zen4"),            # Bergamo
    ("AuthenticAMD", 25, 0x01, "", "amd-family25-model1"),  # Zen 3 (Milan): no class of its own
    ("AuthenticAMD", 26, 2, "", "zen5"),
    ("GenuineIntel", 6, 106, "avx512f", "icelake"),
    ("GenuineIntel", 6, 108, "avx512f", "icelake"),
    ("GenuineIntel", 6, 143, "avx512f amx_tile", "sapphirerapids"),  # amx_bf16 missing
    ("GenuineIntel", 6, 143, "amx_bf16 avx512f amx_tile", "sapphirerapids-amx"),
    ("GenuineIntel", 6, 207, "amx_bf16 amx_tile", "emeraldrapids-amx"),
    ("GenuineIntel", 6, 173, "amx_bf16 amx_tile", "graniterapids-amx"),
    ("GenuineIntel", 6, 85, "avx512f", "intel-family6-model85"),  # Cascade Lake
])
def test_cpu_class(vendor, family, model, flags, expected):
    info = _host.cpu_id(_cpuinfo(vendor, family, model, flags))
    assert (info["vendor"], info["family"], info["model"]) == (vendor, family, model)
    assert _host.cpu_class(info) == expected


def test_gpu_class_and_override():
    assert _host.gpu_class("NVIDIA H200") == "h200"
    assert _host.gpu_class("NVIDIA H100 80GB HBM3") == "h100"
    assert _host.gpu_class("NVIDIA A100-SXM4-80GB") == "a100"
    assert _host.gpu_class("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert _host.host_class(gpu="NVIDIA H200") == "h200"
    assert _host.host_class("mine", gpu="NVIDIA H200") == "mine"
    assert _host.cpu_class({}).startswith("cpu-")  # no /proc/cpuinfo: still a name
    assert _host.host_class() == _host.cpu_class(_host.cpu_id())


def test_default_full_and_quick_runs(monkeypatch):
    seen = []
    monkeypatch.setattr(suite, "run", lambda cases, dtypes, passes, out, threads, flex, rounds,
                        save: seen.append((cases, dtypes, passes, rounds, save)))
    cli.main([])
    cli.main(["--full"])
    cli.main(["--quick"])
    (short, full, quick) = seen
    assert short[0] == suite.SHORT_SUITE and short[3] == suite.SHORT_ROUNDS
    assert set(suite.SHORT_SUITE) < set(suite.STANDARD_SUITE)
    assert short[1] == ["float32", "bfloat16"] and short[2] == ["fwd", "fwd+bwd"]
    assert full[0] == suite.STANDARD_SUITE and full[3] is None  # suite.ROUNDS
    assert quick[0] == suite.QUICK_SUITE
    assert short[4] is full[4] is quick[4] is None  # nothing saved without --save
    for bad in (["--full", "--quick"], ["--full", "--latency"], ["--latency", "--decode"]):
        with pytest.raises(SystemExit):
            cli.main(bad)


@pytest.fixture
def tiny_suite(monkeypatch):
    n = torch.get_num_threads()
    monkeypatch.setattr(suite, "QUICK_SUITE", [("tiny", 1, 2, 2, 32, 48, 16, False)])
    monkeypatch.setattr(suite, "ROUNDS", 2)
    monkeypatch.setattr(suite, "ROUND_SECONDS", 0.0)
    yield
    torch.set_num_threads(n)


def test_save_replaces_only_its_section(tmp_path, tiny_suite):
    base = ["--results-dir", str(tmp_path), "--host-class", "testhost", "--save"]
    cli.main(["--quick", "--no-flex", "--dtypes", "float32", "--passes", "fwd"] + base)
    path = tmp_path / "testhost.json"
    data = json.loads(path.read_text())
    assert data["host_class"] == "testhost" and list(data["suites"]) == ["suite-quick"]
    assert data["host"]["cpu_isa"] and data["host"]["cpu"]
    first = data["suites"]["suite-quick"]
    meta = first["meta"]
    assert meta["host_class"] == "testhost" and meta["commit"] and meta["date"]
    assert "--quick" in meta["command"] and meta["rounds"] == 2
    assert {r["dtype"] for r in first["rows"]} == {"float32"}
    assert all(r["median_s"] > 0 for r in first["rows"])

    # Another mode adds its section next to the first.
    cli.main(["--latency", "--cases", "decode-sk16", "--min-seconds", "0", "--min-calls", "1",
              "--batches", "5", "--threads", "2"] + base)
    data = json.loads(path.read_text())
    assert list(data["suites"]) == ["latency", "suite-quick"]
    assert data["suites"]["suite-quick"] == first
    assert {r["case"] for r in data["suites"]["latency"]["rows"]} == {"decode-sk16"}

    # A new run of the first mode replaces its section, and only it.
    cli.main(["--quick", "--no-flex", "--dtypes", "float32,bfloat16", "--passes", "fwd"] + base)
    again = json.loads(path.read_text())
    assert again["suites"]["latency"] == data["suites"]["latency"]
    assert {r["dtype"] for r in again["suites"]["suite-quick"]["rows"]} == {"float32",
                                                                            "bfloat16"}


def test_save_and_out_together(tmp_path, tiny_suite):
    out = tmp_path / "plain.json"
    cli.main(["--quick", "--no-flex", "--dtypes", "float32", "--passes", "fwd", "--out", str(out),
              "--save", "--results-dir", str(tmp_path / "results")])
    plain = json.loads(out.read_text())
    (saved,) = (tmp_path / "results").glob("*.json")
    assert saved.stem == _host.host_class()  # the detected class names the file
    assert json.loads(saved.read_text())["suites"]["suite-quick"] == plain
    assert (tmp_path / "plain.csv").exists()


def test_commit_names_the_checkout():
    c = _host.commit()
    assert c.startswith("fmha ") or c.split("-")[0].isalnum()
