#!/usr/bin/env python3
"""Times FlexAttention on DSA's token-sparse attention forward and backward with the same selection as a mask, and
prints it beside our `dsa-sparse-fwd` and `dsa-sparse-bwd` rows.

The selection is the bench binary's (`bench --dsa-sparse`): token t lists every token 0..t while t + 1 <= k, else the
k tokens floor(i (t + 1) / k) for i < k, spread evenly over its past. Flex gets it as a mask function computed from
the indices alone (no [T, T] tensor): with n = t + 1 > k, token s is listed iff some integer i has
s k / n <= i < (s + 1) k / n, that is iff ceil(s k / n) n < (s + 1) k; while n <= k, iff s <= t. The BlockMask is
built from it once per shape (untimed), so Flex skips the 128 x 128 blocks with no listed token and masks inside the
others, the best a block-sparse kernel can do with a token-level selection. Queries [1, H, T, d] bf16 over one KV
head (GQA with `enable_gqa`), the default scale 1/sqrt(d).

Before timing, a self-check compares Flex under that mask at T = 300, H = 4, d = 64, k = 16 with a float64 gather of
each token's listed keys: the largest difference must stay below 2^-6 of the largest |v| (bf16 output and inputs;
a wrong mask moves outputs by whole values), and the mask function must list exactly the formula's tokens.

Method as bench/peers.py: three input sets cycled call by call, untimed warm-up calls, then the median of --reps calls
bracketed by CUDA events. FLOPs count the visited pairs' products, 2 H (d + dv) sum_t min(t + 1, k) forward and
2 H (3d + 2dv) sum_t min(t + 1, k) backward (S, dP, dV, dK, dQ), as the bench binary counts them for ours; TFLOP/s on
that count is the "effective" rate of both. Flex's backward is timed as `torch.autograd.grad` of a forward graph built
once per input set (untimed).

Usage: python3 bench/dsa_sparse_peers.py --ours ours.csv [--reps 10] [--warmup 2] [--max-t T] [--csv peers.csv]
Run it in the same device call as the bench binary.
"""

import argparse
import csv
import math
import sys

import torch

# The timing method is bench/peers.py's (this file's directory is on the import path when run as a script).
from peers import SETS, median_ms

# Our rows' directions, and the products each counts per visited (token, key) pair and head: S and PV (2d with
# dv = d) forward; S, dP, dV, dK and dQ (5d) backward.
DIRECTIONS = {"dsa-sparse-fwd": 2, "dsa-sparse-bwd": 5}
BLOCK = 128


def listed(q_idx, kv_idx, top_k):
    """Whether the bench's selection of query q_idx lists key kv_idx (tensors of any matching shape)."""
    n = q_idx + 1
    c = (kv_idx * top_k + n - 1) // n
    spread = (c * n < (kv_idx + 1) * top_k) & (kv_idx <= q_idx)
    return torch.where(n <= top_k, kv_idx <= q_idx, spread)


def selection_lists(seq_len, top_k):
    """The bench's lists `[T, k]` (int64, -1 past a short row), for the self-check."""
    t = torch.arange(seq_len)[:, None]
    i = torch.arange(top_k)[None, :]
    spread = i * (t + 1) // top_k
    return torch.where(t + 1 <= top_k, torch.where(i <= t, i, -1), spread)


def flex_sparse(seq_len, top_k):
    """Flex's forward under the selection's BlockMask, compiled once."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(
        lambda b, h, q, k: listed(q, k, top_k), None, None, seq_len, seq_len, device="cuda", BLOCK_SIZE=BLOCK
    )

    def run(q, k, v):
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    return run


def flex_sparse_backward(seq_len, top_k):
    """Flex's backward under the selection's BlockMask: dQ, dK, dV of a forward graph built once per input set (the
    sets are (out, q, k, v, dO) with q, k, v requiring gradients)."""

    def run(out, q, k, v, d_out):
        return torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)

    return run


def check_flex(seq_len=300, heads=4, dim=64, top_k=16):
    """Raises unless the mask function lists the formula's tokens and Flex under it matches a float64 gather."""
    lists = selection_lists(seq_len, top_k)
    q_idx = torch.arange(seq_len)[:, None].expand(seq_len, seq_len)
    kv_idx = torch.arange(seq_len)[None, :].expand(seq_len, seq_len)
    from_lists = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for t in range(seq_len):
        row = lists[t]
        from_lists[t, row[row >= 0]] = True
    if not torch.equal(listed(q_idx, kv_idx, top_k), from_lists):
        raise RuntimeError("dsa_sparse_peers: check: the mask function does not list the formula's tokens")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, heads, seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 1, seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, 1, seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    got = flex_sparse(seq_len, top_k)(q, k, v).double().cpu()
    qd, kd, vd = q.double().cpu()[0], k.double().cpu()[0, 0], v.double().cpu()[0, 0]
    want = torch.zeros(heads, seq_len, dim, dtype=torch.float64)
    for t in range(seq_len):
        row = lists[t]
        keys = row[row >= 0]
        scores = qd[:, t, :] @ kd[keys].T / math.sqrt(dim)
        want[:, t, :] = torch.softmax(scores, dim=-1) @ vd[keys]
    worst = (got[0] - want).abs().max().item()
    if worst > 2.0**-6 * vd.abs().max().item():
        raise RuntimeError(f"dsa_sparse_peers: check: Flex differs from the float64 gather by {worst:.3e}")
    print(f"dsa_sparse_peers: self-check passed (T = {seq_len}, H = {heads}, d = {dim}, k = {top_k}, "
          f"largest difference {worst:.2e})", file=sys.stderr)


def parse_shape(shape):
    """`(T,H,d,k)` -> four ints."""
    seq_len, heads, dim, top_k = (int(x) for x in shape.strip("()").split(","))
    return seq_len, heads, dim, top_k


def flops(seq_len, heads, dim, top_k, direction):
    """The visited pairs' products, 2 H (d + dv) sum_t min(t + 1, k) forward (dv = d), 2 H (3d + 2dv) ... backward."""
    pairs = sum(min(t + 1, top_k) for t in range(seq_len))
    return 2.0 * heads * DIRECTIONS[direction] * dim * pairs


def read_ours(path, direction):
    """Our rows of `direction`: (shape, tiling, default, ms)."""
    ours = []
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["direction"] == direction:
                ours.append((row["shape"], row["tiling"], row["default"] == "1", float(row["ms"])))
    return ours


def input_sets(seq_len, heads, dim, top_k, direction, gen):
    """SETS random inputs of a shape: (q, k, v) forward; (out, q, k, v, dO) backward, out from Flex's forward."""
    sets = []
    for _ in range(SETS):
        q = torch.randn(1, heads, seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, 1, seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, 1, seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        if direction == "dsa-sparse-fwd":
            sets.append((q, k, v))
            continue
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = flex_sparse(seq_len, top_k)(q, k, v)
        sets.append((out, q, k, v, torch.randn_like(out)))
    return sets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, help="the bench binary's CSV")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-t", type=int, help="skip shapes with more tokens than this")
    ap.add_argument("--csv", help="write the rows here")
    args = ap.parse_args()
    if args.reps < 1 or args.warmup < 0:
        sys.exit("dsa_sparse_peers: --reps must be at least 1 and --warmup at least 0")
    check_flex()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for direction in DIRECTIONS:
        ours = read_ours(args.ours, direction)
        if not ours:
            print(f"dsa_sparse_peers: no {direction} rows in {args.ours}", file=sys.stderr)
            continue
        peer_of = flex_sparse if direction == "dsa-sparse-fwd" else flex_sparse_backward
        flex_ms = {}
        for shape in sorted({shape for shape, _, _, _ in ours}, key=parse_shape):
            seq_len, heads, dim, top_k = parse_shape(shape)
            if args.max_t is not None and seq_len > args.max_t:
                print(f"dsa_sparse_peers: {shape}: skipped (T > --max-t {args.max_t})", file=sys.stderr)
                continue
            try:
                sets = input_sets(seq_len, heads, dim, top_k, direction, gen)
                flex_ms[shape] = median_ms(peer_of(seq_len, top_k), sets, args.reps, args.warmup)
                del sets
            except Exception as e:  # out of memory or a compile failure is a row entry, not a crash
                print(f"dsa_sparse_peers: flex {direction} {shape}: {type(e).__name__}: {e}".splitlines()[0],
                      file=sys.stderr)
                flex_ms[shape] = math.nan
            print(f"dsa_sparse_peers: {direction} {shape}: flex {flex_ms[shape]:.3f} ms", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
        print(f"{direction}:")
        print(f"{'shape (T,H,d,k)':<24} {'tiling':<16} {'ours ms':>9} {'ours TF/s':>10} {'flex ms':>9} "
              f"{'flex TF/s':>10} {'speed-up':>9}")
        for shape, tiling, default, ours_ms in sorted(ours, key=lambda r: (parse_shape(r[0]), not r[2], r[1])):
            if shape not in flex_ms:
                continue
            work = flops(*parse_shape(shape), direction)
            peer = flex_ms[shape]
            speed_up = peer / ours_ms if ours_ms > 0 else math.nan
            label = tiling + ("*" if default else "")
            print(f"{shape:<24} {label:<16} {ours_ms:>9.3f} {work / ours_ms / 1e9:>10.1f} {peer:>9.3f} "
                  f"{work / peer / 1e9:>10.1f} {speed_up:>9.2f}")
            rows.append([shape, direction, tiling, int(default), ours_ms, peer, speed_up])
    if not rows:
        sys.exit(f"dsa_sparse_peers: no token-sparse rows in {args.ours}")
    print("speed-up = flex ms / ours ms (above 1: ours is faster); TF/s on the visited pairs; * marks our default")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["shape", "direction", "tiling", "default", "ours_ms", "flex_ms", "speed_up"])
            w.writerows(rows)


if __name__ == "__main__":
    main()
