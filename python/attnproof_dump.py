"""Write attnproof case files: one safetensors file per attention call, read by `cargo xtask check`.

The format is documented in docs/case-format.md. Depends on torch and safetensors only.
"""

from __future__ import annotations

import math

import torch
from safetensors.torch import save_file

FORMAT_VERSION = "1"
CAUSAL_ALIGNS = ("bottom_right", "top_left")
LSE_BASES = ("e", "2")
MASKED_LSES = ("-inf", "+inf")
KERNEL_PARAMS = ("kv_tile", "q_tile", "mma_k", "exp", "split_kv")
STORAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A detached, contiguous CPU copy that owns its storage (safetensors refuses shared storage)."""
    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.to("cpu").contiguous().clone()


def dump_case(
    path,
    q,
    k,
    v,
    *,
    o=None,
    lse=None,
    do=None,
    dq=None,
    dk=None,
    dv=None,
    causal=False,
    causal_align="bottom_right",
    scale=None,
    recipe="bf16-in/f32-acc/p-bf16",
    kernel="",
    lse_base="e",
    window_left=None,
    window_right=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    block_indices=None,
    block_q=None,
    block_k=None,
    token_indices=None,
    masked_lse="-inf",
    kernel_params=None,
    extra_metadata=None,
):
    """Writes one case to `path`.

    q, k, v: `[B, H, L, D]` (layout `bhld`) or packed `[T, H, D]` with int32 `cu_seqlens_q` and
    `cu_seqlens_k` (layout `thd`). `lse`: `[B, Hq, Lq]` (or `[Hq, Tq]`), stored as float32, in
    base `lse_base`. `scale=None` means the default `1/sqrt(d)`, which is then written out as a
    number. `block_indices`: int32 `[B, Hq, ceil(Lq/block_q), width]` KV-block lists, -1 padded.
    `token_indices`: int32 `[B*Lq or Tq, list heads, k]` key lists per query row (DSA's selection, FlashMLA's sparse
    indices), -1 for an unused slot, any order; list heads 1, Hkv or Hq.
    `masked_lse`: what the kernel writes as the LSE of a row that sees no key ("-inf", or "+inf" for
    FlashAttention 2 and 3 and the kernels built on them). `kernel_params`: the kernel's real
    parameters, any of kv_tile, q_tile, mma_k, exp ("ex2" or "expf"), split_kv, written as
    `kernel_<name>` so that the bound uses them instead of the worst case.
    """
    if q.dim() == 4:
        layout = "bhld"
    elif q.dim() == 3:
        layout = "thd"
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("packed [T,H,D] inputs need cu_seqlens_q and cu_seqlens_k")
    else:
        raise ValueError(f"q must be [B,H,L,D] or [T,H,D], got shape {tuple(q.shape)}")
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(f"causal_align must be one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    if lse_base not in LSE_BASES:
        raise ValueError(f"lse_base must be one of {LSE_BASES}, got {lse_base!r}")
    if masked_lse not in MASKED_LSES:
        raise ValueError(f"masked_lse must be one of {MASKED_LSES}, got {masked_lse!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in STORAGE_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; expected bf16, f16 or f32")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    tensors = {"q": _host(q), "k": _host(k), "v": _host(v)}
    for name, t in (("o", o), ("do", do), ("dq", dq), ("dk", dk), ("dv", dv)):
        if t is not None:
            tensors[name] = _host(t)
    if lse is not None:
        tensors["lse"] = _host(lse, torch.float32)
    # The int32 tensors, stored as int32 whatever the caller passed.
    integer_tensors = {
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
        "block_indices": block_indices,
        "token_indices": token_indices,
    }
    for name, t in integer_tensors.items():
        if t is not None:
            tensors[name] = _host(torch.as_tensor(t), torch.int32)

    metadata = {
        "format_version": FORMAT_VERSION,
        "layout": layout,
        "causal": "true" if causal else "false",
        "causal_align": causal_align,
        "scale": repr(float(scale)),
        "lse_base": lse_base,
        "recipe": recipe,
        "kernel": kernel,
        "masked_lse": masked_lse,
    }
    for name, value in (kernel_params or {}).items():
        if name not in KERNEL_PARAMS:
            raise ValueError(f"kernel_params: unknown parameter {name!r} (known: {', '.join(KERNEL_PARAMS)})")
        metadata[f"kernel_{name}"] = str(value)
    if window_left is not None:
        metadata["window_left"] = str(int(window_left))
    if window_right is not None:
        metadata["window_right"] = str(int(window_right))
    if block_indices is not None:
        if block_q is None or block_k is None:
            raise ValueError("block_indices needs block_q and block_k")
        metadata["block_q"] = str(int(block_q))
        metadata["block_k"] = str(int(block_k))
    for key, value in (extra_metadata or {}).items():
        metadata[str(key)] = str(value)
    save_file(tensors, str(path), metadata=metadata)
    return path
