"""PyTorch's scaled_dot_product_attention checked by attnproof, as a kernel author's test file would do it.

    pip install ./python torch pytest
    pytest python/examples/test_sdpa.py

Each case runs SDPA's math backend (the reference every fused kernel is compared with) forward and backward on CPU
tensors, and on CUDA tensors where a GPU is present, then checks O and the gradients against the oracle under the
math recipe's bound. The recipes: `bf16-in/f32-math` and `f16-in/f32-math` for bf16/f16 (SDPA's math backend widens
to f32), `f32-in/f32-acc` for f32. PyTorch's `is_causal=True` is top-left aligned, which the case states.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("ATTNPROOF_REQUIRE_TORCH"):  # the GPU bundle: torch must be there
    import torch
else:
    torch = pytest.importorskip("torch", reason="these examples check PyTorch's SDPA")
import attnproof  # noqa: E402

RECIPES = {torch.bfloat16: "bf16-in/f32-math", torch.float16: "f16-in/f32-math", torch.float32: "f32-in/f32-acc"}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sdpa_math(q, k, v, *, causal, groups):
    """SDPA forced onto its math backend (the one that runs everywhere), with the GQA heads expanded."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(RECIPES))
@pytest.mark.parametrize(
    "batch, heads_q, heads_kv, len_q, len_k, head_dim",
    [(1, 2, 2, 64, 64, 32), (2, 3, 1, 17, 40, 16), (1, 4, 2, 129, 65, 64)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_forward_and_backward(attention_check, device, dtype, batch, heads_q, heads_kv, len_q, len_k, head_dim, causal):
    if causal and len_q > len_k:
        pytest.skip("top-left causal with Lq > Lk leaves rows with no key, for which SDPA's math backend gives NaN")
    generator = torch.Generator().manual_seed(len_q * 1000 + len_k)
    shape_q, shape_kv = (batch, heads_q, len_q, head_dim), (batch, heads_kv, len_k, head_dim)
    q, k, v = (torch.randn(s, generator=generator).to(device, dtype) for s in (shape_q, shape_kv, shape_kv))
    d_out = torch.randn(shape_q, generator=generator).to(device, dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = sdpa_math(q, k, v, causal=causal, groups=heads_q // heads_kv)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), d_out)
    attention_check(
        q, k, v, o, None, d_out, dq, dk, dv, causal=causal, causal_align="top_left", recipe=RECIPES[dtype]
    )


@pytest.mark.parametrize("device", DEVICES)
def test_a_wrong_scale_is_caught(device):
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 48, 32, generator=generator).to(device, torch.bfloat16) for _ in range(3))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0 / 32)
    with pytest.raises(AssertionError, match="wrong scale"):
        attnproof.assert_attention_close(q, k, v, o, recipe="bf16-in/f32-math")


def tf32_sensitive(len_q, len_k, head_dim, generator):
    """f32 inputs on which TF32 shows: every query element 1 + 3*2^-12 (TF32 moves it by 2^-12 or more), keys of
    negative scores, and a last key (the maximum in the last tile) that TF32 moves coherently, carrying most of the
    weight; Gaussian values."""
    q = torch.full((1, 2, len_q, head_dim), 1 + 3 * 2.0**-12)
    k = 0.3 * torch.randn(1, 2, len_k, head_dim, generator=generator) - 0.35
    k[:, :, -1, :] = 1.5 + 4.5 * 2.0**-12
    v = torch.randn(1, 2, len_k, head_dim, generator=generator)
    return q, k, v


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 is a mode of CUDA's tensor cores")
@pytest.mark.parametrize("len_k", [64, 128, 256, 300])
def test_tf32_fails_the_f32_recipe_once_the_kernel_is_stated(len_k):
    """SDPA's math backend on CUDA f32 tensors, its matmuls in full f32 and then in TF32 (`allow_tf32`): stating the
    kernel's parameters (one softmax over all keys: one tile of Lk keys, no split), the f32 run passes `f32-in/f32-acc`,
    the TF32 run fails it with TF32 named, and passes `f32-in/tf32`. The lengths are ones where cuBLAS picks a tensor-
    core kernel for the TF32 run (at 1 or 65 keys it ran f32 kernels, bit for bit the f32 run, which rightly passes)."""
    q, k, v = (x.cuda() for x in tf32_sensitive(16, len_k, 32, torch.Generator().manual_seed(len_k)))
    stated = {"kv_tile": len_k, "split_kv": 1}
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        outputs = {}
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                outputs[tf32] = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    attnproof.assert_attention_close(q, k, v, outputs[False], recipe="f32-in/f32-acc", kernel_params=stated)
    assert not torch.equal(outputs[True], outputs[False]), "cuBLAS ran no TF32 kernel at this length"
    with pytest.raises(AssertionError, match="TF32"):
        attnproof.assert_attention_close(q, k, v, outputs[True], recipe="f32-in/f32-acc", kernel_params=stated)
    attnproof.assert_attention_close(q, k, v, outputs[True], recipe="f32-in/tf32", kernel_params=stated)
