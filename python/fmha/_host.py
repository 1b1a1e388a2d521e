"""The host and versions a benchmark result file records (python -m fmha.bench, both modes),
and the timing helpers the benchmark modes share."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time


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


def host_meta(torch, fmha, module: str = "fmha.bench") -> dict:
    """The command (python -m <module> and its arguments), versions and host of a result
    file."""
    return dict(command=" ".join([os.path.basename(sys.executable), "-m", module] +
                                 sys.argv[1:]),
                fmha=fmha.__version__, torch=torch.__version__, cpu_isa=fmha.cpu_isa(),
                cpu_features=fmha.cpu_features(), threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(),
                cpu_model=cpu_model(), cpu=fmha._C.cpu_description(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"))


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
    print(f"wrote {path}")
