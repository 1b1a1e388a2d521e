"""tools/sass_report.py's loop analysis on planted SASS: the main loop is the one with the most
HMMA, and its common path takes the products and the prefetch but skips optional regions (the
numbers of docs/cuda_kernels.md come from this path)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import sass_report as sr  # noqa: E402


def _sass(lines):
    body = "\n".join(f"        /*{addr:04x}*/    {text} ;   /* 0x0 */" for addr, text in lines)
    return "\t\tFunction : planted_kernel\n" + body + "\n"


# 0x00 setup; 0x10-0x90 the main loop: a vote branch over a rare region (0x30-0x40), an HMMA
# block, a prefetch guarded by a branch (0x60 LDGSTS), a second HMMA block, the back edge; a
# small HMMA-free inner loop (0x70) on the path; 0xa0 exit.
PLANTED = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "S2R R0, SR_TID.X"),
    (0x20, "@P0 BRA 0x50"),           # common case: skip the rare block
    (0x30, "LDS.128 R4, [R2]"),       # rare block
    (0x40, "STS [R2], RZ"),
    (0x50, "HMMA.16816.F32 R8, R4, R6, R8"),
    (0x58, "@!P1 BRA 0x68"),          # the prefetch of the next block, taken in steady state
    (0x60, "LDGSTS.E.128 [R3], [R10.64]"),
    (0x68, "IADD3 R11, R11, 0x1, RZ"),
    (0x70, "ISETP.GE.AND P2, PT, R11, 0x4, PT"),
    (0x78, "@!P2 BRA 0x68"),          # inner loop without HMMA: counted once
    (0x80, "HMMA.16816.F32 R12, R4, R6, R12"),
    (0x88, "BAR.SYNC.DEFER_BLOCKING 0x0"),
    (0x90, "@P3 BRA 0x10"),           # back edge of the main loop
    (0xa0, "EXIT"),
]


def test_main_loop_and_common_path():
    funcs = sr.parse(_sass(PLANTED))
    loop = sr.main_loop(sr.blocks_of(funcs["planted_kernel"]))
    assert loop is not None and loop.header == 0x10 and loop.back_edge == 0x90
    addrs = [i.addr for b in loop.path for i in b.instrs]
    assert 0x30 not in addrs and 0x40 not in addrs        # the rare block is skipped
    assert 0x60 in addrs                                  # the prefetch is taken
    assert loop.path_count("HMMA") == 2 and loop.path_count("LDGSTS") == 1
    assert loop.body == 13                                # 0x10-0x90
    assert loop.path_count() == 11                        # all but 0x30 and 0x40


def test_also_takes_the_optional_region():
    funcs = sr.parse(_sass(PLANTED))
    loop = sr.main_loop(sr.blocks_of(funcs["planted_kernel"]), also=("LDS.128",))
    assert loop.path_count("LDS") == 1 and loop.path_count() == 13
    assert any(i.op == "LDS.128" for b in loop.path for i in b.instrs)


def test_natural_loops_agree_with_the_address_range_on_a_structured_loop():
    funcs = sr.parse(_sass(PLANTED))
    blocks = sr.blocks_of(funcs["planted_kernel"])
    a, b = sr.main_loop(blocks), sr.main_loop(blocks, natural=True)
    assert (b.header, b.back_edge) == (a.header, a.back_edge)
    assert [x.start for x in b.path] == [x.start for x in a.path]


# A loop whose conditional prefetch block nvcc placed above its head (flash-attn's forward):
# the head (0x40) branches up to it (0x20), which rejoins the body at 0x50.
PREFETCH_ABOVE = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "BRA 0x40"),
    (0x20, "LDGSTS.E.128 [R3], [R10.64]"),
    (0x30, "BRA 0x50"),
    (0x40, "HMMA.16816.F32 R8, R4, R6, R8"),
    (0x48, "@P0 BRA 0x20"),
    (0x50, "HMMA.16816.F32 R12, R4, R6, R12"),
    (0x58, "@P1 BRA 0x40"),
    (0x60, "EXIT"),
]


def test_natural_loop_takes_a_block_placed_above_its_head():
    blocks = sr.blocks_of(sr.parse(_sass(PREFETCH_ABOVE))["planted_kernel"])
    loop = sr.main_loop(blocks, natural=True)
    assert loop.header == 0x40 and loop.back_edge == 0x58
    assert loop.path_count("LDGSTS") == 1 and loop.path_count("HMMA") == 2
    assert loop.path_count() == 6
    # The address-range finder sees only 0x40-0x58 and misses the prefetch.
    assert sr.main_loop(blocks).path_count("LDGSTS") == 0


# The main backward's shape: a pass (0x10-0x70) whose dQ work units run as an inner loop with
# HMMA (0x30-0x48), and an HMMA-free inner loop (0x50-0x58) beside it.
INNER_HMMA = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "HMMA.16816.F32 R8, R4, R6, R8"),
    (0x20, "BAR.SYNC.DEFER_BLOCKING 0x0"),
    (0x30, "HMMA.16816.F32 R12, R4, R6, R12"),
    (0x38, "RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R2.64], R12"),
    (0x40, "IADD3 R11, R11, 0x4, RZ"),
    (0x48, "@P2 BRA 0x30"),           # the next work unit of this warp
    (0x50, "IADD3 R13, R13, 0x1, RZ"),
    (0x58, "@P4 BRA 0x50"),           # no HMMA: one trip whatever --inner-trips says
    (0x60, "BAR.SYNC.DEFER_BLOCKING 0x0"),
    (0x70, "@P3 BRA 0x10"),
    (0x80, "EXIT"),
]


def test_inner_trip_is_the_inner_loop_with_hmma_on_the_path():
    blocks = sr.blocks_of(sr.parse(_sass(INNER_HMMA))["planted_kernel"])
    loop = sr.main_loop(blocks)
    assert loop.header == 0x10 and loop.path_count("HMMA") == 2 and loop.path_count() == 10
    trip = sr.inner_trip(blocks, loop)
    assert [i.addr for b in trip for i in b.instrs] == [0x30, 0x38, 0x40, 0x48]
    assert sum(b.count("HMMA") for b in trip) == 1 and sum(b.count("RED") for b in trip) == 1
    # Four trips of it: three more of its 4 instructions, HMMA and RED.
    counts = sr.pass_counts(blocks, loop, inner_trips=4)
    assert counts["path"] == 10 + 3 * 4 and counts["HMMA"] == 2 + 3 and counts["LDSM"] == 0
    assert sr.pass_counts(blocks, loop)["path"] == 10
    # PLANTED's only inner loop has no HMMA: nothing to repeat.
    planted = sr.blocks_of(sr.parse(_sass(PLANTED))["planted_kernel"])
    assert sr.inner_trip(planted, sr.main_loop(planted)) == []


# The launch-shape table: a kernel's config read from its mangled name, and the CTAs per SM
# its threads, registers and shared memory allow.
def test_config_of_mangled_kernel_names():
    fwd = ("_ZN4fmha3gpu16flash_fwd_kernelI6__halfNS0_14FlashFwdConfigILi128ELb0EEELb0EEEvNS_"
           "9FwdParamsENS0_9FwdLaunchE")
    dq = ("_ZN4fmha3gpu19flash_bwd_dq_kernelI13__nv_bfloat16NS0_16FlashBwdDqConfigILi64EEELb1EEE"
          "vNS_9BwdParamsENS0_7BwdWorkEb")
    assert sr.config_of(fwd) == "FlashFwdConfig<128, false>"
    assert sr.config_of(dq) == "FlashBwdDqConfig<64>"
    assert sr.config_of("_Z6kernelv") is None


def test_ctas_per_sm_limits():
    # 81 KiB + 1 KiB reserved, twice, is exactly an sm_80 SM's 164 KiB; 85 KiB fits once.
    assert sr.ctas_per_sm("80", 248, 128, 82944) == (2, "regs+smem")
    assert sr.ctas_per_sm("80", 246, 128, 87040) == (1, "smem")
    assert sr.ctas_per_sm("90", 246, 128, 87040) == (2, "regs+smem")  # 228 KiB
    assert sr.ctas_per_sm("80", 128, 128, 0) == (4, "regs")


def test_shared_memory_bytes_per_instruction():
    """What a warp moves through shared memory, per instruction: ldmatrix by its matrix count,
    LDS/STS/LDGSTS by their width per lane; placeholders that never execute and other opcodes
    move nothing. The smem bytes/HMMA column of docs/cuda_kernels.md sums these on the path."""
    ins = sr.parse(_sass([
        (0x00, "LDSM.16.M88.4 R4, [R2]"),
        (0x10, "LDSM.16.MT88.2 R8, [R2+0x100]"),
        (0x20, "LDSM.16.M88 R9, [R2]"),
        (0x30, "LDS.64 R10, [R3]"),
        (0x40, "LDS R12, [R3]"),
        (0x50, "STS.128 [R3], R4"),
        (0x60, "STS.U16 [R3], R4"),
        (0x70, "LDGSTS.E.BYPASS.LTC128B.128 [R3], [R10.64]"),
        (0x80, "@!PT LDS RZ, [RZ]"),
        (0x90, "HMMA.16816.F32 R8, R4, R6, R8"),
        (0xa0, "LDG.E.128 R4, [R10.64]"),
    ]))["planted_kernel"]
    assert [sr.smem_bytes(i) for i in ins] == [512, 256, 128, 256, 128, 512, 64, 512, 0, 0, 0]
    blocks = sr.blocks_of(sr.parse(_sass(PLANTED))["planted_kernel"])
    loop = sr.main_loop(blocks)
    # the path: the prefetch's 16-byte LDGSTS; the rare block's LDS.128 and STS are skipped
    assert sr.pass_counts(blocks, loop)["smem_bytes"] == 512


def test_convergence_branches_and_loop_exit_calls_fall_through():
    """BRA.DIV (to the slow path when the warp has diverged), a predicate operand (`BRA P0,
    target`) and a guarded CALL.REL.NOINC (ptxas's exit from a loop holding warp-synchronous
    instructions) may all fall through; a plain BRA does not, and an unguarded CALL (which
    returns) does not end its block."""
    funcs = sr.parse(_sass([
        (0x00, "BRA.DIV ~URZ, 0x60"),
        (0x10, "SHFL.BFLY PT, R1, R0, 0x10, 0x1f"),
        (0x20, "BRA P0, 0x40"),
        (0x30, "CALL.REL.NOINC 0x70"),
        (0x38, "@P1 CALL.REL.NOINC 0x50"),
        (0x40, "BRA 0x00"),
        (0x50, "EXIT"),
        (0x60, "BRA 0x10"),
        (0x70, "RET.REL.NODEC R16 0x0"),
    ]))
    succ = {b.start: b.succ for b in sr.blocks_of(funcs["planted_kernel"])}
    assert sorted(succ[0x00]) == [0x10, 0x60]
    assert sorted(succ[0x10]) == [0x30, 0x40]   # 0x10-0x20 holds the SHFL and `BRA P0`
    assert sorted(succ[0x30]) == [0x40, 0x50]   # the unguarded CALL stays inside the block
    assert succ[0x40] == [0x00]


# A decode kernel's key loop (rows = 2, d = 2: each product is 4 FFMA a lane): a branch past the
# products (a lane without a key), a vector K load beside its scalar fallback, q K^T, a rare
# soft-cap region with FFMA of its own, the softmax, and the P V loop of 2 FFMA a trip.
DECODE = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "IADD3 R20, R20, 0x20, RZ"),    # the key loop's head
    (0x18, "@P4 BRA 0xa0"),                 # no key: past the products
    (0x20, "@P0 BRA 0x50"),
    (0x30, "LDG.E.U16 R4, [R2.64]"),        # the scalar fallback
    (0x38, "LDG.E.U16 R5, [R2.64+0x2]"),
    (0x40, "BRA 0x58"),
    (0x50, "LDG.E.128 R4, [R2.64]"),        # the vector load
    (0x58, "FFMA R8, R4, R12, R8"),
    (0x60, "FFMA R8, R5, R13, R8"),
    (0x68, "FFMA R9, R4, R14, R9"),
    (0x70, "FFMA R9, R5, R15, R9"),
    (0x78, "@P1 BRA 0xa0"),                 # no soft cap
    (0x80, "FFMA R8, R8, R16, RZ"),
    (0x88, "FFMA R9, R9, R16, RZ"),
    (0x90, "MUFU.TANH R8, R8"),
    (0xa0, "MUFU.EX2 R10, R8"),
    (0xa8, "IADD3 R21, R21, 0x1, RZ"),      # the P V loop
    (0xb0, "LDG.E.64 R6, [R22.64]"),
    (0xb8, "FFMA R30, R10, R6, R30"),
    (0xc0, "FFMA R31, R10, R7, R31"),
    (0xc8, "@P2 BRA 0xa8"),
    (0xd0, "@P3 BRA 0x10"),                 # the key loop's back edge
    (0xe0, "EXIT"),
]


def test_decode_pass_takes_both_products_in_the_fewest_instructions():
    funcs = sr.parse(_sass(DECODE))
    got = sr.decode_pass(sr.blocks_of(funcs["planted_kernel"]), d=2, rows=2)
    # head 0x10-0x18, 0x20, the vector load, q K^T and its branch (5), the softmax, two P V
    # trips of 5, the back edge
    assert got["path"] == 2 + 1 + 1 + 5 + 1 + 2 * 5 + 1
    assert got["loops"] == [(2, 5)]
    assert got["FFMA"] == 8 and got["LDG"] == 3 and got["MUFU"] == 1
    assert got["ldg_bytes"] == 32 * (16 + 2 * 8)


# The plain call's passes. A loop (0x10-0xe0) with: a warp-dependent branch (warp 0 alone, tid
# < 32, loads a row: 0x40-0x50), a vote-guarded rescale (0x90-0xa8: taken when the warp's vote
# of a float compare fires), a data branch over a rare block (0xc0, on a value loaded from
# shared memory), and a bounds test on a call-wide value (0x60: a block past the sequence's
# end skips the 0x70 load, which a full block runs).
PLAIN = [
    (0x00, "S2R R0, SR_TID.X"),
    (0x08, "MOV R9, c[0x0][0x160]"),
    (0x10, "HMMA.16816.F32 R8, R4, R6, R8"),
    (0x18, "ISETP.GT.AND P0, PT, R0, 0x1f, PT"),
    (0x20, "@P0 BRA 0x58"),                      # warp 0 only: 0x40-0x50
    (0x40, "LDG.E R12, [R2.64]"),
    (0x48, "STS [R3], R12"),
    (0x50, "IADD3 R13, R13, 0x1, RZ"),
    (0x58, "ISETP.GE.AND P1, PT, R9, 0x40, PT"),
    (0x60, "@P1 BRA 0x78"),                      # call-wide: a full block falls through
    (0x70, "LDS R14, [R3]"),
    (0x78, "FSETP.GT.AND P2, PT, R20, R21, PT"),
    (0x80, "VOTE.ANY R22, PT, P2"),
    (0x88, "ISETP.NE.AND P3, PT, R22, RZ, PT"),
    (0x8c, "@!P3 BRA 0xb0"),                     # no max moved: no rescale
    (0x90, "FMUL R24, R24, R23"),
    (0x98, "FMUL R25, R25, R23"),
    (0xa0, "FMUL R26, R26, R23"),
    (0xa8, "FMUL R27, R27, R23"),
    (0xb0, "LDS R30, [R3+0x4]"),
    (0xb8, "ISETP.NE.AND P4, PT, R30, RZ, PT"),
    (0xbc, "@!P4 BRA 0xd0"),                     # data: the rare block is skipped
    (0xc0, "STS [R3], RZ"),
    (0xc8, "STS [R3+0x4], RZ"),
    (0xd0, "HMMA.16816.F32 R12, R4, R6, R12"),
    (0xe0, "@P5 BRA 0x10"),
    (0xf0, "EXIT"),
]


def _plain(decide=None, lines=PLAIN):
    blocks = sr.blocks_of(sr.parse(_sass(lines))["planted_kernel"])
    loop = sr.main_loop(blocks)
    body, ends = sr.loop_region(blocks, loop, natural=False)
    passes = {p.name: p.loop for p in sr.plain_passes(blocks, loop.header, body, ends,
                                                      decide=decide)}
    return blocks, loop, body, passes


def _addrs(loop):
    return {i.addr for b in loop.path for i in b.instrs}


def test_branches_are_classed_by_where_their_predicate_comes_from():
    blocks, loop, body, _ = _plain()
    lines = sr.branch_listing(blocks, loop.header, body, {b.start for b in loop.path})
    cls = {int(line.split()[0], 16): line.split()[1] for line in lines}
    assert cls == {0x20: "warp", 0x60: "call", 0x8c: "vote", 0xbc: "data", 0xe0: "call"}
    # each line names the compare that set the predicate, where its block holds it
    assert lines[0].endswith("[ISETP.GT.AND P0, PT, R0, 0x1f, PT]")
    assert lines[-1].endswith("(1 instrs)")  # 0xe0: P5 set outside the block


def test_plain_passes_take_both_sides_of_warp_and_vote_branches():
    blocks, loop, _, passes = _plain()
    assert set(passes) == {"slowest warp, rescale", "fastest warp, rescale",
                           "slowest warp, no rescale", "fastest warp, no rescale"}
    slow, fast = passes["slowest warp, rescale"], passes["fastest warp, rescale"]
    assert {0x40, 0x48, 0x50} <= _addrs(slow) and not {0x40, 0x48, 0x50} & _addrs(fast)
    rescale = {0x90, 0x98, 0xa0, 0xa8}
    assert rescale <= _addrs(slow) and not rescale & _addrs(passes["slowest warp, no rescale"])
    for p in passes.values():  # the rare block never; both products always
        assert not {0xc0, 0xc8} & _addrs(p) and p.path_count("HMMA") == 2
    assert slow.path_count() - fast.path_count() == 3
    assert slow.path_count() - passes["slowest warp, no rescale"].path_count() == 4
    # the rule of thumb's path: the fewest instructions, so no warp 0 load and no rescale
    assert not (rescale | {0x40}) & _addrs(loop)


def test_decide_sets_the_side_of_a_call_branch():
    _, loop, _, passes = _plain()
    assert 0x70 not in _addrs(passes["slowest warp, no rescale"]) and 0x70 not in _addrs(loop)
    _, _, _, decided = _plain({0x60: "fall"})
    for p in decided.values():
        assert 0x70 in _addrs(p)
    assert (decided["fastest warp, no rescale"].path_count()
            == passes["fastest warp, no rescale"].path_count() + 1)
    _, _, _, taken = _plain({0x60: "taken"})
    assert all(0x70 not in _addrs(p) for p in taken.values())


def test_a_loop_without_vote_or_warp_branches_has_two_equal_passes():
    blocks = sr.blocks_of(sr.parse(_sass(PLANTED))["planted_kernel"])
    loop = sr.main_loop(blocks)
    body, ends = sr.loop_region(blocks, loop, natural=False)
    passes = sr.plain_passes(blocks, loop.header, body, ends)
    assert [p.name for p in passes] == ["slowest warp", "fastest warp"]
    # 0x20 tests P0, never written: a call-wide value; the common side skips the rare block
    assert [[b.start for b in p.loop.path] for p in passes] == [[b.start for b in loop.path]] * 2


def test_without_spills_leaves_out_local_memory_traffic():
    spilled = PLANTED[:2] + [(0x14, "STL [R1+0x8], R20"), (0x18, "LDL R21, [R1+0x8]")] + \
        PLANTED[2:]
    blocks = sr.blocks_of(sr.parse(_sass(spilled))["planted_kernel"])
    loop = sr.main_loop(blocks)
    counts = sr.pass_counts(blocks, loop)
    assert counts["LDL"] == 1 and counts["STL"] == 1 and counts["path"] == 13
    assert counts["HMMA"] == 2
    assert sr.without_spills(counts) == (13 - 2 - 2) / 2
    assert sr.without_spills(dict(counts, LDL=0, STL=0)) == (13 - 2) / 2


def test_dests_and_sources():
    ins = sr.parse(_sass([
        (0x00, "IMAD.WIDE.U32 R4, R143, R206, RZ"),
        (0x10, "ISETP.GE.AND P0, PT, R4, R226, PT"),
        (0x20, "@P1 LDS.64 R6, [R148+0x12c08]"),
        (0x30, "STS [R149.X4+0x12c40], R20"),
        (0x40, "VOTE.ANY R123, PT, P0"),
        (0x50, "IADD3 R4, P2, R6, R4, RZ"),
        (0x60, "LDSM.16.MT88.2 R8, [R2+0x100]"),
        (0x70, "HMMA.16816.F32 R12, R4, R8, R12"),
    ]))["planted_kernel"]
    got = [sr.dests_and_sources(i) for i in ins]
    assert got[0] == (["R4", "R5"], ["R143", "R206"])
    assert got[1] == (["P0"], ["R4", "R226"])
    assert got[2] == (["R6", "R7"], ["P1", "R148"])
    assert got[3] == ([], ["R149", "R20"])
    assert got[4] == (["R123"], ["P0"])
    assert got[5] == (["R4", "P2"], ["R6", "R4"])
    assert got[6] == (["R8", "R9"], ["R2"])
    assert got[7][0] == ["R12", "R13", "R14", "R15"]


def test_plain_passes_on_a_natural_loop_take_the_prefetch_above_its_head():
    """--flash-attn's loops are natural loops: the plain passes search the same body."""
    blocks = sr.blocks_of(sr.parse(_sass(PREFETCH_ABOVE))["planted_kernel"])
    loop = sr.main_loop(blocks, natural=True)
    body, ends = sr.loop_region(blocks, loop, natural=True)
    assert body == {0x20, 0x40, 0x50} and ends == {0x50}
    passes = sr.plain_passes(blocks, loop.header, body, ends)
    assert [p.name for p in passes] == ["slowest warp", "fastest warp"]
    for p in passes:
        assert [b.start for b in p.loop.path] == [0x40, 0x20, 0x50]
        assert p.loop.path_count("LDGSTS") == 1 and p.loop.path_count() == 6


# A Hopper consumer loop: wgmma (HGMMA) is a tensor-core instruction like HMMA; the mbarrier
# waits (SYNCS) are counted; a loop of HMMA elsewhere with fewer tensor-core instructions loses.
HOPPER = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "HMMA.16816.F32 R8, R4, R6, R8"),
    (0x18, "@P0 BRA 0x10"),                                  # a small HMMA loop
    (0x20, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R3"),
    (0x28, "WARPGROUP.ARRIVE"),
    (0x30, "HGMMA.64x128x16.F32 R24, gdesc[UR8], R24"),
    (0x38, "HGMMA.64x128x16.F32 R24, gdesc[UR12], R24, gsb0"),
    (0x40, "MUFU.EX2 R5, R5"),
    (0x48, "HGMMA.64x128x16.F32 R88, R40, gdesc[UR16], R88, gsb0"),
    (0x50, "SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR6], RZ"),
    (0x58, "@P2 BRA 0x20"),                                  # the consumer's back edge
    (0x60, "EXIT"),
]


def test_hopper_loop_counts_hgmma_and_syncs():
    funcs = sr.parse(_sass(HOPPER))
    for natural in (False, True):
        loop = sr.main_loop(sr.blocks_of(funcs["planted_kernel"]), natural=natural)
        assert loop is not None and loop.header == 0x20, natural
        counts = sr.pass_counts(sr.blocks_of(funcs["planted_kernel"]), loop)
        assert (counts["HGMMA"], counts["HMMA"], counts["SYNCS"], counts["path"]) == (3, 0, 2, 8)


# The forward's rescale as it compiles now: the warp's vote read as a predicate (VOTE.ANY P),
# then a test on a value loaded from shared memory ("not the loop's first block") guarding the
# multiplies; and a vote whose float compare an ISETP folds with an integer test.
GUARDED = [
    (0x00, "S2R R0, SR_TID.X"),
    (0x10, "HMMA.16816.F32 R8, R4, R6, R8"),
    (0x18, "FSETP.NEU.AND P2, PT, R20, 1, PT"),
    (0x20, "VOTE.ANY P1, P2"),
    (0x28, "@!P1 BRA 0x60"),                     # no max moved
    (0x30, "LDS R30, [R3+0x8]"),
    (0x38, "ISETP.NE.AND P1, PT, R11, R30, PT"),
    (0x40, "@!P1 BRA 0x60"),                     # the first block: no rescale
    (0x48, "FMUL R24, R24, R20"),
    (0x50, "FMUL R25, R25, R20"),
    (0x58, "FMUL R26, R26, R20"),
    (0x60, "FSETP.GT.AND P4, PT, R21, R22, PT"),
    (0x68, "ISETP.NE.AND P4, PT, R11, R12, P4"),
    (0x70, "VOTE.ANY R23, PT, P4"),
    (0x78, "ISETP.NE.AND P5, PT, R23, RZ, PT"),
    (0x80, "@!P5 BRA 0x90"),
    (0x88, "FMUL R27, R27, R21"),
    (0x90, "HMMA.16816.F32 R12, R4, R6, R12"),
    (0x98, "@P6 BRA 0x10"),
    (0xa0, "EXIT"),
]


def test_a_test_on_the_vote_side_is_passed_on_the_rescale_pass():
    blocks, loop, body, passes = _plain(lines=GUARDED)
    lines = sr.branch_listing(blocks, loop.header, body, set())
    cls = {int(line.split()[0], 16): line.split()[1] for line in lines}
    assert cls == {0x28: "vote", 0x40: "data", 0x80: "vote", 0x98: "call"}
    rescale = {0x48, 0x50, 0x58, 0x88}
    assert rescale <= _addrs(passes["slowest warp, rescale"])
    assert not rescale & _addrs(passes["slowest warp, no rescale"])
    # with the first-block test decided as the first block takes it: no multiply of O there
    first = _plain({0x40: "taken"}, GUARDED)[3]
    assert not {0x48, 0x50, 0x58} & _addrs(first["slowest warp, rescale"])


# A plain full-block call's row test: row = tid + 0x40 (an index), seqlen_q read from the
# parameters at c[0x0][0x20c] (a bound); the load of the row's lse runs when row < seqlen_q.
# R9, written under a thread test (P6 of the thread index), is warp-uniform: no index.
BOUNDS = frozenset({0x20c})


def _bounded(cmp_args, guard="@P0"):
    return [
        (0x00, "S2R R0, SR_TID.X"),
        (0x08, "ISETP.GT.AND P6, PT, R0, 0x1f, PT"),
        (0x0c, "@P6 MOV R9, c[0x0][0x160]"),
        (0x10, "HMMA.16816.F32 R8, R4, R6, R8"),
        (0x18, "IADD3 R2, R0, 0x40, RZ"),
        (0x20, f"ISETP.{cmp_args}"),
        (0x28, f"{guard} BRA 0x48"),
        (0x30, "LDG.E R12, [R2.64]"),               # the row's load: runs when row < seqlen_q
        (0x38, "STS [R3], R12"),
        (0x40, "IADD3 R13, R13, 0x1, RZ"),
        (0x48, "ISETP.GE.AND P1, PT, R9, c[0x0][0x20c], PT"),
        (0x50, "@P1 BRA 0x60"),                     # R9: no index, not decided
        (0x58, "LDS R14, [R3]"),
        (0x60, "HMMA.16816.F32 R12, R4, R6, R12"),
        (0x68, "@P5 BRA 0x10"),
        (0x70, "EXIT"),
    ]


def _bounded_passes(lines, bounds=BOUNDS):
    blocks = sr.blocks_of(sr.parse(_sass(lines))["planted_kernel"])
    loop = sr.main_loop(blocks)
    body, ends = sr.loop_region(blocks, loop, natural=False)
    passes = {p.name: p.loop for p in sr.plain_passes(blocks, loop.header, body, ends,
                                                      bounds=bounds)}
    listing = sr.branch_listing(blocks, loop.header, body, set(), bounds)
    return passes, {int(x.split()[0], 16): x.split()[1] for x in listing}


def test_a_row_test_against_a_sequence_length_is_decided_as_a_full_block_takes_it():
    load = {0x30, 0x38, 0x40}
    for cmp_args, guard in (("GE.AND P0, PT, R2, c[0x0][0x20c], PT", "@P0"),   # row >= sq
                            ("LT.AND P0, PT, R2, c[0x0][0x20c], PT", "@!P0"),  # !(row < sq)
                            ("GT.AND P0, PT, R16, R2, PT", "@!P0")):           # !(sq > row)
        lines = _bounded(cmp_args, guard)
        if "R16" in cmp_args:
            lines.insert(1, (0x04, "MOV R16, c[0x0][0x20c]"))
        passes, cls = _bounded_passes(lines)
        assert cls[0x28] == "bound=fall", cmp_args
        assert cls[0x50] != "bound=fall" and not cls[0x50].startswith("bound"), cmp_args
        assert set(passes) == {"slowest warp", "fastest warp"}
        for p in passes.values():  # every warp's row is inside: the load is on both passes
            assert load <= _addrs(p), cmp_args
    # the opposite test (row < sq skips the block) is decided the other way
    passes, cls = _bounded_passes(_bounded("LT.AND P0, PT, R2, c[0x0][0x20c], PT", "@P0"))
    assert cls[0x28] == "bound=taken"
    assert all(not load & _addrs(p) for p in passes.values())
    # without the bounds (flash-attn's kernels, a planted listing) the row test is a thread
    # test: the slowest warp loads, the fastest does not
    passes, cls = _bounded_passes(_bounded("GE.AND P0, PT, R2, c[0x0][0x20c], PT"), frozenset())
    assert cls[0x28] == "warp"
    assert load <= _addrs(passes["slowest warp"]) and not load & _addrs(passes["fastest warp"])


def test_decide_overrides_a_bound_decision():
    lines = _bounded("GE.AND P0, PT, R2, c[0x0][0x20c], PT")
    blocks = sr.blocks_of(sr.parse(_sass(lines))["planted_kernel"])
    loop = sr.main_loop(blocks)
    body, ends = sr.loop_region(blocks, loop, natural=False)
    passes = sr.plain_passes(blocks, loop.header, body, ends, decide={0x28: "taken"},
                             bounds=BOUNDS)
    assert all(not {0x30, 0x38} & _addrs(p.loop) for p in passes)


# The forward's rescale: the warp's vote, the first-block test, then one vote per 8-row slot.
SLOTS = [
    (0x00, "S2R R0, SR_TID.X"),
    (0x10, "HMMA.16816.F32 R8, R4, R6, R8"),
    (0x18, "FSETP.NEU.AND P2, PT, R20, 1, PT"),
    (0x20, "VOTE.ANY P1, P2"),
    (0x28, "@!P1 BRA 0xb0"),                     # no row moved
    (0x30, "LDS R30, [R3+0x8]"),
    (0x38, "ISETP.NE.AND P1, PT, R11, R30, PT"),
    (0x40, "@!P1 BRA 0xb0"),                     # the first block
    (0x48, "FSETP.NEU.AND P1, PT, R20, 1, PT"),
    (0x50, "VOTE.ANY P1, P1"),
    (0x58, "@!P1 BRA 0x70"),                     # slot 0
    (0x60, "FMUL R24, R24, R20"),
    (0x68, "FMUL R25, R25, R20"),
    (0x70, "FSETP.NEU.AND P1, PT, R21, 1, PT"),
    (0x78, "VOTE.ANY P1, P1"),
    (0x80, "@!P1 BRA 0x98"),                     # slot 1
    (0x88, "FMUL R26, R26, R21"),
    (0x90, "FMUL R27, R27, R21"),
    (0x98, "FSETP.NEU.AND P1, PT, R22, 1, PT"),
    (0xa0, "VOTE.ANY P1, P1"),
    (0xa4, "@!P1 BRA 0xb0"),                     # slot 2
    (0xa8, "FMUL R28, R28, R22"),
    (0xb0, "HMMA.16816.F32 R12, R4, R6, R12"),
    (0xb8, "@P6 BRA 0x10"),
    (0xc0, "EXIT"),
]


def test_the_one_slot_rescale_pass_moves_the_first_slot_alone():
    _, _, _, passes = _plain(lines=SLOTS)
    assert set(passes) == {f"{w} warp, {r}" for w in ("slowest", "fastest")
                           for r in ("rescale", "rescale one slot", "no rescale")}
    slot0, others = {0x60, 0x68}, {0x88, 0x90, 0xa8}
    one, every = passes["slowest warp, rescale one slot"], passes["slowest warp, rescale"]
    assert slot0 <= _addrs(one) and not others & _addrs(one)
    assert slot0 | others <= _addrs(every)
    assert {0x30, 0x38, 0x40} <= _addrs(one)     # the first-block test is passed
    assert not (slot0 | others | {0x30}) & _addrs(passes["slowest warp, no rescale"])
    assert every.path_count() - one.path_count() == 3


# The backward's key range of a row block under a window (key_hi), in a plain call: the
# window's left edge is -1 (none), so R4 = (R5 | left) >= 0 ? R5 : 0 is 0, and 0 > n0 (the
# CTA's first key, blockIdx.x * 128 >= 0) is false: the key test's block runs.
WINDOW = [
    (0x00, "S2R R27, SR_CTAID.X"),
    (0x08, "IMAD.SHL.U32 R27, R27, 0x80, RZ"),
    (0x0c, "LDC R20, c[0x0][0x2f8]"),
    (0x10, "HMMA.16816.F32 R8, R4, R6, R8"),
    (0x18, "LDS R5, [R3]"),
    (0x20, "LOP3.LUT R4, R5, R20, RZ, 0xfc, !PT"),
    (0x28, "ISETP.GE.AND P0, PT, R4, RZ, PT"),
    (0x30, "SEL R4, R5, RZ, P0"),
    (0x38, "ISETP.GT.AND P0, PT, R4, R27, PT"),
    (0x40, "@P0 BRA 0x58"),
    (0x48, "IADD3 R13, R13, 0x1, RZ"),           # the key test's block
    (0x50, "IADD3 R14, R14, 0x1, RZ"),
    (0x58, "HMMA.16816.F32 R12, R4, R6, R12"),
    (0x60, "@P5 BRA 0x10"),
    (0x68, "EXIT"),
]


def test_a_test_on_the_window_is_decided_by_the_values_of_a_plain_call():
    passes, cls = _bounded_passes(WINDOW, frozenset({(0x2f8, -1)}))
    assert cls[0x40] == "bound=fall"
    assert all({0x48, 0x50} <= _addrs(p) for p in passes.values())
    # with another left edge the test is not decided: the rule of thumb skips the block
    for bounds in (frozenset({(0x2f8, 0)}), frozenset()):
        passes, cls = _bounded_passes(WINDOW, bounds)
        assert cls[0x40] == "data"
        assert all(not {0x48, 0x50} & _addrs(p) for p in passes.values())
