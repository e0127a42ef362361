"""The tuning table: parsing, the pure lookup, dispatch's use of it, and tune's pure parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from lazytriton import dispatch, tuning
from lazytriton.cli import tune
from lazytriton.target import Target

HEADER = ",".join(tuning.COLUMNS)


def row(sq: int, sk: int, block_m: int = 128, target: str = "sm_90", dtype: str = "bf16", head_dim: int = 128,
        causal: bool = False) -> tuning.Row:
    return tuning.Row(target, "flash_fwd", dtype, head_dim, causal, sq, sk, block_m, 64, 8, 3, 0, 400.0,
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


def test_dispatch_uses_the_row_else_the_default() -> None:
    table = tuning.Table([row(4096, 4096, 64)])
    target = Target.parse("sm_90")
    config, used = dispatch.flash_fwd_config(target, "bf16", 100, False, 3000, 3000, table)
    assert used == row(4096, 4096, 64) and (config.block_m, config.num_warps) == (64, 8)
    variant = dispatch.flash_fwd_variant(target, "bf16", 128, False, True, 3000, seqlen_k=3000, table=table)
    assert variant.get("BLOCK_M") == 64
    config, used = dispatch.flash_fwd_config(target, "fp16", 128, False, 3000, 3000, table)
    assert used is None and config == dispatch.default_config(target, "fp16", 128, 3000, False)


def test_tune_candidates_fit_the_shape() -> None:
    for dtype in ("bf16", "fp16", "fp32"):
        for head_dim in (64, 128, 256):
            for sq in (1, 16, 100, 4096):
                configs = tune.candidates(dtype, head_dim, sq)
                assert configs
                assert all(c.block_m <= max(16, tuning.bucket(sq)) for c in configs)
                if head_dim == 256 or dtype == "fp32":
                    assert all(c.block_m * c.block_n <= 64 * 64 for c in configs)


def test_tune_merge_replaces_only_the_same_buckets(tmp_path: Path) -> None:
    old = tuning.Table([row(16, 16, 16), row(4096, 4096, 64), row(4096, 4096, 64, dtype="fp16")])
    merged = tuning.merge(old, [row(4096, 4096, 128)])
    assert len(merged) == 3
    assert tuning.lookup(merged, "sm_90", "flash_fwd", "bf16", 128, False, 4096, 4096).BLOCK_M == 128
    assert tuning.lookup(merged, "sm_90", "flash_fwd", "fp16", 128, False, 4096, 4096).BLOCK_M == 64
    path = tmp_path / "tuning.csv"
    tune.write_table(path, merged)
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
    text, error = tune._resolve(str(variant))
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
    config, used = dispatch.flash_fwd_config(Target.parse("sm_90"), "bf16", 128, False, 4096, 4096)
    assert used == row and (config.block_m, config.block_n) == (32, 32), "the user's row wins over the shipped one"
    user.write_text("not,a,table\n")
    tuning._table_for.cache_clear()  # the tables are read once per process
    config, used = dispatch.flash_fwd_config(Target.parse("sm_90"), "bf16", 128, False, 4096, 4096)
    assert used is not None and used.gpu != "test", "a damaged user table leaves the shipped one serving"
