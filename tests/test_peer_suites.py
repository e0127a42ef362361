"""benchmarks/peer_suites.py and its pytest plugin (tests/peers/shim/peer_plugin.py), on a made-up peer.

The selection is a pure function of the node ids and the seed (the same cases on every machine and run); the
summary counts each case once and groups failures by their first line with the numbers taken out; a run of the
runner over a fake checkout finds the shim before the peer's own interface file, the peer's helpers beside it,
CUDA tensors on the CPU with --device cpu, and ends a hanging case at --timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "peers" / "shim"))
from peer_select import Case, parse_shard, rank, select  # noqa: E402 (the shim's folder is on the path first)
from peer_summary import Results, markdown, normalise  # noqa: E402

RUNNER = REPO / "benchmarks" / "peer_suites.py"


def _cases(functions: dict[str, int]) -> list[Case]:
    return [Case(name, f"t.py::{name}[{i}-{i * 7}]", {"seqlen_q": i, "d": 64})
            for name, count in functions.items() for i in range(count)]


def test_rank_is_a_fixed_hash_of_seed_and_node_id() -> None:
    assert rank("test_flash_attn.py::test_flash_attn_output[1-1-64]", 0) == 0.36803108500914405
    assert rank("x", 7) == 0.4274836215312036
    assert rank("x", 8) != rank("x", 7)


def test_the_sample_is_deterministic_and_per_function() -> None:
    cases = _cases({"test_a": 400, "test_b": 3, "test_c": 1})
    kept = select(cases, fraction=0.1, seed=3)
    assert select(cases[::-1], fraction=0.1, seed=3) == kept[::-1]  # the same cases, whatever the order
    assert kept == select(cases, fraction=0.1, seed=3)
    assert kept != select(cases, fraction=0.1, seed=4)
    by_function = {name: sum(1 for n in kept if n.startswith(f"t.py::{name}[")) for name in ("test_a", "test_b",
                                                                                             "test_c")}
    assert 20 <= by_function["test_a"] <= 60  # about 40 of 400
    assert by_function["test_b"] >= 1 and by_function["test_c"] == 1  # at least one case of every function
    assert kept == [c.nodeid for c in cases if c.nodeid in set(kept)]  # collection order


def test_fraction_every_and_bounds() -> None:
    cases = _cases({"test_a": 10, "test_b": 4})
    assert select(cases, fraction=1.0) == [c.nodeid for c in cases]
    assert len(select(cases, fraction=0.0, min_per_function=2)) == 4
    assert select(cases, fraction=0.0, min_per_function=0) == []
    assert select(cases, every=4) == ["t.py::test_a[0-0]", "t.py::test_a[4-28]", "t.py::test_a[8-56]",
                                      "t.py::test_b[0-0]"]
    assert select(cases, max_seqlen=2) == [c.nodeid for c in cases if c.params["seqlen_q"] <= 2]
    with pytest.raises(ValueError, match="fraction"):
        select(cases, fraction=1.5)
    with pytest.raises(ValueError, match="every"):
        select(cases, every=-1)


def test_shards_split_the_sample_once_between_them() -> None:
    cases = _cases({"test_a": 300, "test_b": 40, "test_c": 1})
    whole = select(cases, fraction=0.5, seed=2)
    shards = [select(cases, fraction=0.5, seed=2, shard=k, shards=3) for k in range(3)]
    assert sorted(n for shard in shards for n in shard) == sorted(whole)  # every kept case in exactly one shard
    assert all(set(a).isdisjoint(b) for i, a in enumerate(shards) for b in shards[i + 1:])
    assert all(35 <= len(shard) <= 80 for shard in shards), [len(s) for s in shards]  # about 170 / 3 each
    assert select(cases[::-1], fraction=0.5, seed=2, shard=1, shards=3) == shards[1][::-1]  # whatever the order
    assert shards[0] == [n for n in whole if n in set(shards[0])]  # collection order
    assert select(cases, fraction=0.5, seed=2, shard=0, shards=1) == whole
    with pytest.raises(ValueError, match="shard"):
        select(cases, shard=3, shards=3)


@pytest.mark.parametrize("text,parsed", [("0/1", (0, 1)), ("2/3", (2, 3)), ("3/3", None), ("-1/2", None),
                                         ("1", None), ("a/b", None), ("0/0", None)])
def test_a_shard_is_k_of_n(text: str, parsed: tuple[int, int] | None) -> None:
    if parsed is None:
        with pytest.raises(ValueError, match="K/N"):
            parse_shard(text)
    else:
        assert parse_shard(text) == parsed


def test_the_summary_groups_failures_by_their_first_line() -> None:
    results = Results()
    results.record("f.py::test_a[0]", "failed", "AssertionError: assert 0.0123 <= 2 * 0.004\nmore")
    results.record("f.py::test_a[1]", "failed", "AssertionError: assert 1.5e-03 <= 2 * 0.1")
    results.record("f.py::test_b[0]", "failed", "NotImplementedError: lazytriton.flash_attn_func has no qv=")
    results.record("f.py::test_b[1]", "skipped", "Has Qv requires hdim 64")
    results.record("f.py::test_b[2]", "passed")
    results.record("f.py::test_b[2]", "errored", "RuntimeError: teardown")  # after the call passed
    results.record("f.py::test_b[3]", "passed")
    summary = results.summary(suite="fake")
    assert summary["totals"] == {"passed": 1, "failed": 3, "skipped": 1, "errored": 1}
    assert summary["functions"] == {"test_a": {"passed": 0, "failed": 2, "skipped": 0, "errored": 0},
                                    "test_b": {"passed": 1, "failed": 1, "skipped": 1, "errored": 1}}
    first = summary["failures"][0]
    assert (first["message"], first["count"], first["functions"]) == (
        "AssertionError: assert # <= # * #", 2, {"test_a": 2})
    assert first["example"] == "AssertionError: assert 0.0123 <= 2 * 0.004"
    assert summary["skips"][0]["message"] == "Has Qv requires hdim #"
    assert summary["cases"]["f.py::test_b[2]"] == "errored"
    text = markdown(summary)
    assert "| test_a | 0 | 2 | 0 | 0 |" in text and "lazytriton.flash_attn_func has no qv=" in text
    assert normalise("\n  x = -3, y = 4.5\nz") == "x = #, y = #"
    with pytest.raises(ValueError, match="outcome"):
        results.record("f.py::t", "timeout")


FAKE_TEST = '''
import time

import pytest
import torch

from flash_attn_interface import MissingFeature, flash_attn_with_kvcache  # the shim's, not hopper's
from test_util import helper  # the peer's own helper, beside its test file

CAPABILITY = torch.cuda.get_device_capability("cuda")


@pytest.mark.parametrize("seqlen_q", [1, 2, 3, 4, 5, 6, 7, 8])
def test_passes(seqlen_q):
    x = torch.randn(seqlen_q, device="cuda")
    assert x.device.type == "cpu" and helper() == 42 and CAPABILITY == (9, 0)


@pytest.mark.parametrize("seqlen_q", [10, 20, 30])
def test_missing(seqlen_q):
    q = torch.randn(1, seqlen_q, 2, 32, device="cuda")
    flash_attn_with_kvcache(q, q, q, q_descale=q)


@pytest.mark.parametrize("d", [64, 128])
def test_fails(d):
    assert d <= 0.5 * d, "the error is too large"


def test_skips():
    pytest.skip("needs hdim 64")


def test_hangs():
    time.sleep(3600)
'''


def fake_peer(root: Path) -> Path:
    hopper = root / "hopper"
    hopper.mkdir(parents=True)
    (hopper / "__init__.py").write_text("")
    (hopper / "test_flash_attn.py").write_text(textwrap.dedent(FAKE_TEST))
    (hopper / "test_util.py").write_text("def helper():\n    return 42\n")
    (hopper / "flash_attn_interface.py").write_text("raise ImportError('the peer interface, not the shim')\n")
    (root / ".peer-commit").write_text("0123abc\n")
    return root


def run_runner(peer: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = subprocess.run([sys.executable, str(RUNNER), "run", "--peer-dir", str(peer), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=900, check=False)
    summary = out / "peer_fa3.json"
    assert summary.is_file(), f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done, json.loads(summary.read_text())


@pytest.mark.slow
def test_a_run_over_a_fake_peer(tmp_path: Path) -> None:
    peer = fake_peer(tmp_path / "peer")
    done, summary = run_runner(peer, tmp_path / "out", "--device", "cpu", "--sample", "1.0", "--timeout", "0",
                               "--", "-k", "not hangs")
    assert done.returncode == 1, done.stdout + done.stderr  # some cases fail
    assert summary["totals"] == {"passed": 8, "failed": 5, "skipped": 1, "errored": 0}, summary
    assert (summary["suite"], summary["peer_commit"], summary["device"]) == ("fa3", "0123abc", "cpu")
    assert summary["selection"]["collected"] == summary["selection"]["selected"] == 14
    groups = {g["message"]: g for g in summary["failures"]}
    missing = ("peer_shim_common.MissingFeature: lazytriton.flash_attn_with_kvcache has no q_descale= (the peer "
               "passed one)")
    assert groups[missing]["count"] == 3
    assert groups["AssertionError: the error is too large"]["functions"] == {"test_fails": 2}
    assert summary["skips"][0]["message"] == "needs hdim #"
    assert (tmp_path / "out" / "peer_fa3.md").read_text().startswith("# fa3")


@pytest.mark.slow
def test_the_sample_of_a_run_is_the_same_every_run(tmp_path: Path) -> None:
    peer = fake_peer(tmp_path / "peer")
    args = ("--device", "cpu", "--sample", "0.4", "--seed", "5", "--timeout", "0", "--", "-k", "passes")
    _, first = run_runner(peer, tmp_path / "one", *args)
    _, second = run_runner(peer, tmp_path / "two", *args)
    assert first["cases"] == second["cases"]
    assert 1 <= len(first["cases"]) < 8 and set(first["cases"].values()) == {"passed"}
    nodeids = [f"test_flash_attn.py::test_passes[{n}]" for n in range(1, 9)]
    cases = [Case("test_passes", nodeid, {}) for nodeid in nodeids]
    assert sorted(first["cases"]) == sorted(select(cases, fraction=0.4, seed=5))


@pytest.mark.slow
def test_the_shards_of_a_run_run_each_case_once(tmp_path: Path) -> None:
    peer = fake_peer(tmp_path / "peer")
    args = ("--device", "cpu", "--sample", "1.0", "--timeout", "0")
    seen: list[str] = []
    for k in range(2):
        out = tmp_path / f"shard{k}"
        done = subprocess.run([sys.executable, str(RUNNER), "run", "--peer-dir", str(peer), "--out", str(out), *args,
                               "--shard", f"{k}/2", "--", "-k", "passes"],
                              capture_output=True, text=True, timeout=900, check=False)
        summary = json.loads((out / f"peer_fa3_shard{k}of2.json").read_text())
        assert summary["shard"] == f"{k}/2", summary
        seen += list(summary["cases"])
    assert sorted(seen) == sorted(f"test_flash_attn.py::test_passes[{n}]" for n in range(1, 9)), done.stdout


@pytest.mark.slow
def test_a_spent_budget_skips_the_cases_left_and_still_writes_the_summary(tmp_path: Path) -> None:
    peer = fake_peer(tmp_path / "peer")
    # A budget spent before pytest has started: every case is over it, whatever the machine's speed.
    _, summary = run_runner(peer, tmp_path / "out", "--device", "cpu", "--sample", "1.0", "--timeout", "0",
                            "--budget", "1e-6", "--", "-k", "passes")
    assert set(summary["cases"].values()) == {"skipped"} and len(summary["cases"]) == 8, summary["cases"]
    assert summary["selection"]["over_budget"] == 8
    assert summary["skips"][0]["message"] == "not run: the run's --budget was spent"


@pytest.mark.slow
def test_under_xdist_the_summary_still_counts_the_collected_and_selected_cases(tmp_path: Path) -> None:
    pytest.importorskip("xdist", reason="pytest-xdist is in the test extras")
    peer = fake_peer(tmp_path / "peer")
    _, summary = run_runner(peer, tmp_path / "out", "--device", "cpu", "--sample", "0.5", "--seed", "5",
                            "--timeout", "0", "--", "-n", "2", "-k", "passes")
    selection = summary["selection"]
    assert selection["collected"] == 8 and selection["selected"] == len(summary["cases"]) < 8, selection


@pytest.mark.slow
def test_a_hanging_case_ends_at_the_timeout(tmp_path: Path) -> None:
    peer = fake_peer(tmp_path / "peer")
    _, summary = run_runner(peer, tmp_path / "out", "--device", "cpu", "--timeout", "1", "--", "-k", "hangs")
    assert summary["totals"]["failed"] == 1, summary
    assert summary["failures"][0]["message"] == "peer_plugin.PeerTimeout: the case ran past --peer-timeout"
    assert summary["timed_out"] == 1


def test_a_timeout_wrapped_by_tritons_interpreter_is_grouped_as_a_timeout() -> None:
    results = Results()
    wrapped = ("triton.runtime.errors.InterpreterError: InterpreterError('InterpreterError(\"PeerTimeout(\\'the "
               "case ran past --peer-timeout\\')\")')")
    results.record("f.py::test_a[0]", "failed", wrapped)
    results.record("f.py::test_a[1]", "failed", "peer_plugin.PeerTimeout: the case ran past --peer-timeout")
    results.record("f.py::test_a[2]", "failed", "AssertionError: assert 1 <= 0")
    summary = results.summary()
    assert summary["timed_out"] == 2 and summary["failures"][0]["count"] == 2
    assert summary["failures"][0]["message"] == "peer_plugin.PeerTimeout: the case ran past --peer-timeout"
    assert "Timed out (among the failed and errored): 2" in markdown(summary)


def test_the_runner_names_a_missing_checkout(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(RUNNER), "run", "--peer-dir", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode != 0 and "--peer-dir" in done.stderr and "hopper/test_flash_attn.py" in done.stderr


# The census: hand-written cases of each suite with the verdict their parameters give.
import peer_census  # noqa: E402
import torch  # noqa: E402

FA3_OUT = {"seqlen_q": 113, "seqlen_k": 203, "d": 128, "V_colmajor": False, "causal": True, "local": True,
           "softcap": 0.0, "deterministic": False, "has_qv": False, "mha_type": "gqa", "dtype": "bfloat16"}
FA3_KV = {"seqlen_q": 1, "seqlen_k": 128, "d": 128, "varlen_q": False, "has_batch_idx": False, "has_leftpad": True,
          "page_size": 4, "rotary_fraction": 0.0, "rotary_interleaved": False, "has_rotary_seqlens": False,
          "seqlen_new_eq_seqlen_q": True, "causal": False, "local": True, "new_kv": True, "mha_type": "mha",
          "dtype": "float8_e4m3fn"}


@pytest.mark.parametrize(("suite", "function", "params", "status", "gaps", "features"), [
    ("fa3", "test_flash_attn_output", FA3_OUT, "expressible", (), ("window-list", "attention-chunk")),
    ("fa3", "test_flash_attn_output", {**FA3_OUT, "d": 64}, "expressible", (),
     ("v-pieces", "window-list", "head-dim-v", "attention-chunk")),
    ("fa3", "test_flash_attn_output", {**FA3_OUT, "d": 64, "has_qv": True}, "expressible", (),
     ("window-list", "qv", "qv-chunk", "head-dim-v", "attention-chunk")),
    ("fa3", "test_flash_attn_output", {**FA3_OUT, "d": 64, "dtype": "float8_e4m3fn"}, "expressible", (),
     ("window-list", "fp8-forward", "attention-chunk")),
    ("fa3", "test_flash_attn_output", {**FA3_OUT, "has_qv": True}, "skipped", (), ()),
    ("fa3", "test_flash_attn_varlen_output", {**FA3_OUT, "d": 64, "seqlen_q": 307, "seqlen_k": 256,
                                              "add_unused_qkv": True}, "expressible", (),
     ("v-pieces", "window-tensor", "head-dim-v", "attention-chunk", "seqused")),
    ("fa3", "test_flash_attn_varlen_output", {**FA3_OUT, "d": 64, "seqlen_q": 307, "seqlen_k": 256,
                                              "add_unused_qkv": True, "has_qv": True}, "expressible", (),
     ("window-tensor", "qv", "qv-seqused", "head-dim-v", "attention-chunk", "seqused")),
    ("fa3", "test_flash_attn_varlen_output", {**FA3_OUT, "d": 64, "seqlen_q": 113, "seqlen_k": 256,
                                              "add_unused_qkv": True, "has_qv": True}, "expressible", (),
     ("window-tensor", "qv", "qv-chunk", "qv-seqused", "head-dim-v", "attention-chunk", "seqused")),
    ("fa3", "test_flash_attn_kvcache", FA3_KV, "expressible", (),
     ("window-tensor", "attention-chunk", "fp8-q-kvcache", "rotary-seqlens-unused", "paged", "kvcache-index")),
    ("fa3", "test_flash_attn_kvcache", {**FA3_KV, "seqlen_k": 339}, "skipped", (), ()),
    ("fa3", "test_flash3_bw_compatibility", {}, "gap", ("op-schemas",), ()),
    ("fa2", "test_flash_attn_output", {"softcap": 50.0, "dropout_p": 0.17, "local": True}, "skipped", (), ()),
    ("fa2", "test_flash_attn_varlen_qkvpacked", {"dropout_p": 0.17, "local": True, "alibi": True}, "expressible",
     (), ("dropout-s-dmask", "window-tensor", "alibi")),
    ("fa2", "test_flash_attn_varlen_causal", {"local": False, "paged_kv_block_size": 256}, "expressible", (),
     ("paged-varlen",)),
    ("fa2", "test_flash_attn_generator_arg_must_be_none", {}, "gap", ("fa2-private-ops",), ()),
    ("fa2", "test_flash_attn_unknown", {"d": 64}, "expressible", (), ()),
])
def test_census_rules_classify_known_cases(suite: str, function: str, params: dict[str, Any], status: str,
                                           gaps: tuple[str, ...], features: tuple[str, ...]) -> None:
    verdict = peer_census.classify(suite, function, params)
    assert (verdict.status, verdict.gaps, verdict.features) == (status, gaps, features)


def test_census_counts_per_function_and_rule() -> None:
    cases = [{"function": "test_flash_attn_output", "params": p} for p in
             (FA3_OUT, {**FA3_OUT, "d": 64, "has_qv": True}, {**FA3_OUT, "has_qv": True}, {**FA3_OUT, "local": False})]
    cases.append({"function": "test_flash3_bw_compatibility", "params": {}})
    result = peer_census.census("fa3", cases)
    assert result["totals"] == {"collected": 5, "skipped": 1, "run": 4, "expressible": 3}
    assert result["gaps"]["op-schemas"]["count"] == 1 and result["features"]["window-list"]["count"] == 2
    assert result["features"]["qv-chunk"]["count"] == 1
    text = peer_census.markdown(result)
    assert "| test_flash_attn_output | 4 | 1 | 3 | 3 | 100.00% |" in text and "- op-schemas: 1 (25.00%)" in text
    assert peer_census.plain({"dtype": torch.float8_e4m3fn, "pair": (1, None), "x": object}) == {
        "dtype": "float8_e4m3fn", "pair": [1, None], "x": repr(object)}


def test_the_census_command_reads_collected_cases(tmp_path: Path) -> None:
    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps({"nodeid": "t.py::test_flash_attn_output[x]", "function": "test_flash_attn_output",
                                 "params": FA3_OUT}) + "\n")
    done = subprocess.run([sys.executable, str(RUNNER), "census", "--suite", "fa3", "--cases", str(cases), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, check=True)
    assert "| **total** | 1 | 0 | 1 | 1 | 100.00% |" in done.stdout
    assert json.loads((tmp_path / "census_fa3.json").read_text())["totals"]["expressible"] == 1


@pytest.mark.slow
def test_the_plugin_writes_the_collected_cases(tmp_path: Path) -> None:
    peer = fake_peer(tmp_path / "peer")
    out = tmp_path / "out"
    run_runner(peer, out, "--device", "cpu", "--", "--collect-only", "--peer-collect", str(tmp_path / "c.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(rows) == 15 and rows[0] == {"nodeid": "test_flash_attn.py::test_passes[1]", "function": "test_passes",
                                           "params": {"seqlen_q": 1}}


KVCACHE_TEST = '''
import pytest


@pytest.mark.parametrize("seqlen_q", [1, 2, 3])
def test_flash_attn_kvcache(seqlen_q):
    assert seqlen_q > 0


def test_flash_attn_output():
    raise AssertionError("not in the kvcache suite")
'''


@pytest.mark.slow
def test_the_fa3_kvcache_suite_runs_the_kvcache_function_of_fa3s_file(tmp_path: Path) -> None:
    peer = tmp_path / "peer"
    (peer / "hopper").mkdir(parents=True)
    (peer / "hopper" / "test_flash_attn.py").write_text(textwrap.dedent(KVCACHE_TEST))
    # FlashAttention-3's hopper/test_kvcache.py is a benchmark script: collecting it would parse pytest's argv
    (peer / "hopper" / "test_kvcache.py").write_text("import sys\nsys.exit(2)\n")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(RUNNER), "run", "--peer-dir", str(peer), "--suite", "fa3-kvcache",
                           "--device", "cpu", "--sample", "1.0", "--timeout", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "peer_fa3-kvcache.json").read_text())
    assert summary["totals"] == {"passed": 3, "failed": 0, "skipped": 0, "errored": 0}, summary
    assert set(summary["functions"]) == {"test_flash_attn_kvcache"}


TORCH_TEST = '''
import unittest

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize
from test_cpp_extensions_open_device_registration import generate_faked_module


class TestSDPAFake(TestCase):
    @parametrize("seq_len_q", [3, 5, 900])
    def test_fused_vs_math(self, seq_len_q):
        g = torch.Generator().manual_seed(seq_len_q)
        q, k, v = (torch.randn(1, 2, seq_len_q, 16, generator=g) for _ in range(3))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)

    def test_fused_float64(self):
        q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
        F.scaled_dot_product_attention(q, q, q)

    def test_fused_misuse_raises_as_torch(self):
        q = torch.randn(1, 2, 4, 8)
        with self.assertRaises(RuntimeError):
            F.scaled_dot_product_attention(q, q[:, :1, :, :6], q)

    def test_wrong_answer(self):
        q = torch.randn(1, 2, 4, 8)
        self.assertEqual(F.scaled_dot_product_attention(q, q, q).sum().item(), 12345.0)

    def test_torch_only(self):
        self.assertEqual(1 + 1, 2)

    def test_private_use(self):
        generate_faked_module()


instantiate_parametrized_tests(TestSDPAFake)
'''


@pytest.mark.slow
def test_the_torch_suite_routes_fused_calls_to_lazytriton_and_counts_them(tmp_path: Path) -> None:
    pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (the test extras have it)")
    peer = tmp_path / "pytorch"
    (peer / "test").mkdir(parents=True)
    (peer / "test" / "test_transformers.py").write_text(textwrap.dedent(TORCH_TEST))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(RUNNER), "run", "--peer-dir", str(peer), "--suite", "torch",
                           "--device", "cpu", "--sample", "1.0", "--max-seqlen", "128", "--timeout", "0", "--out",
                           str(out)], capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 1, done.stdout + done.stderr  # the float64 gap and the wrong answer fail
    summary = json.loads((out / "peer_torch.json").read_text())
    assert summary["totals"] == {"passed": 4, "failed": 2, "skipped": 1, "errored": 0}, summary
    assert summary["functions"]["TestSDPAFake::test_fused_vs_math"]["passed"] == 2  # grouped: 900 keys dropped
    census = json.loads((out / "peer_torch_census.json").read_text())
    assert census["counts"] == {"run": 6, "skipped": 1, "fails_with_torch_alone": 0, "timed_out": 0, "torch_only": 1,
                                "through_lazytriton": 5, "gap": 1, "serves_what_torch_refuses": 0,
                                "expressible": 4, "expressible_passed": 3, "expressible_failed": 1}, census
    refusal = "SDPATypeError: query must be float16, bfloat16 or float32, got torch.float64"
    assert census["gaps"][0]["refusal"] == refusal
    assert census["expressible_failed"] == ["test_transformers.py::TestSDPAFake::test_wrong_answer"]
    assert "expressible 4 of 5 (80.0%)" in done.stdout


@pytest.mark.parametrize(("device_type", "dtype", "fused"), [
    ("cuda", torch.float64, False),  # no fused CUDA backend takes it: torch serves it by its math, so does the route
    ("cuda", torch.float32, True),  # memory-efficient attention's
    ("cuda", torch.bfloat16, True),
    ("cpu", torch.float64, True),  # torch's CPU flash backend takes it: lazytriton's refusal is a gap
    ("cpu", torch.float16, True),
    ("privateuseone", torch.float64, True),  # another device type: the context's flags alone
])
def test_the_torch_route_sends_what_no_fused_backend_takes_to_torch(device_type: str, dtype: Any,
                                                                    fused: bool) -> None:
    sys.path.insert(0, str(REPO / "tests" / "peers" / "shim_torch"))
    import torch_route

    assert torch_route.fused_dtype(device_type, dtype) is fused


def test_the_torch_census_leaves_out_torchs_own_failures_and_timeouts() -> None:
    sys.path.insert(0, str(REPO / "tests" / "peers" / "shim_torch"))
    import route_census

    outcomes = {"f::a": "failed", "f::b": "failed", "f::c": "passed", "f::d": "failed", "f::e": "skipped",
                "f::g": "failed"}
    routes = [{"nodeid": "f::a", "lazytriton": 1, "torch": 1, "refused": []},
              {"nodeid": "f::b", "lazytriton": 2, "torch": 0, "refused": []},
              {"nodeid": "f::c", "lazytriton": 1, "torch": 1, "refused": ["SDPAError: misuse, as torch refuses"]},
              {"nodeid": "f::d", "lazytriton": 1, "torch": 0, "refused": ["SDPATypeError: no float64 (1, 2)"]},
              {"nodeid": "f::g", "lazytriton": 1, "torch": 0, "refused": ["SDPATypeError: no float64 (3, 4)"]}]
    census = route_census.routed(outcomes, routes, baseline={"f::a": "failed", "f::c": "failed"},
                                 timed_out=["f::b"])
    assert census["counts"] == {"run": 5, "skipped": 1, "fails_with_torch_alone": 1, "timed_out": 1,
                                "torch_only": 0, "through_lazytriton": 3, "gap": 2, "serves_what_torch_refuses": 0,
                                "expressible": 1,
                                "expressible_passed": 1, "expressible_failed": 0}
    assert census["gaps"] == [{"refusal": "SDPATypeError: no float64 (#, #)", "count": 2,
                               "cases": ["f::d", "f::g"]}]
    assert "- expressible 1 of 3 (33.3%): passed 1, failed 0" in route_census.routed_markdown(census)


def test_the_torch_census_lists_the_cases_lazytriton_serves_where_the_test_expects_torchs_refusal() -> None:
    sys.path.insert(0, str(REPO / "tests" / "peers" / "shim_torch"))
    import route_census

    outcomes = {"f::fp32_on_flash": "failed", "f::wrong": "failed", "f::gap": "failed", "f::fine": "passed"}
    routes = [{"nodeid": n, "lazytriton": 1, "torch": 0, "refused": []} for n in ("f::fp32_on_flash", "f::wrong")]
    routes += [{"nodeid": "f::gap", "lazytriton": 1, "torch": 0, "refused": ["SDPATypeError: no float64"]},
               {"nodeid": "f::fine", "lazytriton": 1, "torch": 0, "refused": []}]
    # f::gap's expected error did not come either, but lazytriton refused a call there: still a gap
    census = route_census.routed(outcomes, routes, unraised=["f::fp32_on_flash", "f::gap"])
    counts = census["counts"]
    assert (counts["serves_what_torch_refuses"], counts["gap"], counts["expressible"]) == (1, 1, 2), counts
    assert census["serves_what_torch_refuses"] == ["f::fp32_on_flash"]
    assert census["expressible_failed"] == ["f::wrong"]
    assert "- served what torch refuses 1" in route_census.routed_markdown(census)


@pytest.mark.parametrize(("message", "unraised"), [
    ("AssertionError: RuntimeError not raised by <lambda>", True),
    ("AssertionError: RuntimeError not raised", True),
    ("AssertionError: UserWarning not triggered", True),
    ("Failed: DID NOT RAISE <class 'RuntimeError'>", True),
    ('AssertionError: "No available kernel" does not match "Internal error"', False),
    ("AssertionError: Tensor-likes are not close!", False),
])
def test_a_missing_expected_error_is_told_from_other_failures(message: str, unraised: bool) -> None:
    results = Results()
    results.record("f.py::test_a[0]", "failed", message)
    assert results.summary()["unraised_cases"] == (["f.py::test_a[0]"] if unraised else [])


def test_after_a_case_the_cached_gpu_memory_goes_back_to_the_card(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(REPO / "tests" / "peers" / "shim"))
    import peer_plugin

    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    peer_plugin.release_cached_memory()  # CUDA never used here: nothing to give back, nothing initialised
    assert emptied == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    peer_plugin.release_cached_memory()
    assert emptied == [True]
