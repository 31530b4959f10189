"""CPU checks of the decode attention kernel (kernels/tilelang/attention_decode_kernel.py): it lowers to CUDA for sm_90a and
sm_100a without a GPU, and on sm_90a the source has the intended structure (wgmma, register rebalancing between
the warpgroups, QK of the next block issued behind PV of the current one, no CTA-wide barrier inside a role)."""

import functools
import importlib.util
import re

import pytest

tilelang_missing = importlib.util.find_spec("tilelang") is None
pytestmark = pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")


@functools.lru_cache(maxsize=None)  # several tests read the same kernel's source: lowered once (~3 s each)
def _source(arch, splits):
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    return lower_source(build_sink_attention_decode(splits=splits, arch=arch), arch)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("splits", [1, 3, 10])
def test_decode_kernel_lowers_to_cuda(arch, splits):
    src = _source(arch, splits)
    assert "__global__" in src and "__launch_bounds__(384, 1)" in src
    # the only CTA-wide barrier is the one after mbarrier init: one inside a role branch would deadlock
    assert src.count("__syncthreads()") == 1
    if arch == "sm_90a":
        assert "wgmma" in src
        assert "warpgroup_reg_alloc<192>" in src and "warpgroup_reg_dealloc<152>" in src
        if splits < 10:  # more than one block per CTA: PV_L(n) waited while the 4 QK(n+1) groups stay in flight
            assert "wait_wgmma<4>" in src
        assert len(re.findall(r"wgmma_ss<[^>]*64, 64, 16", src)) >= 1      # QK: m64n64k16
        assert len(re.findall(r"wgmma_ss<[^>]*64, 256, 16", src)) >= 2     # PV: m64n256k16, one per math WG
        if splits > 1:
            assert "o_part" in src and "ml_part" in src


def test_decode_partials_have_the_combine_layout():
    """The decode kernel's partials are what attention_combine_kernel reads: [n_q, splits, H, D] and
    [n_q, splits, 2, H]."""
    from deepinfer.kernels.tilelang.attention_combine_kernel import build_sink_combine
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    f = build_sink_attention_decode(splits=4, arch="sm_90a")
    bufs = {f.buffer_map[p].name: f.buffer_map[p] for p in f.params if p in f.buffer_map}
    assert list(bufs) == ["q", "q_seq", "q_pos", "win_kv", "win_scale", "win_pos", "cmp_kv", "cmp_scale", "sel", "sink",
                          "out", "o_part", "ml_part"]
    shapes = {k: [str(x) for x in b.shape] for k, b in bufs.items()}
    assert shapes["o_part"] == ["n_q", "4", "64", "512"] and shapes["ml_part"] == ["n_q", "4", "2", "64"]
    c = build_sink_combine(splits=4)
    cbufs = {c.buffer_map[p].name: [str(x) for x in c.buffer_map[p].shape] for p in c.params if p in c.buffer_map}
    assert cbufs["o_part"] == shapes["o_part"] and cbufs["ml_part"] == shapes["ml_part"]


def test_default_splits_fill_the_sms_with_at_least_one_block_per_split():
    from deepinfer.kernels.tilelang.attention import default_splits

    # 640 keys = 10 blocks of 64, on an H200's 132 SMs
    assert [default_splits(n, 10, 132) for n in (1, 8, 64, 66, 256)] == [10, 10, 2, 2, 1]
    assert default_splits(4, 10, 78) == 10 and default_splits(16, 10, 78) == 4  # a GPU with fewer SMs


def test_default_splits_leave_no_split_empty_and_keep_the_blocks_per_split():
    """A split count whose last splits get no block runs as the count that does the same: the same blocks per
    split (hence the same partial sums), no empty CTA; e.g. 16 queries of 10 blocks: 5 splits of 2, not 8."""
    from deepinfer.kernels.tilelang.attention import default_splits

    assert default_splits(16, 10, 132) == 5 and default_splits(20, 10, 132) == 5 and default_splits(40, 10, 132) == 3
    for sms in (78, 132):
        for n_blocks in range(1, 40):
            for n_q in range(1, 300):
                s = default_splits(n_q, n_blocks, sms)
                want = max(1, min(n_blocks, sms // n_q))  # the CTA count aimed at
                per = -(-n_blocks // s)
                assert 1 <= s <= want and (s - 1) * per < n_blocks and per == -(-n_blocks // want)


def test_decode_kernel_reads_a_ring_wider_than_the_window():
    """Speculative decoding keeps rollback rows: a ring of 192 rows is read whole (3 window blocks + 8 pool
    blocks), while a key stays visible only within the 128 positions up to the query's."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    wide = lower_source(build_sink_attention_decode(splits=1, arch="sm_90a", ring=192), "sm_90a")
    plain = lower_source(build_sink_attention_decode(splits=1, arch="sm_90a"), "sm_90a")
    assert "__global__" in wide and wide != plain
    assert "192" in wide and "128" in wide  # the ring's row stride and the window's visibility bound


def test_a_requested_split_count_is_cut_to_the_splits_that_get_blocks():
    """8 splits of 10 blocks take 2 blocks each and leave splits 5..7 past the end; the kernel runs 5 (the same
    sums). On the H200 a split starting past the last block read another query's selection (TileLang folded its
    clamped block count), which turned DSpark's 16-row verification steps into NaN."""
    from deepinfer.kernels.tilelang.attention import used_splits

    assert [used_splits(s, 10) for s in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16)] == [1, 2, 3, 4, 5, 5, 5, 5, 5, 10, 10]


def test_the_builder_refuses_a_split_past_the_last_block():
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    with pytest.raises(AssertionError, match="past the end"):
        build_sink_attention_decode(splits=8, arch="sm_90a")
    build_sink_attention_decode(splits=5, arch="sm_90a")  # 5 x 2 blocks: every split starts inside the keys


@pytest.mark.slow  # the benchmark's probes (18 s of lowering): the slow tier
def test_the_timing_probes_drop_their_part_and_leave_the_kernel_as_it_is():
    """attention_decode_gpu.py --probes times the kernel with one part of a key block's work dropped. Each probe
    lowers; no_load reads no key rows, no_dequant reads them but converts none, no_softmax calls no exp2 in the
    block loop, blocksN runs N key blocks with the MMAs and O's fragment layout of the kernel (and with +no_q loads
    no Q, with +no_out stores no output); the kernel without a probe is the same source as before probes existed
    (no probe argument)."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.attention_decode_kernel import PROBES, build_sink_attention_decode

    def src(probe):
        return lower_source(build_sink_attention_decode(splits=1, arch="sm_90a", probe=probe), "sm_90a")

    plain = src("")
    assert plain == _source("sm_90a", 1)
    loads = "*(uint4*)(win_kv + "
    for probe in PROBES[1:]:
        s = src(probe)
        assert "__global__" in s and s != plain
        if probe.startswith("blocks"):  # the first window blocks, as the kernel runs them; +no_q / +no_out drop Q /
            # the output's global stores
            assert "wgmma_ss" in s and loads in s and "float o_l[128]" in s, probe
            assert ("*(uint4*)(q + " in s) == ("no_q" not in probe), probe
            assert ("*(uint4*)(out + " in s) == ("no_out" not in probe), probe
            continue
        assert (loads in s) == (probe in ("no_dequant", "no_softmax")), probe
        assert ("di_dq_e4m3x8((" in s) == (probe in ("no_load", "no_softmax")), probe
    assert src("no_softmax").count("exp2f(") < plain.count("exp2f(")
    with pytest.raises(AssertionError, match="probe must be one of"):
        build_sink_attention_decode(splits=1, arch="sm_90a", probe="no_mma")


def _nvcc_report(src):
    import shutil
    import tempfile
    from pathlib import Path

    from lowering_helpers import ptxas_report

    if not shutil.which("nvcc"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return ptxas_report(src, Path(tmp))


# one split in the fast tier; the other split shapes and the wide ring in the slow one
SPLIT_SHAPES = [(1, None)] + [pytest.param(*c, marks=pytest.mark.slow)
                              for c in [(2, None), (5, None), (10, None), (1, 192)]]


@pytest.mark.parametrize("splits,ring", SPLIT_SHAPES)
def test_every_role_s_block_loop_is_one_body(splits, ring):
    """Each role runs its key blocks as one loop body, block n's key and P buffer halves and barriers picked by
    n % 2, and a producer block takes the window's or the pool's path whole (one test a block, not one a row): the
    loops unrolled two blocks an iteration, a copy a buffer and both paths in every row, overflowed an SM's
    instruction caches (1.6x slower at B=256 on an H100). It lowers for every split shape, and ptxas fits it without
    a spill where nvcc is installed."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    src = (_source("sm_90a", splits) if ring is None
           else lower_source(build_sink_attention_decode(splits=splits, arch="sm_90a", ring=ring), "sm_90a"))
    cut = src.index("warpgroup_reg_dealloc<152>")
    math, producer = src[:cut], src[cut:]
    assert "wgmma" in src
    if splits < 5:  # more than two blocks a CTA (TileLang unrolls a loop of one or two)
        assert len(re.findall(r"k_free\[\(n(_\d+)? & 1\)\]\.wait\(", producer)) == 1
        assert len(re.findall(r"k_ready\[\(n(_\d+)? & 1\)\]\.arrive\(\)", producer)) == 1
        assert "k_free[0].wait(" not in producer and "k_free[1].wait(" not in producer
        # one copy of each row path, in one loop: a pool row's 16 codes in one call that zeroes it when invisible (no
        # select after it), a window row's in two
        assert producer.count("di_dq_e2m1x16_e4m3((") == 1 and producer.count("di_dq_e4m3x8((") == 2
        # the math warpgroups: WG0 waits for a free P buffer half once, by the block's index
        assert len(re.findall(r"p_free\[\(n(_\d+)? & 1\)\]\.wait\(", math)) == 1
        assert "p_free[1].wait(" not in math
    if splits in (1, 2):
        report = _nvcc_report(src)
        if report:
            log, regs = report
            assert regs <= 168 and "0 bytes spill stores" in log


def test_one_split_s_output_goes_through_shared_memory():
    """With one split each math warpgroup writes its half of the bf16 output into Q's shared memory (free once WG0's
    MMAs are done), waits on its own named barrier and stores it in 16-byte stores (16 a thread), not each fragment
    value's 2 bytes straight to global memory (1.36x slower at B=256 on an H100); split kernels write fp32 partials
    for the combine."""
    src = _source("sm_90a", 1)
    assert "__sync_thread_partial(6, 128)" in src and "__sync_thread_partial(7, 128)" in src
    assert src.count("*(uint4*)(out + ") == 2
    assert "((bfloat16_t*)q_s)[" in src  # the fragments' values into Q's shared memory
    split = _source("sm_90a", 2)
    assert "*(uint4*)(out + " not in split and "__sync_thread_partial(6, 128)" not in split and "o_part" in split


@pytest.mark.parametrize("splits,ring", [(2, None)] + [pytest.param(*c, marks=pytest.mark.slow)
                                                       for c in [(3, None), (4, None), (5, None), (2, 192)]])
def test_clustered_splits_merge_in_distributed_shared_memory(splits, ring):
    """The cluster (attention.CLUSTER_SPLITS): a query's 2-8 splits leave their un-normalised O in
    their own key buffer and m, l beside it, meet at a cluster barrier, and each merges a contiguous share of the
    output's 16-byte pieces from every split's shared memory (ld.shared::cluster), storing bf16 in 16-byte stores,
    then meets its peers again before it exits; no fp32 partial goes to global memory. Without the cluster, the split
    kernel is the source it was; ptxas fits it where nvcc is installed."""
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode
    from lowering_helpers import lower_source

    src = lower_source(build_sink_attention_decode(splits=splits, arch="sm_90a", ring=ring, cluster=True), "sm_90a")
    plain = (_source("sm_90a", splits) if ring is None
             else lower_source(build_sink_attention_decode(splits=splits, arch="sm_90a", ring=ring), "sm_90a"))
    assert "ld.shared::cluster.v4.f32" in src and src.count("  di_cluster_sync();") == 2
    assert "(o_part + " not in src and "ml_part[" not in src and "(o_part + " in plain and "ml_part[" in plain
    assert src.count("*(uint4*)(out + ") == 1 and "di_cluster_sync" not in plain
    assert "di_st_f32(" in src  # the partial written by address: the key buffer's swizzle does not apply
    with pytest.raises(AssertionError, match="at most 16 splits"):
        build_sink_attention_decode(splits=17, arch="sm_90a", topk=2048, cluster=True)
    report = _nvcc_report(src)
    if report:
        assert report[1] <= 168


def test_the_cluster_is_asked_for_two_to_eight_splits_only(monkeypatch):
    """decode_spec asks for the clustered kernel with 2 to attention.CLUSTER_SPLITS splits (8 by default, a portable
    cluster; 0: never); one split has nothing to merge, ten exceed a portable cluster."""
    from deepinfer.kernels.tilelang import attention

    # the builder's cluster argument: the spec's tenth after the builder (a spec stops at its last non-default)
    clustered = lambda: [attention.decode_spec(128, 512, s, 128)[10:11] == (True,) for s in (1, 2, 5, 8, 10)]  # noqa
    assert clustered() == [False, True, True, True, False]
    monkeypatch.setattr(attention, "CLUSTER_SPLITS", 0)
    assert clustered() == [False] * 5
    monkeypatch.setattr(attention, "CLUSTER_SPLITS", 16)  # a non-portable cluster size
    assert clustered() == [False, True, True, True, True]


@pytest.mark.parametrize("splits", [1, 3])
def test_wg1_converts_its_share_of_each_block_between_its_pvs(splits):
    """attention.WG1_ROWS = 16 (the default): the producer's table is published through an
    mbarrier WG1 waits on; WG1 dequantises its 16 rows of blocks 0 and 1 before its first PV and of block n + 2
    after PV(n), once WG0 has freed that key buffer half, and arrives on the half's k_ready beside the producer
    (256 arrivals); registers move from the producer to WG1; ptxas fits it without a spill where nvcc is installed.
    The builder's wg1_rows=0 kernel (the producer converting all 64 rows) has none of it."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang import attention
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    regs = attention.REGS[16]
    src = lower_source(build_sink_attention_decode(splits=splits, arch="sm_90a", wg1_rows=16, regs=regs), "sm_90a")
    assert "tab_ready" not in _source("sm_90a", splits)
    assert "k_ready[0].init(256)" in src and "tab_ready[0].init(128)" in src
    wg1 = src[src.index(f"warpgroup_reg_alloc<{regs[1]}>"):src.index(f"warpgroup_reg_dealloc<{regs[2]}>")]
    producer = src[src.index(f"warpgroup_reg_dealloc<{regs[2]}>"):]
    assert "tab_ready[0].arrive()" in producer and "tab_ready[0].wait(0)" in wg1
    assert wg1.count("di_dq_e2m1x16_e4m3") >= 1 and wg1.count("k_ready[") >= 2
    loop = wg1[wg1.index("wgmma_ss"):]
    assert loop.index("k_free[") < loop.index("di_dq_e2m1x16_e4m3") < loop.index("k_ready[")
    report = _nvcc_report(src)
    if report:
        log, _ = report
        assert "0 bytes spill stores" in log


@pytest.mark.parametrize("rows", [12, 20])  # the candidates (16's spill check is the test above's)
def test_each_candidate_s_register_split_compiles_without_a_spill(rows):
    """Each WG1_ROWS candidate's register split (attention.REGS[rows]) leaves ptxas room for WG1's share of the
    dequantisation: no spill (20 rows at 192 / 176 / 136 spilled 8 bytes, hence 192 / 184 / 128)."""
    import shutil

    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang import attention
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    if not shutil.which("nvcc"):
        pytest.skip("needs nvcc (ptxas) for the spill count")
    src = lower_source(build_sink_attention_decode(splits=1, arch="sm_90a", wg1_rows=rows,
                                                   regs=attention.REGS[rows]), "sm_90a")
    log, _ = _nvcc_report(src)
    assert "0 bytes spill stores" in log, log


def test_every_register_split_fits_what_the_cta_is_launched_with():
    """setmaxnreg only moves registers between the warpgroups within the CTA's launch allocation (384 threads x 168):
    a split whose sum is larger makes an increase wait forever (the WG1-rows candidate's first GPU run hung). The
    builder refuses one, and every split the launcher uses (attention.REGS) fits, in setmaxnreg's multiples of 8."""
    from deepinfer.kernels.tilelang import attention
    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    for rows, regs in attention.REGS.items():
        assert 128 * sum(regs) <= 384 * 168, (rows, regs)
        assert all(r % 8 == 0 for r in regs), (rows, regs)  # setmaxnreg takes multiples of 8
    with pytest.raises(AssertionError):
        build_sink_attention_decode(arch="sm_90a", wg1_rows=16, regs=(192, 184, 136))
