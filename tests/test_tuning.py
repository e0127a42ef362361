"""The tuning table: parsing, the pure lookup, dispatch's use of it, and tune's pure parts."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lazytriton import geometry, tuning
from lazytriton.cli import tune
from lazytriton.cli.tune import common
from lazytriton.cli.tune import flash_fwd as tune_fwd
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

HEADER = ",".join(tuning.COLUMNS)


def row(sq: int, sk: int, block_m: int = 128, target: str = "sm_90", dtype: str = "bf16", head_dim: int = 128,
        causal: bool = False, kernel: str = "flash_fwd") -> tuning.Row:
    return tuning.Row(target, kernel, dtype, head_dim, causal, sq, sk, block_m, 64, 8, 3, 0, 400.0,
                      "NVIDIA H200", "2026-11-30")


def test_bucket_is_the_ceiling_power_of_two() -> None:
    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 16, 17, 4096, 4097)] == [1, 1, 2, 4, 16, 32, 4096, 8192]


def test_lookup_takes_the_first_bucket_at_or_above_else_the_last() -> None:
    table = tuning.Table([row(16, 16, 16), row(16, 4096, 32), row(1024, 1024, 64), row(4096, 4096, 128)])
    find = lambda sq, sk: tuning.lookup(table, "sm_90", "flash_fwd", "bf16", 128, False, sq, sk)  # noqa: E731
    assert find(1, 1).BLOCK_M == 16
    assert find(16, 100).BLOCK_M == 32  # seqlen_k 100 -> bucket 4096
    assert find(16, 10**6).BLOCK_M == 32  # past the last seqlen_k bucket: the last
    assert find(17, 5).BLOCK_M == 64
    assert find(1024, 1024).BLOCK_M == 64
    assert find(1025, 1).BLOCK_M == 128
    assert find(10**7, 10**7).BLOCK_M == 128
    assert tuning.lookup(table, "sm_80", "flash_fwd", "bf16", 128, False, 1, 1) is None
    assert tuning.lookup(table, "sm_90", "flash_fwd", "bf16", 128, True, 1, 1) is None


def test_csv_round_trip_and_sorted_output() -> None:
    table = tuning.Table([row(4096, 4096), row(16, 4096, 16, causal=True), row(128, 128, 64, dtype="fp16")])
    text = table.to_csv()
    assert text.splitlines()[0] == HEADER
    again = tuning.Table.parse(text)
    assert set(again) == set(table)
    assert again.to_csv() == text


@pytest.mark.parametrize("change, message", [
    (("head_dim", "abc"), "column head_dim"),
    (("head_dim", "0"), "head_dim=0 must be in 1..512"),
    (("causal", "maybe"), "column causal"),
    (("seqlen_q", "1000"), "seqlen_q=1000 must be a power of two"),
    (("BLOCK_M", "96"), "BLOCK_M=96 must be a power of two"),
    (("tflops", ""), "column tflops"),
])
def test_bad_rows_are_refused_naming_the_column(change: tuple[str, str], message: str) -> None:
    line = tuning.Table([row(16, 16)]).to_csv().splitlines()[1]
    values = dict(zip(tuning.COLUMNS, line.split(","), strict=True))
    values[change[0]] = change[1]
    with pytest.raises(ValueError, match=message):
        tuning.Table.parse(HEADER + "\n" + ",".join(values[c] for c in tuning.COLUMNS) + "\n")


def test_missing_columns_and_duplicate_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="lacks columns"):
        tuning.Table.parse("target,kernel\nsm_90,flash_fwd\n")
    with pytest.raises(ValueError, match="two rows"):
        tuning.Table([row(16, 16), row(16, 16, 32)])


def test_the_shipped_table_parses() -> None:
    table = tuning.Table.parse(tuning.table_path("flash_fwd").read_text())
    for r in table:
        assert r.kernel == "flash_fwd" and str(Target.parse(r.target)) == r.target
        assert r.tflops > 0 and r.gpu and r.measured


def test_a_split_head_dim_takes_its_own_rows_else_its_padded_tiles() -> None:
    """96 (split tiles 64 + 32) reads rows tuned at 96 when there are some, else 128's; 100 (padded) reads 128's."""
    target = Target.parse("sm_90")
    at_128, at_96 = row(4096, 4096, 64), row(4096, 4096, 32, head_dim=96)
    assert tuning.Table.parse(tuning.Table([at_96]).to_csv()).rows == (at_96,)  # a row at 96 is a valid row
    config, used = fwd_dispatch.flash_fwd_config(target, "bf16", 96, False, 3000, 3000, tuning.Table([at_128, at_96]))
    assert used == at_96 and config.block_m == 32
    variant = fwd_dispatch.flash_fwd_variant(target, "bf16", 96, False, True, 3000, seqlen_k=3000,
                                             table=tuning.Table([at_128, at_96]))
    assert (variant.get("BLOCK_M"), variant.get("BLOCK_D"), variant.get("BLOCK_D2")) == (32, 64, 32)
    assert fwd_dispatch.flash_fwd_config(target, "bf16", 96, False, 3000, 3000, tuning.Table([at_128]))[1] == at_128
    both = tuning.Table([at_128, at_96])
    assert fwd_dispatch.flash_fwd_config(target, "bf16", 100, False, 3000, 3000, both)[1] == at_128
    assert fwd_dispatch.flash_fwd_config(target, "bf16", 128, False, 3000, 3000, tuning.Table([at_96]))[1] is None
    # 96's rows are its split tiles': a padded call of 96 (split_d=False, or v's head dim another) takes 128's, whose
    # shared-memory budget is its own; so does the config asked for a padded variant
    table = tuning.Table([at_128, at_96])
    assert fwd_dispatch.flash_fwd_config(target, "bf16", 96, False, 3000, 3000, table, split=False)[1] == at_128
    for dv, split_d in ((0, False), (64, None)):
        padded = dispatch.kernel_variant("flash_fwd", target, "bf16", 96, False, True, 3000, 3000, table=table,
                                         split_d=split_d, head_dim_v=dv)
        assert (padded.get("BLOCK_M"), padded.get("BLOCK_D"), "BLOCK_D2" in str(padded)) == (64, 128, False)


@pytest.mark.parametrize("kernel", ("flash_bwd_dq", "flash_bwd_dkdv"))
def test_a_split_backward_head_dim_takes_its_own_rows_only_in_split_tiles(kernel: str) -> None:
    """The backward's rows at 192 (tune_bwd keys split winners by their head dim) serve 192's split variants at every
    seqlen (the nearest bucket); a padded 192 call (split_d=False, or DeepSeek's v head dim 128) takes 256's."""
    target = Target.parse("sm_90")
    at_256, at_192 = row(4096, 4096, 16, head_dim=256, kernel=kernel), row(1024, 1024, 32, head_dim=192, kernel=kernel)
    table = tuning.Table([at_256, at_192])
    for seqlen in (1024, 4096, 16384):
        split = dispatch.kernel_variant(kernel, target, "bf16", 192, False, True, seqlen, seqlen, table=table)
        assert (split.get("BLOCK_M"), split.get("BLOCK_D"), split.get("BLOCK_D2")) == (32, 128, 64)
        for dv, split_d in ((0, False), (128, None)):
            padded = dispatch.kernel_variant(kernel, target, "bf16", 192, False, True, seqlen, seqlen, table=table,
                                             split_d=split_d, head_dim_v=dv)
            assert (padded.get("BLOCK_M"), padded.get("BLOCK_D"), "BLOCK_D2" in str(padded)) == (16, 256, False)
            assert dispatch.kernel_config(kernel, target, "bf16", 192, False, seqlen, seqlen, table,
                                          split=False)[1] == at_256


def test_dispatch_uses_the_row_else_the_default() -> None:
    table = tuning.Table([row(4096, 4096, 64)])
    target = Target.parse("sm_90")
    config, used = fwd_dispatch.flash_fwd_config(target, "bf16", 100, False, 3000, 3000, table)
    assert used == row(4096, 4096, 64) and (config.block_m, config.num_warps) == (64, 8)
    variant = fwd_dispatch.flash_fwd_variant(target, "bf16", 128, False, True, 3000, seqlen_k=3000, table=table)
    assert variant.get("BLOCK_M") == 64
    config, used = fwd_dispatch.flash_fwd_config(target, "fp16", 128, False, 3000, 3000, table)
    assert used is None and config == fwd_dispatch.default_config(target, "fp16", 128, 3000, False)


def test_tune_candidates_fit_the_shape() -> None:
    for dtype in ("bf16", "fp16", "fp32"):
        for head_dim in (64, 128, 256):
            for sq in (1, 16, 100, 4096):
                configs = tune_fwd.candidates(dtype, head_dim, sq)
                assert configs
                assert all(c.block_m <= max(16, tuning.bucket(sq)) for c in configs)
                if head_dim == 256 or dtype == "fp32":  # small tiles, or larger ones with 2 stages
                    assert all(c.block_m * c.block_n <= 64 * 64 or (c.block_m * c.block_n <= 128 * 64
                                                                    and c.num_stages == 2) for c in configs)


def test_tune_times_only_variants_whose_tiles_fit_shared_memory() -> None:
    from lazytriton.prewarm.limits import refusal

    made = [fwd_dispatch.flash_fwd_variant(SM90, "bf16", 256, False, True, 4096, config=c, seqlen_k=4096)
            for c in (Config(128, 128, 8, 3), Config(64, 64, 4, 2), Config(128, 128, 8, 4))]
    assert [refusal(v) is None for v in made] == [False, True, False]
    assert common.fitting(made) == [made[1]]  # the estimate is a lower bound: launch failures are skipped too


def test_tune_merge_replaces_only_the_same_buckets(tmp_path: Path) -> None:
    old = tuning.Table([row(16, 16, 16), row(4096, 4096, 64), row(4096, 4096, 64, dtype="fp16")])
    merged = tuning.merge(old, [row(4096, 4096, 128)])
    assert len(merged) == 3
    assert tuning.lookup(merged, "sm_90", "flash_fwd", "bf16", 128, False, 4096, 4096).BLOCK_M == 128
    assert tuning.lookup(merged, "sm_90", "flash_fwd", "fp16", 128, False, 4096, 4096).BLOCK_M == 64
    path = tmp_path / "tuning.csv"
    common.write_table(path, merged)
    assert tuning.Table.parse(path.read_text()).to_csv() == merged.to_csv()
    assert [p.name for p in tmp_path.iterdir()] == ["tuning.csv"]


def test_tune_compiles_through_the_runtime(tmp_path_factory: pytest.TempPathFactory,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Each candidate goes through Runtime.resolve: the compile lock, every writable tier and the miss log.
    from compiled_once import compiled, shared_dir, small_variant

    from lazytriton import compiler, runtime

    variant = small_variant("sm_90")
    entry = compiled(variant, shared_dir(tmp_path_factory))
    monkeypatch.setattr(compiler, "compile_variant", lambda v, key=None: entry)
    runtime.reset()
    text, error = common._resolve(str(variant))
    assert (text, error) == (str(variant), "")
    rt = runtime.get()
    assert rt.local.get(variant.key()) is not None
    assert str(variant) in rt.miss_log.read_text()


def test_tune_writes_the_users_table_not_the_package(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    user = tuning.user_table_path("flash_fwd")
    assert user == cache_dir / "tuning" / "flash_fwd.csv"
    assert tuning.table_path("flash_fwd") != user
    row = tuning.Row("sm_90", "flash_fwd", "bf16", 128, False, 4096, 4096, 32, 32, 4, 2, 0, 1.0, "test", "2026-11-30")
    user.parent.mkdir(parents=True)
    user.write_text(tuning.Table([row]).to_csv())
    config, used = fwd_dispatch.flash_fwd_config(Target.parse("sm_90"), "bf16", 128, False, 4096, 4096)
    assert used == row and (config.block_m, config.block_n) == (32, 32), "the user's row wins over the shipped one"
    user.write_text("not,a,table\n")
    tuning._table_for.cache_clear()  # the tables are read once per process
    config, used = fwd_dispatch.flash_fwd_config(Target.parse("sm_90"), "bf16", 128, False, 4096, 4096)
    assert used is not None and used.gpu != "test", "a damaged user table leaves the shipped one serving"


# --- the backward family: its table, its rows, its tuner ------------------------------------------------------

BWD = bwd_dispatch.BWD_KERNELS
SM90 = Target.parse("sm_90")


def test_the_backward_kernels_share_their_familys_tables(cache_dir: Path) -> None:
    shipped = {tuning.table_path(name) for name in ("flash_bwd", *BWD)}
    assert shipped == {tuning.table_path("flash_fwd").parent.parent / "flash_bwd" / "tuning.csv"}
    assert {tuning.user_table_path(name) for name in ("flash_bwd", *BWD)} == {cache_dir / "tuning" / "flash_bwd.csv"}
    assert tuning.user_table_path("flash_fwd") == cache_dir / "tuning" / "flash_fwd.csv"
    table = tuning.Table.parse(tuning.table_path("flash_bwd").read_text())
    assert all(r.kernel in BWD for r in table)
    with pytest.raises(ValueError, match="unknown kernel 'flash_bwd_dx'"):
        tuning.user_table_path("flash_bwd_dx")


def bwd_row(kernel: str, block_m: int, block_n: int, sq: int = 4096, sk: int = 4096) -> tuning.Row:
    return tuning.Row("sm_90", kernel, "bf16", 128, False, sq, sk, block_m, block_n, 8, 2, 0, 1.0, "test",
                      "2026-11-30")


def test_dispatch_reads_each_backward_kernels_own_rows_from_the_users_table(cache_dir: Path) -> None:
    user = tuning.user_table_path("flash_bwd_dq")
    user.parent.mkdir(parents=True)
    dq = bwd_row("flash_bwd_dq", 64, 64)
    user.write_text(tuning.Table([dq]).to_csv())
    config, used = dispatch.kernel_config("flash_bwd_dq", SM90, "bf16", 128, False, 4096, 4096)
    assert used == dq and (config.block_m, config.block_n, config.num_warps) == (64, 64, 8)
    config, used = dispatch.kernel_config("flash_bwd_dkdv", SM90, "bf16", 128, False, 4096, 4096)
    assert used is not None and used.kernel == "flash_bwd_dkdv", "a dq row is not a dK/dV row: the shipped one serves"
    assert (config.block_m, config.block_n) == (used.BLOCK_M, used.BLOCK_N)
    assert dispatch.kernel_config("flash_fwd", SM90, "bf16", 128, False, 4096, 4096)[1] != dq


@pytest.mark.parametrize("kernel", BWD)
def test_bwd_tune_candidates_fit_the_shape_and_the_target(kernel: str) -> None:
    from lazytriton.cli.tune import flash_bwd as tune_bwd
    from lazytriton.prewarm.limits import refusal

    for target in (SM90, Target.parse("sm_80"), Target.parse("sm_86"), Target.parse("gfx942")):
        for dtype, head_dim, (sq, sk) in itertools.product(("bf16", "fp32"), (64, 128, 256),
                                                           ((1, 4096), (4096, 1), (100, 100), (4096, 4096))):
            configs = tune_bwd.candidates(kernel, target, dtype, head_dim, sq, sk)
            assert configs[0] == bwd_dispatch.bwd_default_config(kernel, target, dtype, head_dim, sq, sk)
            assert len(set(configs)) == len(configs) > 0
            rows = tuning.bucket(sq if kernel == "flash_bwd_dq" else sk)
            for c in configs[1:]:
                held = c.block_m if kernel == "flash_bwd_dq" else c.block_n
                assert held <= max(16, rows), (kernel, sq, sk, c)
                v = dispatch.kernel_variant(kernel, target, dtype, head_dim, False, True, sq, sk, config=c)
                assert refusal(v) is None, v
    with pytest.raises(ValueError, match="kernel must be one of"):
        tune_bwd.candidates("flash_fwd", SM90, "bf16", 128, 16, 16)


@pytest.mark.parametrize("kernel", BWD)
def test_bwd_tune_candidates_at_head_dim_256_are_few_and_use_8_warps(kernel: str) -> None:
    """Head dim 256 (and the dims padded to it) takes its own list: the default first, at most 12 a kernel (a
    tune of hd256, 2 dtypes x causal x 3 seqlens, fits in minutes), 8-warp configs, no held tile of 128 in dK/dV
    (two 128 x 256 float32 accumulators spill at any warp count), and nothing over sm_90's shared memory. A split
    head dim padded to it (160, 192) also gets the 4-warp tiles of head dim 128's list, at most 20."""
    from lazytriton.cli.tune import flash_bwd as tune_bwd
    from lazytriton.prewarm.limits import refusal

    for dtype, head_dim, seqlen, causal in itertools.product(("bf16", "fp16"), (256, 192, 160, 224),
                                                             (1024, 4096, 16384), (False, True)):
        configs = tune_bwd.candidates(kernel, SM90, dtype, head_dim, seqlen, seqlen)
        assert configs[0] == bwd_dispatch.bwd_default_config(kernel, SM90, dtype, 256, seqlen, seqlen)
        split = geometry.split_head_dim(head_dim)
        width = sum(split) if split else 256
        assert len(set(configs)) == len(configs) <= (20 if split else 12)
        assert any(c.num_warps == 8 for c in configs)
        # A split head dim's accumulators are its own width (160, 192): it also gets the 4-warp tiles of the
        # head dims up to 128, which 256-wide accumulators would spill
        assert (Config(64, 64, 4, 3) in configs) == bool(split)
        for c in configs:
            v = dispatch.kernel_variant(kernel, SM90, dtype, head_dim, causal, True, seqlen, seqlen, config=c)
            assert refusal(v) is None, v
            held, streamed = (c.block_m, c.block_n) if kernel == "flash_bwd_dq" else (c.block_n, c.block_m)
            if kernel == "flash_bwd_dkdv":
                assert held <= 64, c
            # Triton 3.6 allocated at most (2 held + 2 streamed x stages) tiles at 2-3 stages (probe_bwd_regs.py):
            # bounded by 227 KiB, the launch cannot fail for shared memory (the default's 1 stage needs less).
            if c.num_stages >= 2:
                assert (2 * held + 2 * streamed * c.num_stages) * width * 2 <= 227 * 1024, c
    # Head dim 128 keeps its list; the 256 list is not a superset of it.
    assert tune_bwd.candidates(kernel, SM90, "bf16", 128, 4096, 4096) != tune_bwd.candidates(kernel, SM90, "bf16",
                                                                                                 256, 4096, 4096)


def test_bwd_large_default_proposal_is_a_candidate_and_fits() -> None:
    from lazytriton.cli.tune import flash_bwd as tune_bwd
    from lazytriton.prewarm.limits import refusal

    for target in (SM90, Target.parse("sm_80"), Target.parse("sm_86")):
        for kernel in BWD:
            proposal = tune_bwd.proposed_large_default(kernel, target)
            assert proposal.num_warps == 8
            v = dispatch.kernel_variant(kernel, target, "bf16", 256, False, True, 4096, 4096, config=proposal)
            assert refusal(v) is None
            if target == SM90:
                assert proposal in tune_bwd.candidates(kernel, target, "bf16", 256, 4096, 4096)
    assert tune_bwd.proposed_large_default("flash_bwd_dkdv", Target.parse("sm_86")).block_n == 32
    with pytest.raises(ValueError, match="kernel must be one of"):
        tune_bwd.proposed_large_default("flash_fwd", SM90)
    with pytest.raises(ValueError, match="target must be a CUDA target"):
        tune_bwd.proposed_large_default("flash_bwd_dq", Target.parse("gfx942"))


def test_bwd_tune_times_each_kernel_with_its_partner_fixed(tmp_path: Path) -> None:
    from lazytriton.cli.tune import flash_bwd as tune_bwd

    sweeps = tune_bwd.sweep_variants(SM90, "bf16", 128, False, 4096, 4096, table=tuning.Table(()))
    dq, dkdv = sweeps["flash_bwd_dq"], sweeps["flash_bwd_dkdv"]
    assert dq[0] == dispatch.kernel_variant("flash_bwd_dq", SM90, "bf16", 128, False, True, 4096, 4096,
                                            table=tuning.Table(()))
    assert len(dq) > 3 and len(dkdv) > 3
    # Made-up costs: each kernel's own time; the fastest dq candidate is wrong, one dK/dV candidate failed.
    cost = {str(v): 1.0 + i / 10 for vs in (dq, dkdv) for i, v in enumerate(reversed(vs))}
    wrong, failed = dq[-1], dkdv[-1]
    calls: list[tuple[str, str]] = []

    def time_pair(a: Variant, b: Variant) -> tuple[float, float]:
        calls.append((str(a), str(b)))
        return cost[str(a)] + cost[str(b)], 0.5 if a == wrong else 1e-3

    won = tune_bwd.tune_pair(sweeps, time_pair, 1e12, failed=frozenset({str(failed)}))
    best_dq, best_dkdv = dq[-2], dkdv[-2]  # the cheapest correct dq, and the cheapest dK/dV that compiled
    assert {k: v for k, (v, _) in won.items()} == {"flash_bwd_dq": best_dq, "flash_bwd_dkdv": best_dkdv}
    assert calls[:len(dq)] == [(str(v), str(dkdv[0])) for v in dq], "dq is timed with dK/dV held at dispatch's"
    assert calls[len(dq):] == [(str(best_dq), str(v)) for v in dkdv if v != failed], "then dK/dV on dq's winner"
    assert won["flash_bwd_dkdv"][1] == pytest.approx(1e12 / (cost[str(best_dq)] + cost[str(best_dkdv)]) / 1e9)
    only = tune_bwd.tune_pair(sweeps, time_pair, 1e12, kernels=("flash_bwd_dkdv",))
    assert list(only) == ["flash_bwd_dkdv"] and calls[-1][0] == str(dq[0])

    # The rows, written to the family's table, make dispatch pick exactly the winners.
    rows = [tune_bwd.row_for(v, 4096, 4096, tflops, "test", "2026-11-30", 128) for v, tflops in won.values()]
    path = tmp_path / "flash_bwd.csv"
    common.save_rows(path, [bwd_row("flash_bwd_dq", 16, 16, 16, 16)])
    common.save_rows(path, rows)
    table = tuning.Table.parse(path.read_text())
    assert len(table) == 3, "the other bucket's row is kept"
    for kernel, (variant, _) in won.items():
        assert dispatch.kernel_variant(kernel, SM90, "bf16", 128, False, True, 3008, 4000, table=table) == variant
    assert tune_bwd.pick([(dq[0], 1.0, 0.5)]) is None


def test_tune_kernel_flag(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the GPU host too: no real tune here
    assert tune.families_of(("flash_fwd", "flash_bwd_dkdv")) == {"flash_fwd": ("flash_fwd",),
                                                                  "flash_bwd": ("flash_bwd_dkdv",)}
    assert tune.families_of(BWD) == {"flash_bwd": BWD}
    assert tune.main(["--kernel", "flash_bwd"]) == 1  # no GPU: the work fails before it starts
    assert "needs" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune.main(["--kernel", "flash_bwd_dx"])
    assert "neither a kernel family" in capsys.readouterr().err


def test_bwd_tune_group_compiles_times_and_rows_only_the_kernels_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytriton.cli.tune import flash_bwd as tune_bwd

    compiled: list[Variant] = []

    def compile_all(variants: list[Variant], jobs: int) -> dict[str, str]:
        compiled.extend(variants)
        return {}

    def timer(inputs: dict[str, object], reps: int) -> tune_bwd.Timer:
        return lambda dq, dkdv: (1.0 + dkdv.get("BLOCK_M") / 1000 + dq.get("BLOCK_N") / 1000, 1e-3)

    monkeypatch.setattr(common, "compile_all", compile_all)
    monkeypatch.setattr(tune_bwd, "make_inputs", lambda *args: {"flops": 1e12})
    monkeypatch.setattr(tune_bwd, "gpu_timer", timer)
    pairs = [(4096, 4096), (16, 4096)]
    rows = tune_bwd.tune_group(SM90, "bf16", 128, True, pairs, 1, 1, "fake GPU", kernels=("flash_bwd_dkdv",))
    assert [(r.kernel, r.seqlen_q, r.seqlen_k, r.causal, r.gpu) for r in rows] == [
        ("flash_bwd_dkdv", 4096, 4096, True, "fake GPU"), ("flash_bwd_dkdv", 16, 4096, True, "fake GPU")]
    assert all(r.BLOCK_M == min(c.block_m for c in tune_bwd.candidates("flash_bwd_dkdv", SM90, "bf16", 128,
                                                                         r.seqlen_q, r.seqlen_k)) for r in rows)
    dq_compiled = [v for v in compiled if v.kernel == "flash_bwd_dq"]
    assert len(dq_compiled) == len(pairs), "dq only as the fixed partner, once per pair"


# --- a table read by group: what the runtime reads ------------------------------------------------------------


@pytest.mark.parametrize("family", ("flash_fwd", "flash_bwd"))
def test_a_table_read_by_group_holds_the_rows_parse_reads(family: str) -> None:
    text = tuning.table_path(family).read_text()
    whole = tuning.Table.parse(text)
    for group in {r.group for r in whole}:
        assert tuning.Table.parse_by_group(text).group(group) == whole.group(group)
    by_group = tuning.Table.parse_by_group(text)
    for r in whole:
        for sq, sk in ((1, 1), (r.seqlen_q, r.seqlen_k), (r.seqlen_q + 1, 3 * r.seqlen_k), (10**6, 10**6)):
            assert tuning.lookup(by_group, *r.group, sq, sk) == tuning.lookup(whole, *r.group, sq, sk)
    assert tuning.lookup(by_group, "sm_80", family, "bf16", 128, False, 1, 1) is None
    assert tuning.Table.parse_by_group(text).rows == whole.rows and len(by_group) == len(whole)
    assert tuning.Table.parse_by_group(text).to_csv() == whole.to_csv()
    reordered = "\n".join(",".join(reversed(line.split(","))) for line in text.splitlines())  # columns in any order
    assert tuning.Table.parse(reordered).rows == tuning.Table.parse_by_group(reordered).rows == whole.rows


def test_a_table_read_by_group_converts_only_the_groups_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    text = tuning.table_path("flash_fwd").read_text()
    plain, causal = ("sm_90", "flash_fwd", "bf16", 64, False), ("sm_90", "flash_fwd", "bf16", 64, True)
    rows = tuning.Table.parse(text).rows
    sizes = {group: sum(1 for r in rows if r.group == group) for group in (plain, causal)}
    converted: list[tuple[str, ...]] = []
    parse_values = tuning._parse_values

    def counted(texts: list[str], where: str) -> tuning.Row:
        converted.append(tuple(texts[:tuning._GROUP_COLUMNS]))
        return parse_values(texts, where)

    monkeypatch.setattr(tuning, "_parse_values", counted)
    table = tuning.Table.parse_by_group(text)
    assert converted == []
    assert tuning.lookup(table, *plain, 1500, 1500) is not None
    assert tuning.lookup(table, *plain, 448, 448) is not None  # converted once
    assert converted == [("sm_90", "flash_fwd", "bf16", "64", "0")] * sizes[plain]
    assert tuning.lookup(table, *causal, 448, 448) is not None
    assert len(converted) == sizes[plain] + sizes[causal] < len(rows) / 5


def test_a_table_read_by_group_refuses_a_bad_row_when_its_group_is_looked_up() -> None:
    good, bad = row(16, 16), row(16, 16, head_dim=64)
    lines = tuning.Table([good, bad]).to_csv().splitlines()
    at = next(i for i, line in enumerate(lines) if ",64," in line)
    lines[at] = lines[at].replace(",128,64,8,3,", ",96,64,8,3,")  # BLOCK_M 96: not a power of two
    text = "\n".join(lines) + "\n"
    table = tuning.Table.parse_by_group(text, "user.csv")
    assert tuning.lookup(table, *good.group, 16, 16) == good  # another group converts and serves
    with pytest.raises(ValueError, match=f"user.csv line {at + 1}: BLOCK_M=96 must be a power of two"):
        tuning.lookup(table, *bad.group, 16, 16)
    with pytest.raises(ValueError, match="BLOCK_M=96"):
        len(tuning.Table.parse_by_group(text))
    twice = tuning.Table([good]).to_csv() + tuning.Table([good]).to_csv().splitlines()[1] + "\n"
    with pytest.raises(ValueError, match="two rows"):
        tuning.lookup(tuning.Table.parse_by_group(twice), *good.group, 16, 16)
    head_dim = tuning.Table([good]).to_csv().replace(",128,", ",abc,", 1)
    with pytest.raises(ValueError, match="t.csv line 2: column head_dim has 'abc'"):  # a group column: at once
        tuning.Table.parse_by_group(head_dim, "t.csv")
    with pytest.raises(ValueError, match="lacks columns"):
        tuning.Table.parse_by_group("target,kernel\nsm_90,flash_fwd\n")


def test_a_rows_first_fields_are_its_group() -> None:
    names = [f.name for f in tuning.fields(tuning.Row)]
    assert tuple(names[:tuning._GROUP_COLUMNS]) == ("target", "kernel", "dtype", "head_dim", "causal")
    assert row(16, 16).group == tuple(getattr(row(16, 16), name) for name in names[:tuning._GROUP_COLUMNS])


def test_the_runtime_reads_the_shipped_table_by_group(cache_dir: Path) -> None:
    tuning._table_for.cache_clear()
    table = tuning.table_for("flash_fwd")
    assert table._rows is None and table._pending, "nothing converted before a lookup"
    tuning._table_for.cache_clear()
