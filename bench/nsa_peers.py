#!/usr/bin/env python3
"""Times fla-core's NSA (`fla.ops.nsa.parallel_nsa`, pure Triton) and prints it beside our NSA pieces from
`bench --nsa`.

fla-core 0.6.0 is carried to the GPU machine as a wheel (with einops; see /work/.library/device/README.md for how);
its window branch imports `flash-attn`, which is not installed, so it runs with `g_swa=None, window_size=0`: the
compressed and selected branches, with its own compression (non-overlapping 64-token blocks) and its own selection
(top-16 of 64-token blocks). It needs the query-head group to be a power of two of at least 16, so only the group-16
rows have a peer. Method as bench/peers.py: bf16 inputs at random, three input sets cycled, untimed warm-up, the
median of --reps calls bracketed by CUDA events; forward, and forward + backward (torch.autograd.grad with a random
dO, the forward inside the timed region).

Ours: the rows of `bench --nsa` (compression, the compressed attention's forward, the selection, the selected
attention's forward), summed: the forward of the same two branches without the gates (a row-wise pass over O that
costs well under a millisecond). Our backward is not on the GPU yet, so only the forward has a ratio.

Usage: python3 bench/nsa_peers.py --ours nsa.csv [--reps 20] [--warmup 3] [--csv peers.csv]
"""

import argparse
import csv
import sys

import torch

# The timing method is bench/peers.py's (this file's directory is on the import path when run as a script).
from peers import SETS, median_ms

SHAPES = [(16384, 64, 4), (65536, 64, 4)]
D = 128


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
    args = parser.parse_args()
    ours = read_ours(args.ours)
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:  # the wheel did not load: say so, time nothing
        print(f"fla-core did not load: {e}", file=sys.stderr)
        return 1
    rows = []
    print("T,Hq,Hkv,fla fwd ms,fla fwd+bwd ms,ours fwd ms (compress+cmp-fwd+select+selected-fwd),fla/ours fwd")
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
        parts = [ours.get((shape, d)) for d in ("nsa-compress", "nsa-cmp-fwd", "nsa-select", "nsa-selected-fwd")]
        total = sum(parts) if all(p is not None for p in parts) else float("nan")
        line = [t, hq, hkv, round(fwd, 3), round(both, 3), round(total, 3), round(fwd / total, 2)]
        rows.append(line)
        print(",".join(str(x) for x in line))
        del sets
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("T,Hq,Hkv,fla_fwd_ms,fla_fwd_bwd_ms,ours_fwd_ms,fla_over_ours_fwd\n")
            for line in rows:
                f.write(",".join(str(x) for x in line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
