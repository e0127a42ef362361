"""Dropout's random stream: curand's Philox4_32_10, the one PyTorch's memory-efficient attention draws from.

The kernels keep element n of a call's mask when element ``offset + n`` of curand's stream for ``seed`` (word n % 4
of Philox 4x32-10 at counter n // 4, made a float as ``curand_uniform`` does) is above p, and on a CUDA device the
[seed, offset] pair is torch's CUDA generator's, advanced as torch advances it for that backend. So after the same
``torch.manual_seed`` lazytriton and torch drop the same elements. Here: the Philox reference against Random123's
known answers, the uniform's endpoints, the generator's bookkeeping with a fake generator (CPU), and on a GPU the
mask bit for bit against torch's ``_fill_mem_eff_dropout_mask_`` and the output against torch's memory-efficient
backend after the same seed.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_flash_fwd import on_gpu

import lazytriton
from lazytriton.kernels.flash_fwd import score_mods
from lazytriton.kernels.flash_fwd.reference import dropout_keep, philox4x32, philox_uniform

# Random123's kat_vectors, the three philox4x32 10 lines: counter, key, result.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize(("counter", "key", "result"), KNOWN_ANSWERS)
def test_philox_gives_random123s_known_answers(counter: tuple[int, ...], key: tuple[int, int],
                                               result: tuple[int, ...]) -> None:
    words = philox4x32(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
    assert [int(w) for w in words] == list(result)


def test_the_stream_is_philox_four_words_a_counter_made_uniform_as_curand_does() -> None:
    seed = 0x0123456789ABCDEF
    n = torch.arange(40, dtype=torch.int64) + (2**33 - 8)  # counters whose high word is 1 and 2
    blocks = n >> 2
    zero = torch.zeros_like(blocks)
    words = philox4x32((blocks & 0xFFFFFFFF, blocks >> 32, zero, zero), (seed & 0xFFFFFFFF, seed >> 32))
    expected = torch.stack(words).gather(0, (n & 3)[None])[0].double() * 2.0**-32 + 2.0**-33
    assert torch.equal(philox_uniform(seed, n), expected.float())
    u = philox_uniform(seed, torch.arange(1 << 14, dtype=torch.int64))
    assert u.dtype == torch.float32 and 0.0 < float(u.min()) and float(u.max()) <= 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_a_seed_of_64_bits_keeps_its_bits_through_the_signed_pair() -> None:
    seed = 0xF0E1D2C3B4A59687  # above 2**63: torch's int64 tensor holds it negative
    signed = seed - 2**64
    pair = torch.tensor([signed, 12], dtype=torch.int64)
    keep = dropout_keep(pair, (1, 1, 4, 8), 0.5)
    assert torch.equal(keep.flatten(), philox_uniform(seed, torch.arange(32, dtype=torch.int64) + 12) > 0.5)


class FakeGenerator:
    """The three methods of torch's CUDA generator that ``generator_pair`` uses."""

    def __init__(self, seed: int, offset: int = 0) -> None:
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


@pytest.mark.parametrize(("elements", "advance"), [(0, 0), (1, 4), (4, 4), (5, 8), (2 * 3 * 17 * 19, 1940)])
def test_the_generator_gives_its_seed_and_offset_and_moves_past_the_mask(elements: int, advance: int) -> None:
    generator = FakeGenerator(42, 8)
    assert score_mods.generator_pair(generator, elements) == (42, 8)
    assert generator.offset == 8 + advance  # rounded up to 4, as torch's philox_cuda_state rounds


def test_a_large_seed_comes_back_signed_with_its_bits() -> None:
    generator = FakeGenerator(2**64 - 5)
    assert score_mods.generator_pair(generator, 1) == (-5, 0)


def test_threads_drawing_at_once_get_disjoint_ranges() -> None:
    generator = FakeGenerator(7)
    got: list[int] = []
    lock = threading.Lock()

    def draw() -> None:
        for _ in range(200):
            _, offset = score_mods.generator_pair(generator, 16)
            with lock:
                got.append(offset)

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(0, 800 * 16, 16)) and generator.offset == 800 * 16


def test_on_the_cpu_the_pair_is_drawn_by_torch_and_manual_seed_reproduces_it() -> None:
    torch.manual_seed(5)
    first = score_mods.draw_philox(torch.device("cpu"), 100)
    torch.manual_seed(5)
    again = score_mods.draw_philox(torch.device("cpu"), 100)
    assert first.dtype == torch.int64 and first.shape == (2,) and torch.equal(first, again)
    assert 0 <= int(first.min()) and int(first.max()) < 2**62


def test_the_calls_count_their_masks_entries() -> None:
    q = torch.empty(10, 4, 8)
    assert score_mods.packed_elements(q, torch.empty(7, 2, 8)) == 10 * 4 * 7
    assert score_mods.packed_elements(q, torch.empty(7, 8)) == 0  # the call's checks refuse it, not this
    assert score_mods.packed_elements("q", q) == 0


@on_gpu
@pytest.mark.parametrize("shape", [(2, 3, 37, 53), (1, 2, 128, 256), (3, 1, 1, 9)])
def test_gpu_the_mask_is_torchs_memory_efficient_mask_bit_for_bit(shape: tuple[int, int, int, int]) -> None:
    b, h, sq, sk = shape
    p = 0.3
    torch.manual_seed(42)
    pair = score_mods.draw_philox(torch.device("cuda"), b * h * sq * sk)
    assert [int(x) for x in pair.cpu()] == [42, 0]
    ours = dropout_keep(pair, shape, p)
    theirs = torch.empty(shape, device="cuda", dtype=torch.float32)
    theirs = torch._fill_mem_eff_dropout_mask_(theirs, p, 42, 0) > p
    assert torch.equal(ours, theirs)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_sdpa_with_dropout_is_torchs_memory_efficient_backend_after_the_same_seed(dtype: torch.dtype) -> None:
    """PyTorch's own test (``test_mem_efficient_attention_vs_math_ref_grads``) in small: the same seed, the same
    mask, so the outputs agree to rounding, and the generator ends where torch's leaves it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 200, 64, device="cuda", generator=gen, dtype=dtype) for _ in range(3))
    torch.manual_seed(42)
    ours = lazytriton.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    ours_state = torch.cuda.get_rng_state()
    torch.manual_seed(42)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert torch.equal(ours_state, torch.cuda.get_rng_state())
    atol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
    torch.manual_seed(43)
    other = lazytriton.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert (other - theirs).abs().max() > 10 * atol  # another seed, another mask
