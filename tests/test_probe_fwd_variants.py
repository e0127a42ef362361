"""experiments/probe_fwd_variants.py on CPU: what it loads and runs each variant at (its timing needs sm_90)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import load_experiment

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    return load_experiment("probe_fwd_variants")


def test_a_variant_file_gives_its_own_kernel_function(probe: ModuleType) -> None:
    from lazytriton.kernels.flash_fwd import gluon_kernel

    kernel = probe.load_kernel(str(REPO / "kernels" / "flash_fwd" / "gluon_kernel.py"))
    assert kernel is not gluon_kernel.flash_fwd_gluon_kernel  # a module of its own: the file's source, compiled apart
    assert kernel.fn.__name__ == "flash_fwd_gluon_kernel"


def test_variants_run_at_dispatchs_ping_pong_row_or_the_non_causal_ones(probe: ModuleType) -> None:
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

    tiles, q_tiles = probe.tiling_for(128, True, 4096, 0)
    row = fwd_dispatch.flash_fwd_gluon_default("bf16", 128, True, 4096)
    assert row is not None and tiles == row[0]
    assert q_tiles == fwd_dispatch.gluon_q_tiles(128, True, 4096, tiles[0])
    # Head dim 64 causal has no ping-pong row at 1k (flash_fwd serves): the non-causal row's tiles and count.
    tiles, q_tiles = probe.tiling_for(64, True, 1024, 0)
    assert (tiles, q_tiles) == (fwd_dispatch.flash_fwd_gluon_default("bf16", 64, False, 1024)[0],  # type: ignore[index]
                                fwd_dispatch.gluon_q_tiles(64, False, 1024, tiles[0]))
    assert probe.tiling_for(64, True, 1024, 2)[1] == 2
    # From 4k the wide tiles serve it (not ping-pong): the ping-pong tiles, the non-causal count.
    assert probe.tiling_for(64, True, 4096, 0) == ((128, 128, 4), fwd_dispatch.gluon_q_tiles(64, False, 4096, 128))


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_is_float32_attention_of_the_first_heads(probe: ModuleType, causal: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 48, 16, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q[0, :2].float(), k[0, :2].float(), v[0, :2].float(),
                                                            is_causal=causal)
    torch.testing.assert_close(probe.reference(q, k, v, causal), want, atol=1e-5, rtol=1e-5)
