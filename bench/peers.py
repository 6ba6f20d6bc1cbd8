#!/usr/bin/env python3
"""Times PyTorch's attention kernels on the shapes of gpu/src/bin/bench.rs and prints one table beside ours.

Peers: SDPA with the FlashAttention backend, SDPA with the cuDNN backend, and FlexAttention (torch.compile'd).
The method is the bench binary's: bf16 inputs drawn at random, three input sets in distinct buffers cycled launch by
launch (so L2 never holds the next launch's inputs), untimed warm-up launches (compilation, clocks), then --reps
launches each bracketed by CUDA events, and their median. FLOPs: 4*B*H*L^2*D non-causal, half of that causal.

Backward (--backward): each peer's forward runs once per input set, untimed, with gradients enabled; the timed call
is torch.autograd.grad of that output with a random dO (retain_graph), which runs only the backward kernels (dQ,
dK, dV and their preprocessing); FLOPs are 2.5 times the forward's (five matrix products to two).

Usage: python3 bench/peers.py --ours ours.csv [--reps 30] [--warmup 5] [--no-flex] [--backward] [--csv peers.csv]
`ours.csv` is the bench binary's CSV; its rows with default=1 are "ours". Run both in the same device call.
"""

import argparse
import csv
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(16, 16, 1024, 64), (4, 16, 4096, 128), (1, 16, 16384, 128), (1, 8, 65536, 128)]
SETS = 3


def flops(b, h, l, d, causal):
    return 4.0 * b * h * d * l * l * (0.5 if causal else 1.0)


def median_ms(fn, sets, reps, warmup):
    for i in range(warmup):
        fn(*sets[i % SETS])
    pairs = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*sets[i % SETS])
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def sdpa(backend, causal):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def flex(l, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, l, l, device="cuda")

    def run(q, k, v):
        return compiled(q, k, v, block_mask=block_mask)

    return run


def backward_of(forward):
    """The timed backward of `forward`: its output is computed once per input set (untimed, gradients on), then
    each call runs torch.autograd.grad with that set's dO."""
    graphs = {}

    def run(q, k, v, d_out):
        key = id(q)
        if key not in graphs:
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            graphs[key] = (forward(*leaves), leaves)
        out, leaves = graphs[key]
        return torch.autograd.grad(out, leaves, d_out, retain_graph=True)

    return run


def read_ours(path):
    ours = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["default"] == "1":
                ours[(row["shape"], row["causal"] == "true", row["direction"])] = float(row["ms"])
    return ours


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--csv")
    args = ap.parse_args()
    if args.reps < 20:
        sys.exit("--reps must be at least 20")
    if args.warmup < SETS:
        sys.exit(f"--warmup must be at least {SETS}: the backward builds each set's forward graph while warming up")
    ours = read_ours(args.ours)
    peers = [("flash", lambda l, c: sdpa(SDPBackend.FLASH_ATTENTION, c)), ("cudnn", lambda l, c: sdpa(SDPBackend.CUDNN_ATTENTION, c))]
    if not args.no_flex:
        peers.append(("flex", flex))
    gen = torch.Generator(device="cuda").manual_seed(0)
    directions = ["fwd", "bwd"] if args.backward else ["fwd"]
    rows = []
    for b, h, l, d in SHAPES:
        shape = f"({b},{h},{l},{d})"
        if not any(key[0] == shape for key in ours):
            continue  # ours was run on fewer shapes (bench --shape): time the peers on the same ones
        sets = [
            tuple(torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
            for _ in range(SETS)
        ]
        for causal in (False, True):
            for direction in directions:
                fl = flops(b, h, l, d, causal) * (2.5 if direction == "bwd" else 1.0)
                row = {"shape": shape, "causal": causal, "dir": direction, "fl": fl}
                row["ours"] = ours.get((shape, causal, direction), math.nan)
                for name, make in peers:
                    try:
                        fwd = make(l, causal)
                        if direction == "fwd":
                            fn, timed_sets = (lambda q, k, v, _do, f=fwd: f(q, k, v)), sets
                        else:
                            fn, timed_sets = backward_of(fwd), sets
                        row[name] = median_ms(fn, timed_sets, args.reps, args.warmup)
                    except Exception as e:  # a backend that refuses a shape is a row entry, not a crash
                        msg = f"peers: {name} {shape} causal={causal} {direction}: {type(e).__name__}: {e}"
                        print(msg.splitlines()[0], file=sys.stderr)
                        row[name] = math.nan
                    print(f"peers: {shape} causal={causal} {direction} {name}: {row[name]:.4f} ms", file=sys.stderr, flush=True)
                rows.append(row)
                torch.cuda.empty_cache()
        del sets
        torch.cuda.empty_cache()
    names = [n for n, _ in peers]
    tf = lambda fl, ms: fl / ms / 1e9 if ms == ms and ms > 0 else math.nan
    head = f"{'shape':<20} {'causal':<6} {'dir':<4} {'ours ms':>8} {'ours TF':>8} " + " ".join(f"{n + ' TF':>9}" for n in names)
    head += " " + " ".join(f"{'/' + n:>7}" for n in names)
    print(head)
    out = []
    for r in rows:
        line = f"{r['shape']:<20} {str(r['causal']):<6} {r['dir']:<4} {r['ours']:>8.3f} {tf(r['fl'], r['ours']):>8.1f} "
        line += " ".join(f"{tf(r['fl'], r[n]):>9.1f}" for n in names)
        line += " " + " ".join(f"{r[n] / r['ours']:>7.2f}" for n in names)
        print(line)
        out.append([r["shape"], r["causal"], r["dir"], r["ours"]] + [r[n] for n in names])
    print("ratio = peer ms / ours ms = ours TFLOP/s / peer TFLOP/s (above 1: ours is faster)")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["shape", "causal", "direction", "ours_ms"] + [n + "_ms" for n in names])
            w.writerows(out)


if __name__ == "__main__":
    main()
