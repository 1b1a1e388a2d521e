"""python -m fmha.bench --sparse: block-sparse masks (fmha.BlockMask) against the same masks
given densely, against torch SDPA and against PyTorch FlexAttention, in one process.

Cases (b = 1, h = 8, d = 64, seqlen 8192; ``--quick``: h = 2, seqlen 1024), each one mask,
the same for every batch entry and head:

    document     8 equal documents, non-causal (fmha.document_mask)
    longformer   sliding window of 512 (|i - j| <= 256) + the first 16 tokens global
                 (fmha.longformer_mask)
    bigbird      window 384 (3 blocks of 128 wide: |i - j| <= 192) + the first 16 tokens
                 global + 3 random key blocks per query block, seed 0 (fmha.bigbird_mask)
    causal       causal as a BlockMask (fmha.block_mask.causal_mask) against causal=True

Columns, for float32 and bfloat16, forward (under no_grad) and forward+backward (autograd,
a fixed random dout; the gradients of q, k and v), all on the same inputs and threads:

    fmha_block   fmha.attention(q, k, v, block_mask=<the fmha BlockMask>)
    fmha_dense   fmha.attention(q, k, v, mask=<its to_dense(), a (1, 1, s, s) bool tensor>)
    sdpa_dense   torch SDPA, attn_mask=<the same dense bool mask>
    flex         torch.compile(flex_attention, dynamic=False, fullgraph=True) with the torch
                 BlockMask that torch's create_block_mask builds from this case's mask_mod
                 (block 128). fullgraph, and failing at the recompile limit, mean a Flex
                 cell is either the compiled kernel or an error, never the eager fallback
    fmha_causal  fmha.attention(q, k, v, causal=True)           (causal case only)
    sdpa_causal  torch SDPA, is_causal=True                      (causal case only)

q, k, v are (b, s, h, d) tensors (fmha's layout); SDPA and Flex get transposed (b, h, s, d)
views of them, as suite.py gives SDPA, and their outputs are transposed back. Each case's
mask_mod is written once with torch indices; fmha.create_block_mask(mask_mod,
backend="torch") must give exactly the element mask of the named fmha builder (recorded as
mask_mod_matches_builder), so Flex and fmha see the same mask.

Timing: per cell, one warm-up call (Flex: two; the first compiles, recorded as compile_s),
then timed calls until at least 3 and ``min_seconds`` (1 s; ``--quick`` 0.25 s, or 50 calls);
the median is reported. A cell whose warm-up call says 3 calls would exceed
``max_cell_seconds`` (120 s) is skipped, with the reason and the warm-up time recorded; a
call that raises (FlexAttention has no CPU backward in torch 2.13) records its error.

Checks, from the warm-up calls (so before any timed call of the cell): fmha_block's output
(and, forward+backward, dq, dk, dv) must be bitwise equal to fmha_dense's, and so must
fmha_causal's in the causal case; every other column's max |difference| from fmha_dense,
relative to max(max|fmha_dense|, 1), is recorded and held to 1e-4 (float32) / 5e-2
(bfloat16). A failed check is printed and recorded (``checks_ok`` false), not raised.

Work and speed: "useful" flops count only the mask's non-empty blocks, each at its
in-range size (edge blocks cut short): forward 4·b·h·pairs·d with pairs = the area of the
non-empty blocks, forward+backward 3.5× that (suite.py's convention: backward 2.5× the
forward). Every column's GFLOP/s uses that same count, so a dense-mask column's rate is the
useful rate it delivers. Also recorded: the allowed pairs exactly (mask.sum()), the block
counts (empty / full / partial) and the fraction of the fp32 FMA peak that fmha measures in
the same run (fmha._C.cpu_fma_peak_gflops, best of five, on the same threads). bfloat16 rates
are also given as a fraction of the fp32 FMA peak; the bf16 dot-product peak
(fmha._C.cpu_bf16_dot_peak_gflops, 0 without AVX512-BF16) is recorded beside it.

Ratios (times; > 1 means fmha_block is faster), with the targets they are judged against:
dense/block = t(fmha_dense) / t(fmha_block) (document: >= 5); block/causal =
t(fmha_block) / t(fmha_causal) (<= 1.10); flex/block = t(flex) / t(fmha_block) (>= 2 in
bfloat16, >= 1.5 in float32); sdpa/block = t(sdpa_dense) / t(fmha_block) (no target).

Writes a JSON file with everything (``--out``) and the printed report beside it (same stem,
.txt).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from ._flex import compiled_flex, dynamo_compiles_allowed

CASE_NAMES = ("document", "longformer", "bigbird", "causal")
COLUMNS = ("fmha_block", "fmha_dense", "sdpa_dense", "flex", "fmha_causal", "sdpa_causal")
CAUSAL_COLUMNS = ("fmha_causal", "sdpa_causal")
#: max|x - fmha_dense| / max(max|fmha_dense|, 1) allowed for the columns that are not fmha's.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
#: backward+forward flops over forward flops (bench.py: backward 2.5x the forward).
FWD_BWD_FLOP_FACTOR = 3.5


@dataclass(frozen=True)
class Config:
    """The sizes of one run: the shape, the mask block size and each case's parameters."""
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    block_size: int
    documents: int          # document: equal documents (seqlen a multiple of it)
    longformer_window: int  # longformer: total window width (|i - j| <= window // 2)
    bigbird_window: int     # bigbird: total window width
    global_tokens: int      # longformer and bigbird: the first n positions are global
    random_blocks: int      # bigbird: random key blocks per query block
    seed: int = 0           # bigbird's random blocks


FULL = Config(1, 8, 8192, 64, 128, 8, 512, 384, 16, 3)
QUICK = Config(1, 2, 1024, 64, 128, 8, 512, 384, 16, 3)
#: For the tests: seconds on any CPU.
TINY = Config(1, 2, 256, 32, 32, 4, 128, 96, 4, 2)


@dataclass
class Case:
    name: str
    description: str
    block_mask: object  # fmha.BlockMask
    mask_mod: object    # torch mask_mod(b, h, q_idx, kv_idx) of the same mask
    causal: bool = False


def build_cases(cfg: Config, names: Sequence[str]) -> List[Case]:
    """The fmha BlockMask (from the named builder) and the torch mask_mod of each case."""
    import numpy as np
    import torch

    import fmha
    from fmha.block_mask import causal_mask

    s, bs = cfg.seqlen, cfg.block_size
    unknown = [n for n in names if n not in CASE_NAMES]
    if unknown:
        raise ValueError(f"cases: unknown {unknown}; known: {', '.join(CASE_NAMES)}")
    glob = tuple(range(cfg.global_tokens))
    is_global = torch.zeros(s, dtype=torch.bool)
    is_global[:cfg.global_tokens] = True

    def window_mod(window):
        half = window // 2
        return lambda b, h, q, k: ((k >= q - half) & (k <= q + half)) | is_global[q] | \
            is_global[k]

    cases = []
    for name in names:
        if name == "document":
            if s % cfg.documents:
                raise ValueError(f"seqlen {s} is not a multiple of documents={cfg.documents}")
            ids = np.arange(s) // (s // cfg.documents)
            doc = torch.from_numpy(ids)
            cases.append(Case(name, f"{cfg.documents} equal documents of {s // cfg.documents} "
                              "tokens, non-causal", fmha.document_mask(ids, block_size=bs),
                              lambda b, h, q, k: doc[q] == doc[k]))
        elif name == "longformer":
            cases.append(Case(name, f"window {cfg.longformer_window} (|i-j| <= "
                              f"{cfg.longformer_window // 2}) + first {cfg.global_tokens} "
                              "tokens global",
                              fmha.longformer_mask(s, cfg.longformer_window, glob, bs),
                              window_mod(cfg.longformer_window)))
        elif name == "bigbird":
            # The random blocks drawn exactly as fmha.bigbird_mask draws them.
            nb = -(-s // bs)
            rng = np.random.default_rng(cfg.seed)
            drawn = np.zeros((nb, nb), dtype=bool)
            for qb in range(nb):
                drawn[qb, rng.choice(nb, min(cfg.random_blocks, nb), replace=False)] = True
            drawn_t = torch.from_numpy(drawn)
            win = window_mod(cfg.bigbird_window)
            cases.append(Case(name, f"window {cfg.bigbird_window} (|i-j| <= "
                              f"{cfg.bigbird_window // 2}) + first {cfg.global_tokens} tokens "
                              f"global + {cfg.random_blocks} random blocks/row, seed {cfg.seed}",
                              fmha.bigbird_mask(s, cfg.bigbird_window, glob, cfg.random_blocks,
                                                cfg.seed, bs),
                              lambda b, h, q, k: win(b, h, q, k) | drawn_t[q // bs, k // bs]))
        elif name == "causal":
            cases.append(Case(name, "causal (j <= i) as a BlockMask vs causal=True",
                              causal_mask(s, block_size=bs), lambda b, h, q, k: k <= q,
                              causal=True))
    return cases


def _mask_stats(cfg: Config, bm) -> dict:
    """Block counts, the in-range area of the non-empty blocks and the exact allowed pairs,
    per (batch, head) plane of the mask (it is broadcast over batch and heads)."""
    import numpy as np

    from fmha.block_mask import EMPTY
    (bq, bk), s = bm.block_size, cfg.seqlen
    nq, nk = bm.index.shape[2:]
    rows = np.minimum(bq, s - bq * np.arange(nq))
    cols = np.minimum(bk, s - bk * np.arange(nk))
    area = np.outer(rows, cols)
    nonempty = bm.index[0, 0] != EMPTY
    counts = bm.counts()
    dense = bm.to_dense()
    return dict(block_size=[bq, bk], counts=counts,
                nonempty_block_fraction=(counts["full"] + counts["partial"]) / counts["total"],
                stored_partial_masks=int(len(bm.partial)),
                nonempty_block_pairs=int(area[nonempty].sum()),
                allowed_pairs=int(dense[0, 0].sum()),
                allowed_fraction=float(dense[0, 0].mean())), dense


def _cell(step, min_seconds, max_cell_seconds, warmups=1, min_reps=3, max_reps=50) -> tuple:
    """Times step(): ``warmups`` untimed calls (the last one's result is returned for the
    checks), then calls until min_reps and min_seconds (or max_reps); median seconds. Skips
    when the last warm-up says min_reps calls exceed max_cell_seconds."""
    info: Dict[str, object] = {}
    result = None
    for i in range(warmups):
        t0 = time.perf_counter()
        result = step()
        secs = time.perf_counter() - t0
        if i == 0 and warmups > 1:
            info["compile_s"] = secs
    info["warmup_s"] = secs
    if secs * min_reps > max_cell_seconds:
        info["skipped"] = (f"one call took {secs:.1f} s: {min_reps} timed calls would exceed "
                           f"the cell budget of {max_cell_seconds:.0f} s")
        return info, result
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds
                                    and len(times) < max_reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    info.update(median_s=statistics.median(times), reps=len(times), min_s=min(times))
    return info, result


def _error_text(e: BaseException) -> tuple:
    """(one line, the full text up to 4000 characters) of an exception. Dynamo wraps what
    the traced code raised in a long message; its "Developer debug context" line says it."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = f"{type(e).__name__}: {lines[0] if lines else ''}"
    for ln in lines:
        if ln.startswith("Developer debug context:"):
            line += " (" + ln[len("Developer debug context:"):].strip() + ")"
            break
    return line, text[:4000]


def _diff(x, ref) -> tuple:
    """(max |x - ref|, that / max(max|ref|, 1)) in float64."""
    d = (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0
    return d, d / max(ref.double().abs().max().item() if ref.numel() else 0.0, 1.0)


def _fmt_ms(row) -> str:
    if row is None:
        return "—"
    if row.get("error"):
        return "error"
    if row.get("skipped"):
        return "skip"
    return f"{row['median_s'] * 1e3:.2f}"


def _ratio(t, key_num, key_den):
    a, b = t.get(key_num), t.get(key_den)
    return a / b if a and b else None


def run(dtypes: Sequence[str] = ("float32", "bfloat16"),
        passes: Sequence[str] = ("fwd", "fwd+bwd"), out_path: Optional[str] = None,
        threads: Optional[int] = None, quick: bool = False, cases: Optional[Sequence[str]] = None,
        min_seconds: Optional[float] = None, max_cell_seconds: float = 120.0,
        flex: bool = True, config: Optional[Config] = None, save=None) -> dict:
    """Runs the benchmark and returns (and with out_path writes; with save, a _host.Save, puts
    into the host's results file) the result dict. config overrides the sizes (FULL, or QUICK
    with quick=True); flex=False records the Flex column as skipped instead of compiling it."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import fmha

    from ._host import host_meta, write_json, write_result

    cfg = config or (QUICK if quick else FULL)
    if min_seconds is None:
        min_seconds = 0.25 if quick or config is not None else 1.0
    for p in passes:
        if p not in ("fwd", "fwd+bwd"):
            raise ValueError(f"passes: expected fwd and/or fwd+bwd, got {p!r}")
    if threads:
        torch.set_num_threads(threads)
    nthreads = torch.get_num_threads()
    fmha.set_num_threads(nthreads)
    peak = fmha._C.cpu_fma_peak_gflops(nthreads)
    head = (f"fmha {fmha.__version__} | CPU ISA {fmha.cpu_isa()} | threads {nthreads} | "
            f"torch {torch.__version__} | measured fp32 FMA peak {peak:.1f} GFLOP/s")
    print(head, flush=True)

    flex_fn = flex_create = flex_error = None
    if flex:
        flex_fn, flex_create, flex_error = compiled_flex(torch)  # an error: in every Flex cell

    b, h, s, d = cfg.batch, cfg.heads, cfg.seqlen, cfg.head_dim
    case_list = build_cases(cfg, list(cases or CASE_NAMES))
    case_info, rows, ratios, targets = [], [], [], []
    t_ = lambda x: x.transpose(1, 2)  # noqa: E731  (b, s, h, d) <-> (b, h, s, d) views

    # Each case's mask_mod is a new function to dynamo: allow a compile per case and dtype,
    # and fail rather than fall back to eager (unfused, ~10-100x slower) past the limit.
    patch = dynamo_compiles_allowed(torch) if flex_fn is not None else None
    if patch is not None:
        patch.__enter__()
    try:
        for case in case_list:
            t0 = time.perf_counter()
            stats, dense_np = _mask_stats(cfg, case.block_mask)
            dense = torch.from_numpy(dense_np)  # (1, 1, s, s) bool
            same = fmha.create_block_mask(case.mask_mod, None, None, s, s, cfg.block_size,
                                          backend="torch")
            info = dict(name=case.name, description=case.description, batch=b, heads=h,
                        seqlen=s, head_dim=d, **stats,
                        mask_mod_matches_builder=bool(np.array_equal(same.to_dense(),
                                                                     dense_np)))
            flex_bm, flex_bm_error = None, flex_error
            if flex_fn is not None:
                try:
                    flex_bm = flex_create(case.mask_mod, None, None, s, s, device="cpu",
                                          BLOCK_SIZE=cfg.block_size)
                    info["flex_block_sparsity"] = float(flex_bm.sparsity()) / 100
                except Exception as e:  # noqa: BLE001
                    flex_bm_error = f"{type(e).__name__}: {e}"
            info["setup_s"] = time.perf_counter() - t0
            if not info["mask_mod_matches_builder"]:
                print(f"CHECK FAILED: {case.name}: the torch mask_mod differs from the fmha "
                      "builder's mask", flush=True)
            case_info.append(info)
            print(f"{case.name}: {case.description}; blocks {stats['counts']} "
                  f"(non-empty {stats['nonempty_block_fraction']:.3f}), allowed pairs "
                  f"{stats['allowed_fraction']:.3f}", flush=True)
            fwd_flops = 4.0 * b * h * stats["nonempty_block_pairs"] * d
            bm = case.block_mask

            impls = {
                "fmha_block": lambda q, k, v: fmha.attention(q, k, v, block_mask=bm),
                "fmha_dense": lambda q, k, v: fmha.attention(q, k, v, mask=dense),
                "sdpa_dense": lambda q, k, v: t_(F.scaled_dot_product_attention(
                    t_(q), t_(k), t_(v), attn_mask=dense)),
                "flex": (lambda q, k, v: t_(flex_fn(t_(q), t_(k), t_(v), block_mask=flex_bm)))
                if flex_bm is not None else None,
            }
            if case.causal:
                impls["fmha_causal"] = lambda q, k, v: fmha.attention(q, k, v, causal=True)
                impls["sdpa_causal"] = lambda q, k, v: t_(F.scaled_dot_product_attention(
                    t_(q), t_(k), t_(v), is_causal=True))

            for dtype_name in dtypes:
                dtype = getattr(torch, dtype_name)
                g = torch.Generator().manual_seed(0)
                q, k, v, dout = (torch.randn(b, s, h, d, generator=g).to(dtype)
                                 for _ in range(4))
                for pass_ in passes:
                    print(f"  {case.name} {dtype_name} {pass_}:", end="", flush=True)
                    flops = fwd_flops * (FWD_BWD_FLOP_FACTOR if pass_ == "fwd+bwd" else 1.0)
                    results, cell_rows = {}, {}
                    for impl, fn in impls.items():
                        row = dict(case=case.name, dtype=dtype_name, pass_=pass_, impl=impl,
                                   median_s=None, error=None, skipped=None)
                        if fn is None:
                            if flex_bm_error:
                                row["error"] = flex_bm_error
                            else:
                                row["skipped"] = "FlexAttention not run (flex=False)"
                        else:
                            if pass_ == "fwd":
                                def step(fn=fn):
                                    with torch.no_grad():
                                        return fn(q, k, v), ()
                            else:
                                leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

                                def step(fn=fn, leaves=leaves):
                                    for x in leaves:
                                        x.grad = None
                                    o = fn(*leaves)
                                    o.backward(dout)
                                    return o.detach(), tuple(x.grad for x in leaves)
                            try:
                                info_, res = _cell(step, min_seconds, max_cell_seconds,
                                                   warmups=2 if impl == "flex" else 1)
                                row.update(info_)
                                results[impl] = res
                            except Exception as e:  # noqa: BLE001 - recorded, run goes on
                                row["error"], row["error_detail"] = _error_text(e)
                                if impl == "flex":
                                    # Without fullgraph, dynamo would run flex_attention
                                    # eagerly from now on (it skips a frame that raised);
                                    # start afresh so no later Flex cell can time that.
                                    torch._dynamo.reset()
                        if row["median_s"]:
                            row["ms"] = row["median_s"] * 1e3
                            row["gflops_useful"] = flops / row["median_s"] / 1e9
                            row["fraction_of_fp32_peak"] = row["gflops_useful"] / peak
                        cell_rows[impl] = row
                        print(f" {impl} {_fmt_ms(row)}", end="", flush=True)
                    print(flush=True)

                    # Checks against fmha_dense (from the warm-up calls).
                    ref = results.get("fmha_dense")
                    checks_ok = True
                    for impl, row in cell_rows.items():
                        if impl == "fmha_dense" or ref is None or impl not in results:
                            continue
                        got = results[impl]
                        tensors = [(got[0], ref[0])] + list(zip(got[1], ref[1]))
                        if impl in ("fmha_block", "fmha_causal"):
                            row["bitwise_equal_to_fmha_dense"] = all(
                                torch.equal(x, y) for x, y in tensors)
                            ok = row["bitwise_equal_to_fmha_dense"]
                        else:
                            diffs = [_diff(x, y) for x, y in tensors]
                            row["max_abs_diff_vs_fmha_dense"] = max(x[0] for x in diffs)
                            row["max_rel_diff_vs_fmha_dense"] = max(x[1] for x in diffs)
                            row["tolerance"] = TOLERANCE.get(dtype_name, 5e-2)
                            ok = row["max_rel_diff_vs_fmha_dense"] <= row["tolerance"]
                            row["within_tolerance"] = ok
                        if not ok:
                            checks_ok = False
                            print(f"  CHECK FAILED: {case.name} {dtype_name} {pass_} {impl} vs "
                                  "fmha_dense", flush=True)
                    rows.extend(cell_rows.values())

                    t = {i: r["median_s"] for i, r in cell_rows.items() if r["median_s"]}
                    rat = dict(case=case.name, dtype=dtype_name, pass_=pass_,
                               checks_ok=checks_ok and info["mask_mod_matches_builder"],
                               dense_over_block=_ratio(t, "fmha_dense", "fmha_block"),
                               sdpa_over_block=_ratio(t, "sdpa_dense", "fmha_block"),
                               flex_over_block=_ratio(t, "flex", "fmha_block"))
                    if case.causal:
                        rat["block_over_causal"] = _ratio(t, "fmha_block", "fmha_causal")
                        rat["sdpa_causal_over_block"] = _ratio(t, "sdpa_causal", "fmha_block")
                    ratios.append(rat)
                    key = dict(case=case.name, dtype=dtype_name, pass_=pass_)
                    if case.name == "document":
                        targets.append(dict(key, what="dense/block", target=">= 5",
                                            value=rat["dense_over_block"]))
                    if case.causal:
                        targets.append(dict(key, what="block/causal", target="<= 1.10",
                                            value=rat["block_over_causal"]))
                    targets.append(dict(key, what="flex/block",
                                        target=">= 2" if dtype_name == "bfloat16" else ">= 1.5",
                                        value=rat["flex_over_block"]))
    finally:
        if patch is not None:
            patch.__exit__(None, None, None)

    for tg in targets:
        v, (op, bound) = tg["value"], tg["target"].split()
        tg["met"] = None if v is None else (v >= float(bound) if op == ">=" else
                                            v <= float(bound))
    meta = host_meta(torch, fmha)
    meta.update(fmha_threads=nthreads, fp32_fma_peak_gflops=peak,
                bf16_peak_gflops=fmha._C.cpu_bf16_dot_peak_gflops(nthreads) or None,
                bf16_peak_note="bf16 rates are given as a fraction of the fp32 FMA peak")
    result = dict(
        meta=meta, config=asdict(cfg), min_seconds=min_seconds,
        max_cell_seconds=max_cell_seconds, flex=flex,
        flops=("useful = non-empty blocks only (in-range area): fwd 4*b*h*pairs*d, "
               f"fwd+bwd {FWD_BWD_FLOP_FACTOR}x fwd"),
        ratios_meaning=dict(dense_over_block="t(fmha_dense) / t(fmha_block)",
                            sdpa_over_block="t(sdpa_dense) / t(fmha_block)",
                            flex_over_block="t(flex) / t(fmha_block)",
                            block_over_causal="t(fmha_block) / t(fmha_causal)",
                            sdpa_causal_over_block="t(sdpa_causal) / t(fmha_block)"),
        cases=case_info,
        rows=[{("pass" if k_ == "pass_" else k_): v_ for k_, v_ in r.items()} for r in rows],
        ratios=[{("pass" if k_ == "pass_" else k_): v_ for k_, v_ in r.items()} for r in ratios],
        targets=[{("pass" if k_ == "pass_" else k_): v_ for k_, v_ in r.items()}
                 for r in targets])
    report = _report(head, result)
    print("\n" + report, flush=True)
    write_result(result, None, save)
    if out_path:
        write_json(out_path, result)
        txt = os.path.splitext(out_path)[0] + ".txt"
        with open(txt, "w") as fh:
            fh.write(report + "\n")
        print(f"wrote {txt}")
    return result


def _report(head: str, result: dict) -> str:
    """The plain-text report: cases, the table, notes on skipped/failed cells, targets."""
    f2 = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [head, f"command: {result['meta']['command']}", "",
             "cases (one mask per case, broadcast over batch and heads):"]
    for c in result["cases"]:
        cn = c["counts"]
        lines.append(f"  {c['name']:10s} {c['description']}: blocks {c['block_size'][0]}x"
                     f"{c['block_size'][1]}: {cn['empty']} empty / {cn['full']} full / "
                     f"{cn['partial']} partial of {cn['total']} (non-empty "
                     f"{c['nonempty_block_fraction']:.3f}; allowed pairs "
                     f"{c['allowed_fraction']:.3f}); mask_mod = builder: "
                     f"{c['mask_mod_matches_builder']}")
    cfg = result["config"]
    lines += ["", f"b={cfg['batch']} h={cfg['heads']} s={cfg['seqlen']} d={cfg['head_dim']}; "
              "ms = median per call; GFLOP/s and % of the fp32 FMA peak count only the "
              "non-empty blocks' flops (fwd+bwd 3.5x fwd); ratios are times (> 1: "
              "fmha_block faster, except block/causal: < 1 is faster)", "",
              "| case | dtype | pass | fmha block ms | fmha dense ms | SDPA dense ms | Flex ms | "
              "fmha causal=True ms | SDPA is_causal ms | dense/block | block/causal | "
              "Flex/block | SDPA/block | block GFLOP/s | % fp32 peak | checks |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    notes: Dict[tuple, List[str]] = {}  # (impl, error/skipped, why) -> cells
    for rat in result["ratios"]:
        key = (rat["case"], rat["dtype"], rat["pass"])
        by = {r["impl"]: r for r in result["rows"]
              if (r["case"], r["dtype"], r["pass"]) == key}
        for r in by.values():
            why = r.get("error") or r.get("skipped")
            if why:
                notes.setdefault((r["impl"], "error" if r.get("error") else "skipped", why),
                                 []).append(" ".join(key))
        blk = by.get("fmha_block", {})
        gf = f"{blk['gflops_useful']:.1f}" if blk.get("gflops_useful") else "—"
        pk = (f"{100 * blk['fraction_of_fp32_peak']:.0f}%"
              if blk.get("fraction_of_fp32_peak") else "—")
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | " +
            " | ".join(_fmt_ms(by.get(c)) for c in COLUMNS) +
            f" | {f2(rat['dense_over_block'])} | {f2(rat.get('block_over_causal'))} | "
            f"{f2(rat['flex_over_block'])} | {f2(rat['sdpa_over_block'])} | {gf} | {pk} | "
            f"{'ok' if rat['checks_ok'] else 'FAILED'} |")
    lines += ["", "checks: fmha_block (and fmha_causal) bitwise equal to fmha_dense (output "
              "and, fwd+bwd, dq/dk/dv); SDPA and Flex within tolerance of fmha_dense:"]
    for r in result["rows"]:
        if "bitwise_equal_to_fmha_dense" in r or "max_rel_diff_vs_fmha_dense" in r:
            what = (f"bitwise equal {r['bitwise_equal_to_fmha_dense']}"
                    if "bitwise_equal_to_fmha_dense" in r else
                    f"max |diff| {r['max_abs_diff_vs_fmha_dense']:.2e} (rel "
                    f"{r['max_rel_diff_vs_fmha_dense']:.2e}, tol {r['tolerance']:.0e})")
            lines.append(f"  {r['case']} {r['dtype']} {r['pass']} {r['impl']}: {what}")
    compiles = [f"{r['case']} {r['dtype']} {r['compile_s']:.1f}" for r in result["rows"]
                if r["impl"] == "flex" and r.get("compile_s") is not None]
    if compiles:
        lines += ["", "Flex first call (compiles), seconds: " + ", ".join(compiles)]
    if notes:
        lines += ["", "cells not timed:"]
        for (impl, kind, why), cells in notes.items():
            lines.append(f"  {impl} {kind} ({len(cells)} cells: {', '.join(cells)}): {why}")
    lines += ["", "targets:"]
    for tg in result["targets"]:
        met = {True: "met", False: "NOT met", None: "not measured"}[tg["met"]]
        lines.append(f"  {tg['case']} {tg['dtype']} {tg['pass']} {tg['what']} "
                     f"{f2(tg['value'])} (target {tg['target']}): {met}")
    return "\n".join(lines)
