"""Dump attnproof case files from PyTorch's attention peers: SDPA (flash, cuDNN, efficient, math)
and FlexAttention (dense, and block-sparse through a `BlockMask` whose lists become the case's
`block_indices`), forward and backward, over a small grid with adversarial inputs, plus
deliberately wrong uses whose metadata lies (they must fail `cargo xtask check`).

    python3 python/examples/dump_peers.py --out DIR [--only LABEL_PREFIX]

Each backend section is guarded: a backend that is unavailable or refuses a shape prints one
`skip ...` line and the others continue. Writes DIR/*.safetensors and DIR/manifest.txt.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from attnproof_dump import dump_case  # noqa: E402

RECIPE = {torch.bfloat16: "bf16-in/f32-acc/p-bf16", torch.float16: "f16-in/f32-acc/p-f16"}
MATH_RECIPE = {torch.bfloat16: "bf16-in/f32-math", torch.float16: "f16-in/f32-math"}
MATH_REDUCED_RECIPE = {torch.bfloat16: "bf16-in/bf16-math", torch.float16: "f16-in/f16-math"}
DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


class Shape:
    """One problem of the grid: sizes, mask and the adversarial input profile."""

    def __init__(self, name, b, hq, hkv, lq, lk, d, *, causal=False, logit=1.0, max_last=False):
        self.name, self.b, self.hq, self.hkv, self.lq, self.lk, self.d = name, b, hq, hkv, lq, lk, d
        self.causal, self.logit, self.max_last = causal, logit, max_last


# Tile sizes of the peers are 64 or 128 keys: lengths of tile +-1 straddle both.
GRID = [
    Shape("base", 1, 2, 2, 128, 128, 64),
    Shape("tile_plus1", 2, 2, 2, 129, 129, 64),
    Shape("tile_minus1_d128", 1, 2, 2, 127, 127, 128),
    Shape("lq_ne_lk", 1, 2, 2, 96, 257, 64),
    Shape("causal", 1, 2, 2, 200, 200, 64, causal=True),
    Shape("causal_d128", 1, 2, 2, 255, 255, 128, causal=True),
    Shape("large_logits", 1, 2, 2, 128, 192, 64, logit=6.0),
    Shape("max_in_last_tile", 1, 2, 2, 64, 300, 64, max_last=True),
]
GQA_SHAPE = Shape("gqa", 1, 4, 2, 130, 130, 64)


def make_inputs(s: Shape, dtype, seed):
    """Gaussian q, k, v, dO on the GPU; `logit` scales q (large logits, near one-hot rows);
    `max_last` plants a key aligned with every query in the last position, so every row's
    maximum sits in the last KV tile."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(s.b, s.hq, s.lq, s.d, generator=g) * s.logit
    k = torch.randn(s.b, s.hkv, s.lk, s.d, generator=g)
    v = torch.randn(s.b, s.hkv, s.lk, s.d, generator=g)
    do = torch.randn(s.b, s.hq, s.lq, s.d, generator=g)
    if s.max_last:
        group = s.hq // s.hkv
        mean_q = q.reshape(s.b, s.hkv, group * s.lq, s.d).mean(dim=2)
        k[:, :, -1, :] = 4.0 * mean_q / mean_q.norm(dim=-1, keepdim=True) * math.sqrt(s.d)
    return [t.to(dtype).cuda() for t in (q, k, v, do)]


def with_grad(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def lse_bhl(lse, b, h, lq):
    """The peers return LSE as [B,H,Lq], padded [B,H,Lq_pad] (efficient) or [B,H,Lq,1] (cuDNN)."""
    return lse.detach().float().reshape(b, h, -1)[..., :lq].contiguous()


class Dumper:
    def __init__(self, out, only=None):
        self.out, self.written, self.skipped, self.start = out, [], [], time.time()
        self.only = only

    def section(self, label, fn):
        if self.only is not None and not label.startswith(self.only):
            return
        try:
            fn()
        except Exception as e:  # one failing backend must not lose the others
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.skipped.append(f"{label}: {reason[:200]}")
            print(f"skip {label}: {type(e).__name__}: {reason[:200]}", flush=True)
            if os.environ.get("ATTNPROOF_DUMP_TRACE"):
                traceback.print_exc()

    def dump(self, name, *args, **kw):
        path = os.path.join(self.out, name + ".safetensors")
        dump_case(path, *args, **kw)
        self.written.append(name)
        print(f"wrote {name} ({os.path.getsize(path)} bytes)", flush=True)


def backward(o, inputs, do):
    return torch.autograd.grad(o, inputs, do)


# ---------------------------------------------------------------------------------------------
# SDPA backends through their aten ops, which return the LSE alongside O.


def sdpa_flash(q, k, v, causal, scale):
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def sdpa_efficient(q, k, v, causal, scale):
    r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return r[0], r[1]


def sdpa_cudnn(q, k, v, causal, scale):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r[0], r[1]


FUSED = {"sdpa-flash": sdpa_flash, "sdpa-cudnn": sdpa_cudnn, "sdpa-efficient": sdpa_efficient}

# What each fused backend writes as the LSE of a row that sees no key: FlashAttention 2 (SDPA's flash backend) writes
# +inf, so that exp(s - LSE) is 0 in its backward; the others are recorded with the checker's default, -inf (the log
# of an empty sum), which a row of theirs must then match.
MASKED_LSE = {"sdpa-flash": "+inf", "sdpa-cudnn": "-inf", "sdpa-efficient": "-inf"}


def fused_case(dumper, peer, fn, s: Shape, dtype, seed, *, wrong=None):
    """Forward (O, LSE) and backward (dQ, dK, dV) of one fused SDPA backend on one shape.

    `wrong` makes a deliberately wrong use: the computation differs from what the metadata says.
    SDPA's `is_causal` aligns top-left; with Lq != Lk it is recorded as such (or, for the wrong
    use, claimed bottom-right)."""
    q0, k0, v0, do = make_inputs(s, dtype, seed)
    q, k, v = with_grad(q0, k0, v0)
    scale = 1.0 / math.sqrt(s.d)
    run_scale = 1.0 / s.d if wrong == "scale_1_over_d" else scale
    o, lse = fn(q, k, v, s.causal, run_scale)
    dq, dk, dv = backward(o, (q, k, v), do)
    lse = lse_bhl(lse, s.b, s.hq, s.lq)
    align = "top_left" if s.lq != s.lk else "bottom_right"
    lse_base = "e"
    if wrong == "causal_top_left_as_bottom_right":
        align = "bottom_right"
    if wrong == "lse_base2_as_e":
        lse = lse / math.log(2)
    name = f"{peer}__{DTYPE_NAME[dtype]}__{s.name}" + (f"__WRONG_{wrong}" if wrong else "")
    dumper.dump(
        name, q0, k0, v0, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv,
        causal=s.causal, causal_align=align, scale=scale, recipe=RECIPE[dtype], lse_base=lse_base,
        kernel=f"torch {torch.__version__} {peer}", masked_lse=MASKED_LSE[peer],
        extra_metadata={"peer": peer, "expect": "fail" if wrong else "pass", "wrong_use": wrong or ""},
    )


def sdpa_public_case(dumper, peer, backend, s: Shape, dtype, seed, recipe, *, bias=None):
    """O and gradients through the public F.scaled_dot_product_attention restricted to one
    backend (no LSE there): GQA via enable_gqa, bottom-right causal via causal_lower_right."""
    from torch.nn.attention import sdpa_kernel

    q0, k0, v0, do = make_inputs(s, dtype, seed)
    q, k, v = with_grad(q0, k0, v0)
    gqa = s.hq != s.hkv
    with sdpa_kernel([backend]):
        if bias is not None:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=s.causal, enable_gqa=gqa)
        dq, dk, dv = backward(o, (q, k, v), do)
    causal = s.causal or bias is not None
    align = "bottom_right" if bias is not None or s.lq == s.lk else "top_left"
    name = f"{peer}__{DTYPE_NAME[dtype]}__{s.name}" + ("__lower_right" if bias is not None else "")
    dumper.dump(
        name, q0, k0, v0, o=o, do=do, dq=dq, dk=dk, dv=dv, causal=causal, causal_align=align,
        recipe=recipe, kernel=f"torch {torch.__version__} {peer}",
        extra_metadata={"peer": peer, "expect": "pass", "wrong_use": ""},
    )


# ---------------------------------------------------------------------------------------------
# FlexAttention (compiled: the Triton kernel, not the eager reference).

_FLEX = {}


def flex():
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def flex_call(q, k, v, block_mask, scale, gqa):
    """(O, natural-log LSE). flex_attention converts its internal base-2 LSE to natural log
    before returning it; newer releases return it through `return_aux`."""
    fn = flex()
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        AuxRequest = None
    if AuxRequest is not None:
        try:
            o, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
            return o, aux.lse
        except TypeError:
            pass
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)


def flex_case(dumper, s: Shape, dtype, seed, *, block_table=None, block=64):
    """Flex forward + backward. Causal is bottom-right (a mask_mod on kv <= q + Lk - Lq).
    `block_table` [B,Hq,ceil(Lq/block),ceil(Lk/block)] bool selects visible KV blocks per query
    block; an all-False row gives fully masked query rows (O = 0, LSE = -inf)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q0, k0, v0, do = make_inputs(s, dtype, seed)
    q, k, v = with_grad(q0, k0, v0)
    shift = s.lk - s.lq
    table = None if block_table is None else block_table.cuda()

    def mask_mod(b, h, q_idx, kv_idx):
        visible = kv_idx >= 0
        if s.causal:
            visible = visible & (kv_idx <= q_idx + shift)
        if table is not None:
            visible = visible & table[b, h, q_idx // block, kv_idx // block]
        return visible

    bm = create_block_mask(mask_mod, s.b, s.hq, s.lq, s.lk, device="cuda")
    scale = 1.0 / math.sqrt(s.d)
    o, lse = flex_call(q, k, v, bm, scale, s.hq != s.hkv)
    dq, dk, dv = backward(o, (q, k, v), do)
    extra = {"peer": "flex", "expect": "pass", "wrong_use": ""}
    block_indices = None
    if block_table is not None:
        nk = block_table.shape[-1]
        idx = torch.arange(nk).expand_as(block_table)
        # Visible blocks first in ascending order, -1 after (sort puts the sentinel nk last).
        block_indices = torch.where(block_table, idx, torch.full_like(idx, nk)).sort(dim=-1).values
        block_indices = torch.where(block_indices == nk, -1, block_indices).to(torch.int32)
    name = f"flex__{DTYPE_NAME[dtype]}__{s.name}" + ("__block_mask" if block_table is not None else "")
    dumper.dump(
        name, q0, k0, v0, o=o, lse=lse_bhl(lse, s.b, s.hq, s.lq), do=do, dq=dq, dk=dk, dv=dv,
        causal=s.causal, causal_align="bottom_right", scale=scale, recipe=RECIPE[dtype],
        kernel=f"torch {torch.__version__} flex_attention (compiled)",
        block_indices=block_indices, block_q=block if block_table is not None else None,
        block_k=block if block_table is not None else None, extra_metadata=extra,
    )


def block_indices_from_block_mask(bm, b, hq):
    """The case format's `block_indices` of a FlexAttention `BlockMask`: per (batch, query head,
    query block) the union of its partial blocks (`kv_indices`, where the mask_mod runs) and its
    full blocks (`full_kv_indices`), ascending, -1 padded; a batch or head dimension the mask
    broadcasts (size 1) is expanded. The case's visibility is then its mask AND the listed blocks:
    the same as Flex's when every full block is one the case's mask leaves whole (as earlier blocks
    are under a causal mask with equal query and key blocks)."""
    parts = []
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        if num is not None:
            parts.append((num.expand(b, hq, num.shape[-1]).cpu(), idx.expand(b, hq, *idx.shape[-2:]).cpu()))
    n_q = parts[0][0].shape[-1]
    rows = {}
    for bi in range(b):
        for h in range(hq):
            for a in range(n_q):
                listed = set()
                for num, idx in parts:
                    listed.update(idx[bi, h, a, : int(num[bi, h, a])].tolist())
                rows[bi, h, a] = sorted(listed)
    width = max([1] + [len(r) for r in rows.values()])
    out = torch.full((b, hq, n_q, width), -1, dtype=torch.int32)
    for (bi, h, a), r in rows.items():
        out[bi, h, a, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return out


def flex_block_mask_case(dumper, s: Shape, dtype, seed, *, wrong=None):
    """Flex forward + backward over a `BlockMask` built the way block-sparse users build one
    (`BlockMask.from_kv_blocks`, 128x128 blocks, causal, Lq = Lk): per (batch, query head, query
    block) the diagonal block partial (the causal mask_mod runs there) and a random subset of at
    most 3 earlier blocks full; query block 1 of head 0 lists nothing (fully masked rows). The
    case records the mask's lists through `block_indices_from_block_mask`. `wrong="block_dropped"`
    records every list without its last block: the metadata lies, and the check must fail."""
    from torch.nn.attention.flex_attention import BlockMask

    block = 128
    n = -(-s.lq // block)
    g = torch.Generator().manual_seed(seed)
    partial_num = torch.ones(s.b, s.hq, n, dtype=torch.int32)
    partial_idx = torch.zeros(s.b, s.hq, n, n, dtype=torch.int32)
    partial_idx[..., 0] = torch.arange(n, dtype=torch.int32)
    full_num = torch.zeros(s.b, s.hq, n, dtype=torch.int32)
    full_idx = torch.zeros(s.b, s.hq, n, n, dtype=torch.int32)
    for bi in range(s.b):
        for h in range(s.hq):
            for a in range(n):
                earlier = torch.randperm(a, generator=g)[: min(a, 3)].sort().values
                full_num[bi, h, a] = len(earlier)
                full_idx[bi, h, a, : len(earlier)] = earlier.to(torch.int32)
    partial_num[0, 0, 1] = 0
    full_num[0, 0, 1] = 0
    cuda = lambda t: t.cuda()
    bm = BlockMask.from_kv_blocks(
        cuda(partial_num), cuda(partial_idx), cuda(full_num), cuda(full_idx),
        BLOCK_SIZE=block, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, seq_lengths=(s.lq, s.lk),
    )
    q0, k0, v0, do = make_inputs(s, dtype, seed)
    q, k, v = with_grad(q0, k0, v0)
    scale = 1.0 / math.sqrt(s.d)
    o, lse = flex_call(q, k, v, bm, scale, s.hq != s.hkv)
    dq, dk, dv = backward(o, (q, k, v), do)
    block_indices = block_indices_from_block_mask(bm, s.b, s.hq)
    extra = {"peer": "flex", "expect": "pass", "wrong_use": ""}
    name = f"flex__{DTYPE_NAME[dtype]}__{s.name}__from_kv_blocks"
    if wrong == "block_dropped":
        count = (block_indices >= 0).sum(-1, keepdim=True)
        last = torch.arange(block_indices.shape[-1]) == (count - 1)
        block_indices = torch.where(last & (count > 1), -1, block_indices)
        extra = {"peer": "flex", "expect": "fail", "wrong_use": wrong}
        name += f"__WRONG_{wrong}"
    dumper.dump(
        name, q0, k0, v0, o=o, lse=lse_bhl(lse, s.b, s.hq, s.lq), do=do, dq=dq, dk=dk, dv=dv,
        causal=True, causal_align="bottom_right", scale=scale, recipe=RECIPE[dtype],
        kernel=f"torch {torch.__version__} flex_attention (compiled, BlockMask.from_kv_blocks)",
        block_indices=block_indices, block_q=block, block_k=block, extra_metadata=extra,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--only", help="dump only the sections whose label starts with this (e.g. 'flex block-sparse')")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    d = Dumper(args.out, args.only)
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {torch.cuda.get_device_name(0)}")
    try:
        torch.backends.cuda.matmul.allow_tf32 = False  # the math backend's f32 matmuls stay f32
    except Exception as e:
        print(f"note: could not disable TF32 matmuls: {e}")
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as sdpa_kernel_ctx

    bf16, f16 = torch.bfloat16, torch.float16
    seed = args.seed

    # Fused SDPA backends with LSE, forward and backward, over the grid.
    for peer, fn in FUSED.items():
        for i, s in enumerate(GRID):
            d.section(f"{peer} {s.name}", lambda: fused_case(d, peer, fn, s, bf16, seed + i))
        d.section(f"{peer} f16 base", lambda: fused_case(d, peer, fn, GRID[0], f16, seed + 100))

    # Public SDPA per backend: GQA (enable_gqa) and bottom-right causal via causal_lower_right.
    backends = {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for peer, be in backends.items():
        d.section(f"{peer} gqa", lambda: sdpa_public_case(d, peer, be, GQA_SHAPE, bf16, seed + 200, RECIPE[bf16]))

    def lower_right(peer, be):
        from torch.nn.attention.bias import causal_lower_right

        s = Shape("causal_lq_ne_lk", 1, 2, 2, 96, 160, 64)
        sdpa_public_case(d, peer, be, s, bf16, seed + 300, RECIPE[bf16], bias=causal_lower_right(s.lq, s.lk))

    for peer, be in backends.items():
        d.section(f"{peer} lower_right", lambda: lower_right(peer, be))

    # The math backend: default (f32 internally) and with reduced-precision reductions allowed.
    math_shapes = [GRID[0], GRID[3], GRID[4], GQA_SHAPE]
    for i, s in enumerate(math_shapes):
        d.section(f"sdpa-math {s.name}", lambda: sdpa_public_case(d, "sdpa-math", SDPBackend.MATH, s, bf16, seed + 400 + i, MATH_RECIPE[bf16]))

    def math_reduced(s, sd):
        prev = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
        try:
            sdpa_public_case(d, "sdpa-math-reduced", SDPBackend.MATH, s, bf16, sd, MATH_REDUCED_RECIPE[bf16])
        finally:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(prev)

    for i, s in enumerate([GRID[0], GRID[4]]):
        d.section(f"sdpa-math-reduced {s.name}", lambda: math_reduced(s, seed + 500 + i))

    # f32 inputs (math and efficient support them): recipe f32-in/f32-acc.
    def f32_case(peer, be):
        s = GRID[1]
        q0, k0, v0, do = make_inputs(s, torch.float32, seed + 600)
        q, k, v = with_grad(q0, k0, v0)
        with sdpa_kernel_ctx([be]):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            dq, dk, dv = backward(o, (q, k, v), do)
        d.dump(f"{peer}__f32__{s.name}", q0, k0, v0, o=o, do=do, dq=dq, dk=dk, dv=dv, recipe="f32-in/f32-acc",
               kernel=f"torch {torch.__version__} {peer}", extra_metadata={"peer": peer, "expect": "pass", "wrong_use": ""})

    for peer, be in (("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa-math", SDPBackend.MATH)):
        d.section(f"{peer} f32", lambda: f32_case(peer, be))

    # FlexAttention: dense, bottom-right causal with Lq != Lk, GQA, and a block mask with fully
    # masked query blocks. Compilation dominates the run time; stop adding shapes after 90 s.
    flex_shapes = [GRID[0], Shape("causal_lq_ne_lk", 1, 2, 2, 96, 257, 64, causal=True), GRID[6], GQA_SHAPE]
    for i, s in enumerate(flex_shapes):
        if time.time() - d.start > 90:
            d.skipped.append(f"flex {s.name}: time budget")
            print(f"skip flex {s.name}: time budget", flush=True)
            continue
        d.section(f"flex {s.name}", lambda: flex_case(d, s, bf16, seed + 700 + i))

    def flex_blocks():
        s = Shape("blocks", 1, 2, 2, 256, 256, 64)
        g = torch.Generator().manual_seed(seed + 800)
        table = torch.rand(s.b, s.hq, 4, 4, generator=g) < 0.6
        table[:, :, :, 0] |= True  # most query blocks see block 0...
        table[0, 0, 1, :] = False  # ...but query block 1 of head 0 sees nothing: fully masked rows
        table[0, 1, 3, :] = False
        flex_case(d, s, bf16, seed + 801, block_table=table, block=64)

    d.section("flex block_mask", flex_blocks)

    # FlexAttention's block-sparse use: a BlockMask from per-query-block lists (partial diagonal,
    # full earlier blocks), 128-blocks, lengths of a block +- 1, GQA with lists per query head,
    # large logits; and one wrong use whose recorded lists drop a block.
    flex_sparse = [
        Shape("bsa_causal_384", 1, 2, 2, 384, 384, 64, causal=True),
        Shape("bsa_causal_tile_plus1", 1, 2, 2, 385, 385, 128, causal=True),
        Shape("bsa_gqa_tile_minus1", 1, 4, 2, 511, 511, 64, causal=True),
        Shape("bsa_large_logits", 2, 2, 2, 300, 300, 64, causal=True, logit=6.0),
    ]
    for i, s in enumerate(flex_sparse):
        d.section(f"flex block-sparse {s.name}", lambda: flex_block_mask_case(d, s, bf16, seed + 850 + i))
    d.section(
        "flex block-sparse wrong",
        lambda: flex_block_mask_case(d, flex_sparse[0], bf16, seed + 850, wrong="block_dropped"),
    )

    # Deliberately wrong uses: the metadata lies; `cargo xtask check` must fail them and name why.
    wrong = [
        ("scale_1_over_d", GRID[0]),
        ("causal_top_left_as_bottom_right", Shape("causal_lq_ne_lk", 1, 2, 2, 96, 160, 64, causal=True)),
        ("lse_base2_as_e", GRID[0]),
    ]
    for j, (w, s) in enumerate(wrong):
        # Flash refuses is_causal with Lq != Lk; the efficient backend aligns it top-left.
        peer = "sdpa-efficient" if w.startswith("causal") else "sdpa-flash"
        d.section(f"wrong {w}", lambda: fused_case(d, peer, FUSED[peer], s, bf16, seed + 900 + j, wrong=w))
    # The correct record of the top-left case, for contrast.
    s = Shape("causal_lq_ne_lk", 1, 2, 2, 96, 160, 64, causal=True)
    d.section("sdpa-efficient causal top_left", lambda: fused_case(d, "sdpa-efficient", sdpa_efficient, s, bf16, seed + 950))

    with open(os.path.join(args.out, "manifest.txt"), "w") as f:
        f.write(f"torch {torch.__version__}\n")
        for n in d.written:
            f.write(f"case {n}\n")
        for sk in d.skipped:
            f.write(f"skip {sk}\n")
    total = sum(os.path.getsize(os.path.join(args.out, n + ".safetensors")) for n in d.written)
    print(f"done: {len(d.written)} cases, {len(d.skipped)} skipped, {total / 1e6:.1f} MB, {time.time() - d.start:.0f} s")


if __name__ == "__main__":
    main()
