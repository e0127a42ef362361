"""The C API refuses calls whose outputs share memory, and bad settings, as invalid arguments.

A kernel writes its outputs while other programs still read its inputs: out
over q, lse inside out, out rows on one address (a stride of 0), dq over q,
a decoding call's out over its cache are refused with
LT_ERROR_INVALID_ARGUMENT (1) and a message naming both tensors, before
anything runs. Views of one buffer that share no element (FlashAttention's
packed dqkv, a cache whose keys and values interleave) are still served, with
the Python API's results. A ``~user`` that names no home directory, in a
setting or in lt_config, is an invalid argument too, never LT_ERROR_PYTHON.
The library is built once (module fixture) and driven from a Python process
through ctypes, as tests/test_capi.py does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from capilib import IN_PROCESS_PRELUDE, exit_ok, report_of, run_program

from lazytriton.capi import build, embedded

ALIASING = IN_PROCESS_PRELUDE + r"""
def run(kind, tensors, **options):
    p = ffi.new(f"lt_attn_{kind}_params *")
    assert call(f"lt_attn_{kind}_params_init", p) == 0
    for name, t in tensors.items():
        describe(getattr(p, name), t)
    for name, value in options.items():
        setattr(p, name, value)
    return [call(f"lt_attn_{kind}", p, ffi.NULL), dll.lt_last_error().decode()]

torch.manual_seed(0)
report = {}
q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
lse = torch.empty(1, 2, 8)
report["out_is_q"] = run("fwd", {"q": q, "k": k, "v": v, "out": q, "lse": lse})
rows = torch.empty(1, 2, 1, 16).expand(1, 2, 8, 16)  # stride 0: every row at one address
report["out_rows_one_address"] = run("fwd", {"q": q, "k": k, "v": v, "out": rows, "lse": lse})
out = torch.empty(1, 2, 8, 16)
report["lse_inside_out"] = run("fwd", {"q": q, "k": k, "v": v, "out": out, "lse": out.view(-1)[:16].view(1, 2, 8)})
report["lse_is_k"] = run("fwd", {"q": q, "k": k, "v": v, "out": out, "lse": k.view(-1)[:16].view(1, 2, 8)})
# q and out interleaved in one buffer (b, h, s, 2, d), no element shared: served, as attn_fwd computes it.
buf = torch.randn(1, 2, 8, 2, 16)
qi, oi = buf[..., 0, :], buf[..., 1, :]
want_out, want_lse = lazytriton.attn_fwd(qi.clone(), k, v)
report["interleaved"] = run("fwd", {"q": qi, "k": k, "v": v, "out": oi, "lse": lse})
report["interleaved_equal"] = torch.equal(oi, want_out) and torch.equal(lse, want_lse)

# Backward: dq over q refused; dq, dk, dv in one packed dqkv buffer (b, s, 3, h, d) served.
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
fo, flse = lazytriton.attn_fwd(*leaves)
do = torch.randn_like(fo)
wanted = torch.autograd.grad(fo, leaves, do)
fo, flse = fo.detach(), flse.detach()
def bwd(grads, delta=None):
    names = {"q": q, "k": k, "v": v, "out": fo, "lse": flse, "dout": do, "dq": grads[0], "dk": grads[1],
             "dv": grads[2], "delta": torch.empty(1, 2, 8) if delta is None else delta}
    return run("bwd", names)
report["dq_is_q"] = bwd([q, torch.empty_like(k), torch.empty_like(v)])
report["delta_is_lse"] = bwd([torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)], delta=flse)
dqkv = torch.full((1, 8, 3, 2, 16), 7.0)
grads = [dqkv[:, :, i].transpose(1, 2) for i in range(3)]
report["dqkv"] = bwd(grads)
report["dqkv_equal"] = all(torch.equal(a, b) for a, b in zip(grads, wanted))

# Decoding: out over the cache it reads refused; keys and values interleaved in one paged cache, appended: served.
qd = torch.randn(1, 1, 2, 16)
kc, vc = torch.randn(1, 32, 1, 16), torch.randn(1, 32, 1, 16)
lens = torch.tensor([5], dtype=torch.int32)
report["out_is_cache"] = run("kvcache", {"q": qd, "k_cache": kc, "v_cache": vc, "cache_seqlens": lens,
                                         "out": kc.view(-1)[:32].view(1, 1, 2, 16), "lse": torch.empty(1, 2, 1)})
pages = torch.zeros(4, 2, 16, 1, 16)  # (blocks, k/v, page, heads_k, head_dim)
table = torch.tensor([[1, 3]], dtype=torch.int32)
kn, vn = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
mine = {"q": qd, "k_cache": pages[:, 0], "v_cache": pages[:, 1], "k": kn, "v": vn, "block_table": table,
        "cache_seqlens": lens}
clones = {"q": qd, "k_cache": pages[:, 0].clone(), "v_cache": pages[:, 1].clone(), "k": kn, "v": vn,
          "block_table": table, "cache_seqlens": lens}
want = lazytriton.flash_attn_with_kvcache(**clones, return_softmax_lse=True)
outd, lsed = torch.empty(1, 1, 2, 16), torch.empty(1, 2, 1)
report["interleaved_cache"] = run("kvcache", {**mine, "out": outd, "lse": lsed})
report["interleaved_cache_equal"] = (torch.equal(outd, want[0]) and torch.equal(lsed, want[1])
                                     and torch.equal(pages[:, 0], clones["k_cache"])
                                     and torch.equal(pages[:, 1], clones["v_cache"]))
report["lse_inside_out_kvcache"] = run("kvcache", {**clones, "out": outd, "lse": outd.view(-1)[:2].view(1, 2, 1)})

# lt_config's cache_dir naming a user with no home directory.
cfg = ffi.new("lt_config *")
assert call("lt_config_init", cfg) == 0
keep = ffi.new("char[]", b"~nosuchuser-lazytriton/x")
cfg.cache_dir = keep
report["config_cache_dir"] = [call("lt_init", cfg), dll.lt_last_error().decode()]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def aliasing(prefix: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[object] | bool]:
    cache = tmp_path_factory.mktemp("alias-cache")
    return report_of(ALIASING, prefix, env={"LAZYTRITON_CACHE_DIR": str(cache)})  # type: ignore[no-any-return]


@pytest.mark.parametrize(("case", "needle"), [
    ("out_is_q", "out shares memory with q"),
    ("out_rows_one_address", "out's sizes and strides put several of its elements at one address"),
    ("lse_inside_out", "out and lse share memory"),
    ("lse_is_k", "lse shares memory with k"),
    ("dq_is_q", "dq shares memory with q"),
    ("delta_is_lse", "delta shares memory with lse"),
    ("out_is_cache", "out shares memory with k_cache"),
    ("lse_inside_out_kvcache", "out and lse share memory"),
])
def test_outputs_that_share_memory_are_invalid_arguments(aliasing: dict[str, list[object]], case: str,
                                                         needle: str) -> None:
    status, message = aliasing[case]
    assert status == 1 and needle in str(message), (status, message)


@pytest.mark.parametrize("case", ["interleaved", "dqkv", "interleaved_cache"])
def test_views_of_one_buffer_that_share_no_element_are_served(aliasing: dict[str, object], case: str) -> None:
    assert aliasing[case][0] == 0, aliasing[case]  # type: ignore[index]
    assert aliasing[f"{case}_equal"] is True


def test_a_config_cache_dir_of_no_users_home_is_an_invalid_argument(aliasing: dict[str, list[object]]) -> None:
    status, message = aliasing["config_cache_dir"]
    assert status == 1 and "config.cache_dir" in str(message) and "~nosuchuser-lazytriton" in str(message)


def test_settings_of_expands_home_and_names_a_missing_user(monkeypatch: pytest.MonkeyPatch) -> None:
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(build.header_cdef((build.HERE / "lazytriton.h").read_text()))
    monkeypatch.setattr(embedded, "_ffi", ffi)
    monkeypatch.setenv("HOME", "/home/someone")
    cfg = ffi.new("lt_config *")
    keep = [ffi.new("char[]", b"~/cache"), ffi.new("char[]", b"~/a.ltimg:/b"), ffi.new("char[]", b"~nosuchuser-lt/x")]
    cfg.cache_dir, cfg.images = keep[0], keep[1]
    assert embedded.settings_of(cfg) == {"cache_dir": "/home/someone/cache", "images": ["/home/someone/a.ltimg", "/b"]}
    cfg.cache_dir = keep[2]
    with pytest.raises(ValueError, match="config.cache_dir is '~nosuchuser-lt/x'"):
        embedded.settings_of(cfg)
    cfg.cache_dir, cfg.images = keep[0], keep[2]
    with pytest.raises(ValueError, match="config.images"):
        embedded.settings_of(cfg)


def test_a_setting_naming_no_users_home_is_an_invalid_argument(prefix: Path) -> None:
    code = (f"import ctypes; lib = ctypes.CDLL({str(prefix / 'lib/liblazytriton.so')!r}); "
            "lib.lt_last_error.restype = ctypes.c_char_p; status = lib.lt_init(None); "
            "print(status, lib.lt_last_error().decode())")
    for variable in ("LAZYTRITON_CACHE_DIR", "LAZYTRITON_IMAGES"):
        out = exit_ok(run_program([sys.executable, "-c", code], env={variable: "~nosuchuser-lazytriton/x"}))
        status, _, message = out.strip().partition(" ")
        assert status == "1" and variable in message, out


def test_classify_maps_a_settings_error_to_an_invalid_argument() -> None:
    from lazytriton.config import SettingsError

    assert embedded.classify(SettingsError("LAZYTRITON_CACHE_DIR: bad")) == (1, "LAZYTRITON_CACHE_DIR: bad")
