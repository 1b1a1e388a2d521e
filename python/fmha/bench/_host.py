"""The host, versions and commit a benchmark result records (every mode of python -m
fmha.bench), the host class that names its results file (benchmarks/results/<class>.json),
and the timing helpers the modes share."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), so a result file names its host."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_id(cpuinfo: Optional[str] = None) -> dict:
    """vendor, family, model (integers) and flags of the first CPU in /proc/cpuinfo (or in the
    text given); empty where the file is missing (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as fh:
                cpuinfo = fh.read()
        except OSError:
            return {}
    info = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if info:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id":
            info["vendor"] = value
        elif key == "cpu family" and value.isdigit():
            info["family"] = int(value)
        elif key == "model" and value.isdigit():
            info["model"] = int(value)
        elif key == "flags":
            info["flags"] = value.split()
    return info


# Intel family 6 models by the server core they are: the results file of each.
_INTEL_MODELS = {106: "icelake", 108: "icelake", 143: "sapphirerapids", 207: "emeraldrapids",
                 173: "graniterapids"}
# AMD family 25 (0x19) models that are Zen 4 (Genoa, Storm Peak, Phoenix, Raphael, Bergamo):
# the other family 25 models are Zen 3.
_ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def cpu_class(info: dict) -> str:
    """The host class of a CPU (cpu_id's dict): zen4, zen5, icelake, sapphirerapids,
    emeraldrapids, graniterapids, with "-amx" where the CPU has AMX tiles and AMX bf16; for any
    other CPU a name made of its vendor, family and model, so that two hosts of different kinds
    never share a results file."""
    vendor, family, model = info.get("vendor"), info.get("family"), info.get("model")
    flags = set(info.get("flags", ()))
    name = None
    if vendor == "AuthenticAMD" and family == 25 and model is not None and any(
            model in r for r in _ZEN4_MODELS):
        name = "zen4"
    elif vendor == "AuthenticAMD" and family == 26:
        name = "zen5"
    elif vendor == "GenuineIntel" and family == 6 and model in _INTEL_MODELS:
        name = _INTEL_MODELS[model]
    if name is None:
        if vendor is None or family is None or model is None:
            return f"cpu-{platform.machine().lower() or 'unknown'}"
        short = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(
            vendor, re.sub(r"[^a-z0-9]+", "", vendor.lower()) or "cpu")
        name = f"{short}-family{family}-model{model}"
    if {"amx_bf16", "amx_tile"} <= flags:
        name += "-amx"
    return name


def gpu_class(gpu_name: str) -> str:
    """The host class of a GPU run, from the device name torch reports: "NVIDIA H200" -> h200,
    "NVIDIA A100-SXM4-80GB" -> a100, "NVIDIA GeForce RTX 4090" -> rtx-4090 (memory sizes,
    form factors and the vendor left out)."""
    words = re.split(r"[\s_-]+", gpu_name.lower())
    drop = re.compile(r"^(nvidia|tesla|geforce|quadro|\d+gb|sxm\d*|pcie|hbm\w*|nvl\d*|"
                      r"mig|\d+g\.\d+gb)$")
    kept = [re.sub(r"[^a-z0-9.]", "", w) for w in words if w and not drop.match(w)]
    kept = [w for w in kept if w]
    return "-".join(kept) or "gpu"


def host_class(override: Optional[str] = None, gpu: Optional[str] = None) -> str:
    """The name of this host's results file: the override where one is given, else the GPU's
    class for a GPU run, else the CPU's."""
    if override:
        return override
    if gpu:
        return gpu_class(gpu)
    return cpu_class(cpu_id())


def commit() -> str:
    """The commit a result was measured at: `git rev-parse --short HEAD` of the checkout that
    holds the imported fmha package or, failing that, of the working directory (with "-dirty"
    when tracked files differ from it); the package's version where neither is a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    for where in (here, os.getcwd()):
        try:
            top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=where,
                                 capture_output=True, text=True, timeout=10)
            if top.returncode != 0 or not os.path.isdir(
                    os.path.join(top.stdout.strip(), "python", "fmha")):
                continue
            root = top.stdout.strip()
            head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                  capture_output=True, text=True, timeout=10)
            if head.returncode != 0:
                continue
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=root, capture_output=True, text=True, timeout=30)
            return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
        except (OSError, subprocess.SubprocessError):
            continue
    from .. import __version__
    return f"fmha {__version__}"


_ARGS: Optional[list] = None  # the arguments of the command line being run (set_command)


def set_command(args) -> None:
    """Records the arguments python -m fmha.bench was given (its main's argv), for the
    results' meta.command, and starts counting the host's load (host_load) from here."""
    global _ARGS, _LOAD_START
    _ARGS = list(args)
    _LOAD_START = _cpu_counters()


# A run is flagged busy when other processes took more than this fraction of the host's CPU
# time (all its CPUs over the run's wall time): a benchmark of two threads on two cores then
# lost about that much of its cores to them.
BUSY_FRACTION = 0.10
# A per-round probe (the suite's peak, decode's read bandwidth) that moved by more than this
# fraction within one row ((max - min) / max) flags the row: the host's speed changed under
# it, and its per-round ratios are the numbers to trust, if any.
PROBE_SPREAD_LIMIT = 0.10


def _cpu_counters() -> Optional[dict]:
    """The clock, the host's busy CPU seconds (/proc/stat: user, nice, system, irq, softirq of
    all CPUs), the CPU seconds the hypervisor gave other guests (steal) and this process's own
    CPU seconds (its reaped children included); None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as fh:
            first = fh.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 8:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    j = [int(x) for x in first[1:]]
    busy = (j[0] + j[1] + j[2] + j[5] + j[6]) / tick
    steal = (j[7] if len(j) > 7 else 0) / tick
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return dict(wall=time.monotonic(), busy=busy, steal=steal, own=own)


_LOAD_START: Optional[dict] = _cpu_counters()


def loadavg() -> Optional[list]:
    """/proc/loadavg's 1, 5 and 15 minute load averages; None where it is missing."""
    try:
        with open("/proc/loadavg") as fh:
            return [float(x) for x in fh.read().split()[:3]]
    except (OSError, ValueError):
        return None


def host_load(start: Optional[dict] = None) -> dict:
    """How busy the host was since `start` (_cpu_counters(); default: since set_command or
    the import of this module): the load averages now, the CPU seconds other processes took
    (the host's busy time minus this process's and its reaped children's), that as a fraction
    of all CPUs over the wall time, the hypervisor's steal, and busy: whether the others'
    fraction exceeded BUSY_FRACTION."""
    start = start or _LOAD_START
    now = _cpu_counters()
    cpus = os.cpu_count() or 1
    out = dict(loadavg=loadavg(), cpus=cpus, busy_fraction_limit=BUSY_FRACTION)
    if start is None or now is None:
        return dict(out, other_cpu_s=None, other_fraction=None, steal_s=None, busy=None)
    wall = max(now["wall"] - start["wall"], 1e-9)
    other = max(0.0, (now["busy"] - start["busy"]) - (now["own"] - start["own"]))
    frac = other / (wall * cpus)
    return dict(out, wall_s=round(wall, 3), other_cpu_s=round(other, 3),
                other_fraction=round(frac, 4), steal_s=round(now["steal"] - start["steal"], 3),
                busy=frac > BUSY_FRACTION)


def host_load_line(load: dict) -> str:
    """A line for the end of a run: the host's load, and a warning when it was busy."""
    la = load.get("loadavg")
    text = "host load: " + ("load average " + " ".join(f"{x:.2f}" for x in la) if la
                            else "load average unknown")
    if load.get("other_cpu_s") is None:
        return text + "; other processes' CPU time unknown (no /proc/stat)"
    text += (f"; other processes took {load['other_cpu_s']:.1f} CPU s in {load['wall_s']:.1f} s "
             f"({100 * load['other_fraction']:.0f}% of {load['cpus']} CPUs)")
    if load.get("steal_s"):
        text += f", steal {load['steal_s']:.1f} s"
    if load["busy"]:
        text = (f"WARNING: the host was busy during this run: other processes took more than "
                f"{100 * BUSY_FRACTION:.0f}% of its CPU time; its timings are not a quiet "
                f"host's.\n" + text)
    return text


def probe_spread(values) -> Optional[float]:
    """(max - min) / max of a row's per-round probes; None for fewer than two."""
    vals = [v for v in values or () if v]
    if len(vals) < 2:
        return None
    return (max(vals) - min(vals)) / max(vals)


def command_line() -> str:
    """The command a result was produced by: python -m fmha.bench and its arguments (those
    given to its main; the process's own when a mode runs without it)."""
    args = _ARGS if _ARGS is not None else sys.argv[1:]
    return " ".join([os.path.basename(sys.executable), "-m", "fmha.bench"] + list(args))


def host_meta(torch, fmha, gpu: Optional[str] = None) -> dict:
    """The command, commit, versions and host of a result (gpu: the device name of a GPU
    run)."""
    meta = dict(command=command_line(), commit=commit(),
                fmha=fmha.__version__, torch=torch.__version__, cpu_isa=fmha.cpu_isa(),
                cpu_features=fmha.cpu_features(), threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(),
                cpu_model=cpu_model(), cpu=fmha._C.cpu_description(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"), host_load=host_load(),
                probe_spread_limit=PROBE_SPREAD_LIMIT)
    if gpu:
        meta["gpu"] = gpu
    return meta


def median_seconds(fn, reps: int, warmup: int = 1) -> float:
    """The median wall-clock time of `reps` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_seconds_on(fn, reps: int, device, warmup: int = 3) -> float:
    """Median seconds of fn on a torch device: CUDA events around each call on a GPU (after
    warm-up calls), wall-clock time on the CPU (median_seconds)."""
    import torch

    if device.type != "cuda":
        return median_seconds(fn, reps, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events) / 1e3


def timed_rounds(calls: dict, timer, probes: dict, rounds: int, may_fail=()) -> tuple:
    """The calls (name -> callable) timed in turn by timer(call) (seconds per call), `rounds`
    times over, each round opened by the probes (name -> callable returning a limit: GFLOP/s,
    GB/s) and starting one call further along the order, so that no call always runs first:
    a shared VM's speed drifts within seconds, and a ratio of two calls' times (or of a time
    to a probe) from the same round drifts on both sides alike. Each call first runs once
    untimed. Returns (times, errors, measured): per call its value in each round, per probe
    its value in each round, and the exception of each call named in may_fail that raised
    (it is then left out); any other call's exception propagates at once."""
    times, errors = {}, {}
    measured = {k: [] for k in probes}
    for name, fn in calls.items():  # warm-up: thread pools, allocations, first-touch
        try:
            fn()
            times[name] = []
        except Exception as e:  # noqa: BLE001 - recorded for the calls that may fail
            if name not in may_fail:
                raise
            errors[name] = e
    for r in range(rounds):
        for k, probe in probes.items():
            measured[k].append(probe())
        order = list(times)
        first = r % len(order) if order else 0
        for name in order[first:] + order[:first]:
            try:
                times[name].append(timer(calls[name]))
            except Exception as e:  # noqa: BLE001
                if name not in may_fail:
                    raise
                errors[name] = e
                del times[name]
    return times, errors, measured


def write_json(path: str, result: dict) -> None:
    """Writes a result file (creating its folder) and says where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")
    print(f"wrote {path}")


@dataclass
class Save:
    """Where --save puts a run: the section `mode` of <results_dir>/<host class>.json, the class
    detected (host_class) unless `host_class` overrides it."""
    results_dir: str
    mode: str
    host_class: Optional[str] = None


# The host description a results file keeps at its top, from its latest run's meta.
HOST_KEYS = ("cpu", "cpu_model", "cpu_isa", "cpu_features", "machine", "gpu", "capability",
             "sms", "torch_cuda")


def save_to_host_file(result: dict, save: Save) -> str:
    """Puts `result` (a mode's JSON: meta and rows) into its host's results file as the section
    save.mode, replacing that section and keeping the others; returns the file's path."""
    meta = result.get("meta", {})
    cls = host_class(save.host_class, meta.get("gpu"))
    meta["host_class"] = cls
    path = os.path.join(save.results_dir, f"{cls}.json")
    data = {}
    if os.path.exists(path):
        with open(path) as fh:
            data = json.load(fh)
    suites = dict(data.get("suites", {}))
    suites[save.mode] = result
    host = {k: meta[k] for k in HOST_KEYS if meta.get(k) is not None}
    data = dict(host_class=cls, host=host or data.get("host", {}),
                suites={k: suites[k] for k in sorted(suites)})
    write_json(path, data)
    return path


def results_dir() -> str:
    """benchmarks/results of the checkout the working directory is in (else of the working
    directory): where --save writes."""
    root = os.getcwd()
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode == 0 and os.path.isdir(os.path.join(top.stdout.strip(), "benchmarks")):
            root = top.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.join(root, "benchmarks", "results")


def add_output_arguments(ap) -> None:
    """--out, --save, --results-dir and --host-class: where a mode's result goes."""
    ap.add_argument("--out", default=None,
                    help="write the result to this JSON file (some modes write a .csv or .txt "
                         "beside it)")
    ap.add_argument("--save", action="store_true",
                    help="put the result into this host's results file, "
                         "benchmarks/results/<host class>.json, replacing this mode's section")
    ap.add_argument("--results-dir", default=None,
                    help="--save: the folder of the results files (default: benchmarks/results "
                         "of the checkout the working directory is in)")
    ap.add_argument("--host-class", default=None,
                    help="--save: the results file's name instead of the detected class "
                         "(zen4, zen5, icelake, sapphirerapids-amx, h200, ...)")


def save_of(args, mode: str) -> Optional[Save]:
    """The Save that --save, --results-dir and --host-class ask for (None without --save)."""
    if not args.save:
        return None
    return Save(args.results_dir or results_dir(), mode, args.host_class)


def write_result(result: dict, out_path: Optional[str], save: Optional[Save]) -> None:
    """A mode's result: to out_path as a plain file, and/or (save) into its host's results
    file."""
    if save is not None:
        save_to_host_file(result, save)
    if out_path:
        write_json(out_path, result)
