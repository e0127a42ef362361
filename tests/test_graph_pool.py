"""Warm paths and CUDA graphs' private pools: nothing a call keeps comes from a graph's pool.

cudagraph trees (``torch.compile(mode="reduce-overhead")``) warm a graph up and record it with its allocations
in the graph's own pool, and refuse a block of that pool that no output holds ("tensor(s) in the cudagraph pool
not tracked as outputs"). The warm path's entries keep no device memory (kernels/flash_fwd/hot.py: the lse
template is on the host), and what it keeps on the device is never made during a capture. On a GPU: a fresh
process (no plan, no entry before the compiled calls) compiles the public calls with "reduce-overhead" and runs
them with torch's pool check after every step; and an entry first described inside a ``torch.cuda.graph``
capture keeps no CUDA tensor. The same for the FP8 forward without descales (a null pointer, no 1.0 kept on
the device), for the decoding call with the fused combine (the torch op's calls take counters of their own), and
for transformers' compiled decoding steps on a StaticCache through the integration (its mask-derived tensors).
The CPU checks of the same rules are in test_hot.py, test_fp8_fwd.py, test_fp8_hot.py and
test_kvcache_fused_combine.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_python
from test_flash_fwd import make_qkv, on_gpu
from test_hot import kept_tensors
from test_interface import check_replay

import lazytriton
from lazytriton.kernels.flash_fwd import hot

# A fresh process: the dense calls (flash_attn_func, the SDPA drop-in) and the packed one with out= compiled with
# "reduce-overhead", forward only, each run on new inputs and held against the eager calls (hot.py's warm path
# after the first). slow_path_cudagraph_asserts makes cudagraph trees check its pool after each warm-up, recording
# and replay.
FRESH = """
import json, sys
import torch
import torch._inductor.config as inductor_config
import lazytriton

inductor_config.triton.slow_path_cudagraph_asserts = True
dtype = getattr(torch, DTYPE)
b, s, h, d = 2, 128, 4, 64


def dense(q, k, v):
    a = lazytriton.flash_attn_func(q, k, v, causal=True)
    t = lazytriton.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                is_causal=True)
    return a.float(), t.transpose(1, 2).float()


def packed(q, k, v, cu):
    out = torch.empty_like(q)
    lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=True, out=out)
    return out.float()


compiled_dense = torch.compile(dense, fullgraph=True, mode="reduce-overhead")
compiled_packed = torch.compile(packed, fullgraph=True, mode="reduce-overhead")
cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
steps = []
with torch.no_grad():
    for step in range(4):
        torch.manual_seed(step)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
        got = [t.clone() for t in compiled_dense(q, k, v)]
        want = dense(q, k, v)
        flat = [t.flatten(0, 1) for t in (q, k, v)]
        got.append(compiled_packed(*flat, cu).clone())
        want = (*want, packed(*flat, cu))
        torch.cuda.synchronize()
        steps.append([bool(torch.allclose(g, w, atol=2e-3, rtol=2e-3)) for g, w in zip(got, want)])
print(json.dumps({"steps": steps, "hot": "lazytriton.kernels.flash_fwd.hot" in sys.modules}))
"""


@on_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_reduce_overhead_in_a_fresh_process_keeps_nothing_in_the_graph_pool(dtype: str) -> None:
    done = run_python(f"DTYPE = {dtype!r}\n" + FRESH, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert "not tracked as outputs" not in done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] == [[True, True, True]] * 4, report
    assert report["hot"], "the eager calls between the compiled ones took the warm path"


@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_an_entry_first_described_in_a_capture_keeps_no_cuda_tensor(dtype: torch.dtype) -> None:
    q, k, v = make_qkv(1, (4, 2), (200, 333), 64, dtype, device="cuda", seed=5)  # a shape no other test describes
    lazytriton.preload(q, k, causal=True)  # the plan, and no warm entry yet
    static = [t.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = lazytriton.attn_fwd(*static, causal=True)  # hot.forward_bhsd describes the shape here
        out_only = lazytriton.scaled_dot_product_attention(*static, is_causal=True, enable_gqa=True)  # output_bhsd
    entries = [entry for name in ("forward_bhsd", "output_bhsd")
               for key, entry in getattr(hot, name).__globals__["SHAPES"].items()
               if key[0] == q.shape and key[6] is dtype]
    assert len(entries) == 2, "both warm paths described the shape during the capture"
    kept = kept_tensors(entries)
    assert kept and not any(t.is_cuda for t in kept), [(t.shape, t.device) for t in kept]
    check_replay(graph, static, make_qkv(1, (4, 2), (200, 333), 64, dtype, device="cuda", seed=6), out, out_only)


# A fresh process: the FP8 forward without descales (flash_attn_func, attn_fwd) compiled with "reduce-overhead",
# no preload, each step on new inputs and held against the eager calls bit for bit (the largest difference, 0).
FRESH_FP8 = """
import json
import torch
import torch._inductor.config as inductor_config
import lazytriton

inductor_config.triton.slow_path_cudagraph_asserts = True
b, s, h, d = 2, 256, 4, 128


def fp8(q, k, v):
    a = lazytriton.flash_attn_func(q, k, v, causal=True)
    t, lse = lazytriton.attn_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal="bottom_right")
    return a.float(), t.transpose(1, 2).float(), lse


compiled = torch.compile(fp8, fullgraph=True, mode="reduce-overhead")
steps = []
with torch.no_grad():
    for step in range(4):
        torch.manual_seed(step)
        q, k, v = (torch.randn(b, s, h, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        got = [t.clone() for t in compiled(q, k, v)]
        want = fp8(q, k, v)
        torch.cuda.synchronize()
        steps.append([float((g - w).abs().max()) for g, w in zip(got, want)])
print(json.dumps({"steps": steps}))
"""


@on_gpu
def test_gpu_fp8_without_descales_under_reduce_overhead_keeps_nothing_in_the_graph_pool() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the FP8 forward needs sm_90+ (refused elsewhere: test_fp8_fwd.py)")
    done = run_python(FRESH_FP8, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert "not tracked as outputs" not in done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] == [[0.0, 0.0, 0.0]] * 4, report


# A fresh process: a decoding call with the fused combine (several splits: it takes counters) compiled with
# "reduce-overhead", each step on new lengths and held against the eager call bit for bit; the eager calls keep
# one counter buffer (their stream's), the compiled calls none.
FRESH_FUSED = """
import json
import torch
import torch._inductor.config as inductor_config
import lazytriton
from lazytriton.kernels.flash_decode import counters, dispatch

inductor_config.triton.slow_path_cudagraph_asserts = True
dispatch.FUSED_COMBINE_BY_DEFAULT = True
b, capacity, hq, hk, d = 4, 4096, 32, 8, 128


def decode(q, k_cache, v_cache, lens):
    out, lse = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=8,
                                                  return_softmax_lse=True)
    return out.float(), lse


compiled = torch.compile(decode, fullgraph=True, mode="reduce-overhead")
k_cache, v_cache = (torch.randn(b, capacity, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
steps = []
with torch.no_grad():
    for step in range(4):
        torch.manual_seed(step)
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.randint(1, capacity + 1, (b,), device="cuda", dtype=torch.int32)
        got = [t.clone() for t in compiled(q, k_cache, v_cache, lens)]
        want = decode(q, k_cache, v_cache, lens)
        torch.cuda.synchronize()
        steps.append([float((g - w).abs().max()) for g, w in zip(got, want)])
kept = [(key[1], int(t.abs().sum())) for key, t in counters.COUNTERS.buffers.items()]
print(json.dumps({"steps": steps, "kept": kept, "stream": torch.cuda.current_stream().cuda_stream}))
"""


@on_gpu
def test_gpu_fused_combine_under_reduce_overhead_keeps_nothing_in_the_graph_pool() -> None:
    done = run_python(FRESH_FUSED, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert "not tracked as outputs" not in done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] == [[0.0, 0.0]] * 4, report
    assert report["kept"] == [[report["stream"], 0]], "one buffer, the eager calls' stream's, all zero"


# A fresh process: a small random Llama (bf16, GQA 8/2 heads of 64) generating from a left-padded batch with a
# StaticCache whose decoding steps transformers compiles with "reduce-overhead" (CUDA graphs), once with
# attn_implementation="sdpa" and once with "lazytriton", each compiled afresh; two generate calls each (the second
# with other prompts and padding: the integration's mask-derived tensors are made anew). slow_path_cudagraph_asserts
# makes cudagraph trees check their pool after each warm-up, recording and replay. Prints, per call, how far
# lazytriton's tokens agree with sdpa's, the largest score difference over the agreeing steps, and where they
# first differ, sdpa's gap between its own token and lazytriton's (a tie if small).
FRESH_HF = """
import json
import torch
import torch._inductor.config as inductor_config
import transformers
from lazytriton.integrations import transformers as lt_transformers

inductor_config.triton.slow_path_cudagraph_asserts = True
lt_transformers.register()
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                  intermediate_size=1024, num_hidden_layers=2, vocab_size=1000, pad_token_id=0)
model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
prompts = []
for seed, lengths in ((1, (12, 7)), (2, (5, 16))):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, 1000, (n,), generator=g)
        mask[row, width - n:] = 1
    prompts.append((ids.cuda(), mask.cuda()))
compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
outs = {}
for impl in ("sdpa", "lazytriton"):
    torch._dynamo.reset()
    model.set_attn_implementation(impl)
    outs[impl] = []
    with torch.no_grad():
        for ids, mask in prompts:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                                 cache_implementation="static", compile_config=compile_config)
            outs[impl].append(([s.float().cpu() for s in out.scores], out.sequences[:, ids.shape[1]:].cpu()))
report = []
for (want_scores, want), (got_scores, got) in zip(outs["sdpa"], outs["lazytriton"]):
    for row in range(want.shape[0]):
        agree, diff, gap = 0, 0.0, None
        for step in range(want.shape[1]):
            seen = torch.isfinite(want_scores[step][row])  # min_new_tokens masks the end token with -inf
            diff = max(diff, float((got_scores[step][row] - want_scores[step][row])[seen].abs().max()))
            if got[row, step] != want[row, step]:
                gap = float(want_scores[step][row][want[row, step]] - want_scores[step][row][got[row, step]])
                break
            agree += 1
        report.append({"agree": agree, "of": want.shape[1], "score_diff": diff, "tie_gap": gap})
print(json.dumps(report))
"""


@on_gpu
def test_gpu_transformers_static_cache_under_reduce_overhead_keeps_nothing_in_the_graph_pool() -> None:
    """transformers' compiled decoding steps (StaticCache, CUDA graphs) through lazytriton: cudagraph trees' pool
    checks pass in every step of two generate calls, and the tokens are sdpa's (or part where sdpa saw a tie)."""
    pytest.importorskip("transformers", reason="transformers is not installed (GPU host: carry .whl-hf)")
    done = run_python(FRESH_HF, timeout=600, safe_path=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert "not tracked as outputs" not in done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 4, report
    for row in report:
        assert row["score_diff"] < 0.25, report  # bf16 logits of a random model: a few ulps at their magnitude
        assert row["agree"] == row["of"] or row["tie_gap"] < 0.1, report
