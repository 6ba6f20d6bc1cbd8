#!/usr/bin/env python3
"""Times fla-core's NSA (`fla.ops.nsa.parallel_nsa`, pure Triton) and prints it beside our NSA pieces from
`bench --nsa`.

fla-core 0.6.0 must be importable (a machine without network takes it and einops as wheels:
`pip download fla-core==0.6.0 einops` where there is network, `pip install --no-index --target DIR *.whl` and
`PYTHONPATH=DIR` there); its window branch imports `flash-attn`, which is not installed, so it runs with `g_swa=None, window_size=0`: the
compressed and selected branches, with its own compression (non-overlapping 64-token blocks) and its own selection
(top-16 of 64-token blocks). It needs the query-head group to be a power of two of at least 16, so only the group-16
rows have a peer. Method as bench/peers.py: bf16 inputs at random, three input sets cycled, untimed warm-up, the
median of --reps calls bracketed by CUDA events; forward, and forward + backward (torch.autograd.grad with a random
dO, the forward inside the timed region).

Ours: the rows of `bench --nsa` (compression, the compressed attention's forward, the selection, the selected
attention's forward), summed: the forward of the same two branches without the gates (a row-wise pass over O that
costs well under a millisecond), at fla-core's configuration (`nsa64-*` rows: windows of 64 every 64 tokens, the
comparison at equal work, and the ratio) and at the paper's (`nsa-*`: windows of 32 every 16, four times the
compressed keys); forward + backward adds the compressed and selected attentions' backward rows.

With --window, fla-core's missing window branch is timed through FlexAttention (window 512, GQA), and the whole
layer (fla-core + Flex) is compared with ours through the layer wrapper (`nsa64-layer-fwd`, `nsa64-layer-bwd`: all
three branches, the gates, the pooling's transpose and the branch sums), forward and forward + backward. Last, the
group-4 rows (Hq = 16, Hkv = 4, no fla peer) give our layer's time per query head over the group-16 row's.

Usage: python3 bench/nsa_peers.py --ours nsa.csv [--window] [--reps 20] [--warmup 3] [--csv peers.csv]
"""

import argparse
import csv
import sys

import torch

# The timing method is bench/peers.py's (this file's directory is on the import path when run as a script).
from peers import SETS, median_ms

SHAPES = [(16384, 64, 4), (65536, 64, 4)]
WINDOW = 512
D = 128


def window_through_flex(t, hq, hkv, sets, args):
    """FlexAttention's sliding-window causal attention (window 512, GQA) on the sets' q, k, v, `[B, H, T, D]` copies
    made before timing: forward and forward + backward ms."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(lambda b, h, q, k: (q >= k) & (q - k < WINDOW), None, None, t, t, device="cuda")
    heads_first = [tuple(x.transpose(1, 2).contiguous() for x in s[:3]) + (s[5].transpose(1, 2).contiguous(),)
                   for s in sets]

    def forward(q, k, v, _d_out):
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    def forward_backward(q, k, v, d_out):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        return torch.autograd.grad(forward(*leaves, d_out), leaves, d_out)

    with torch.no_grad():
        fwd = median_ms(forward, heads_first, args.reps, args.warmup)
    return fwd, median_ms(forward_backward, heads_first, args.reps, args.warmup)


def read_ours(path):
    ours = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["default"] == "1":
                ours[(row["shape"], row["direction"])] = float(row["ms"])
    return ours


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours", required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--csv")
    parser.add_argument("--window", action="store_true",
                        help="also time the window branch through FlexAttention (torch.compile: a minute per shape)")
    args = parser.parse_args()
    ours = read_ours(args.ours)
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:  # the wheel did not load: say so, time nothing
        print(f"fla-core did not load: {e}", file=sys.stderr)
        return 1
    rows = []
    print("T,Hq,Hkv,fla fwd ms,fla fwd+bwd ms,ours fwd ms at fla's l=s=64,fla/ours fwd,ours fwd ms at the paper's l=32 s=16,"
          "Flex window fwd ms,Flex window fwd+bwd ms,ours window+gates fwd ms,layer fwd fla+Flex / ours,"
          "ours fwd+bwd ms at l=s=64,fla/ours fwd+bwd,ours layer fwd ms,ours layer fwd+bwd ms,"
          "layer fwd+bwd fla+Flex / ours")
    for t, hq, hkv in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(t)

        def rand(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

        sets = []
        for _ in range(SETS):
            q, k, v = rand(1, t, hq, D), rand(1, t, hkv, D), rand(1, t, hkv, D)
            g_cmp, g_slc = torch.sigmoid(rand(1, t, hq)), torch.sigmoid(rand(1, t, hq))
            sets.append((q, k, v, g_cmp, g_slc, rand(1, t, hq, D)))

        def forward(q, k, v, g_cmp, g_slc, _d_out):
            return parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=None, block_counts=16, block_size=64,
                                window_size=0)

        def forward_backward(q, k, v, g_cmp, g_slc, d_out):
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
            out = forward(*leaves, g_cmp, g_slc, d_out)
            return torch.autograd.grad(out, leaves, d_out)

        with torch.no_grad():
            fwd = median_ms(forward, sets, args.reps, args.warmup)
        both = median_ms(forward_backward, sets, args.reps, args.warmup)
        shape = f"(1,{hq},{t},{D})"
        def total(prefix, pieces):
            parts = [ours.get((shape, f"{prefix}-{piece}")) for piece in pieces]
            return sum(parts) if all(p is not None for p in parts) else float("nan")

        def forward_total(prefix):
            return total(prefix, ("compress", "cmp-fwd", "select", "selected-fwd"))

        # Forward and backward of the compressed and selected branches: fla-core's fwd+bwd covers the same two (the
        # pooling's transpose onto the tokens, which fla's autograd does, is not on our GPU yet: not counted).
        equal_work_both = total("nsa64", ("compress", "cmp-fwd", "select", "selected-fwd", "cmp-bwd", "selected-bwd"))

        equal_work, paper = forward_total("nsa64"), forward_total("nsa")
        # The window branch fla-core would take from flash-attn (not installed): FlexAttention, window 512, GQA.
        win_fwd, win_both = window_through_flex(t, hq, hkv, sets, args) if args.window else (float("nan"),) * 2
        window_gates = sum(ours.get((shape, d), float("nan")) for d in ("nsa-window-fwd", "nsa-gates"))
        layer_fwd = total("nsa64", ("layer-fwd",))
        layer_both = total("nsa64", ("layer-fwd", "layer-bwd"))
        layer_ratio = (fwd + win_fwd) / layer_fwd
        line = [t, hq, hkv, round(fwd, 3), round(both, 3), round(equal_work, 3), round(fwd / equal_work, 2), round(paper, 3),
                round(win_fwd, 3), round(win_both, 3), round(window_gates, 3), round(layer_ratio, 2),
                round(equal_work_both, 3), round(both / equal_work_both, 2), round(layer_fwd, 3), round(layer_both, 3),
                round((both + win_both) / layer_both, 2)]
        rows.append(line)
        print(",".join(str(x) for x in line))
        del sets
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("T,Hq,Hkv,fla_fwd_ms,fla_fwd_bwd_ms,ours_fwd_ms_l64,fla_over_ours_fwd,ours_fwd_ms_paper,"
                    "flex_window_fwd_ms,flex_window_fwd_bwd_ms,ours_window_gates_fwd_ms,layer_fwd_ratio,"
                    "ours_fwd_bwd_ms_l64,fla_over_ours_fwd_bwd,ours_layer_fwd_ms,ours_layer_fwd_bwd_ms,"
                    "layer_fwd_bwd_ratio\n")
            for line in rows:
                f.write(",".join(str(x) for x in line) + "\n")
    group_four(ours)
    return 0


def group_four(ours):
    """Our layer's time per query head at group 4 (Hq = 16) over group 16 (Hq = 64), both with Hkv = 4, from the
    `nsa64-layer-*` and `nsa-layer-*` rows of `bench --nsa`: forward and forward + backward."""
    print("T,config,G16 fwd ms/head,G4 fwd ms/head,G4/G16 fwd,G16 fwd+bwd ms/head,G4 fwd+bwd ms/head,G4/G16 fwd+bwd")
    for t, _, _ in SHAPES:
        for prefix in ("nsa64", "nsa"):
            def per_head(hq, pieces):
                parts = [ours.get((f"(1,{hq},{t},{D})", f"{prefix}-{p}")) for p in pieces]
                return sum(parts) / hq if all(p is not None for p in parts) else float("nan")
            g16f, g4f = per_head(64, ("layer-fwd",)), per_head(16, ("layer-fwd",))
            g16b, g4b = per_head(64, ("layer-fwd", "layer-bwd")), per_head(16, ("layer-fwd", "layer-bwd"))
            print(f"{t},{prefix},{g16f:.4f},{g4f:.4f},{g4f / g16f:.2f},{g16b:.4f},{g4b:.4f},{g4b / g16b:.2f}")


if __name__ == "__main__":
    sys.exit(main())
