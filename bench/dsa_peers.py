#!/usr/bin/env python3
"""Times the PyTorch baseline of DSA's token discovery (the lightning indexer's scores, E16, and the exact causal
top-k) and prints it beside our `dsa-index` rows.

The baseline, `torch_discovery` below, is what a model implementation writes: for each chunk of queries, the logits
`q^I_ta . k^I_s` of every index head against the keys the chunk can see, as one bf16 matrix product (f32
accumulation in the GEMM, bf16 output), ReLU, the weighted sum over the heads in f32 (a batched f32 product with the
f32 weights `w`; TF32 stays at PyTorch's default, off), the future keys (s > t) masked to -inf, and `torch.topk` of
`min(k, visible keys)` along the keys. It returns int32 indices `[T, k]`, -1 past the visible keys of the first
queries. The chunk (default: the most queries whose bf16 logits `[chunk, H_I, T]` stay within 4 GiB, 512 at
T = 64K and H_I = 64) bounds the memory: the full `[T, H_I, T]` tensor is never formed.

Before timing, a self-check compares `torch_discovery` (two chunk sizes) at T = 300, H_I = 4, d_I = 64, k = 16 with
a float64 computation of the full score matrix: every row must hold min(k, t + 1) distinct causal keys, -1 after
them, and no unselected key may beat a selected one by more than the rounding can explain: the larger of 1e-3
relative and `2^-7 A + 2^-15 M`, where A is the larger of the two scores' `sum_a |w_ta| |q_ta . k_s|` and M the
larger `sum_a |w_ta| sum_c |q_tac k_sc|` (the GEMM rounds each logit to bf16, a relative 2^-8, so each score is
within `2^-8 A` plus the f32 sums' error, below `2^-16 M` at d_I = 64; an unselected key can beat a selected one by
the two scores' errors together).

Method as bench/peers.py: inputs at random (q and k bf16, w f32), three input sets in distinct buffers cycled call
by call, untimed warm-up calls, then the median of --reps calls bracketed by CUDA events. The baseline takes seconds
per call at T = 128K, hence the small default --reps and --max-t to skip the long rows.

Ours: the rows of the bench binary's CSV (columns shape,causal,direction,tiling,default,ms,tflops, as bench/peers.py
reads them) with direction `dsa-index` and shape `(T,H_I,d_I,k)`, e.g. `(65536,64,128,2048)`; the baseline is timed
once per shape and printed beside every tiling of ours (`*` marks the default one).

Usage: python3 bench/dsa_peers.py --ours ours.csv [--reps 10] [--warmup 2] [--max-t T] [--chunk N] [--csv peers.csv]
Run it in the same device call as the bench binary.
"""

import argparse
import csv
import math
import sys

import torch

# The timing method is bench/peers.py's (this file's directory is on the import path when run as a script).
from peers import SETS, median_ms

DIRECTION = "dsa-index"
CHUNK_BYTES = 4 << 30


def default_chunk(seq_len, heads):
    """The most queries whose bf16 logits `[chunk, heads, seq_len]` fit in CHUNK_BYTES (at least one)."""
    return max(1, min(seq_len, CHUNK_BYTES // (2 * heads * seq_len)))


def torch_discovery(q, k, w, top_k, chunk):
    """DSA's token discovery in PyTorch: q `[T, H_I, d_I]` and k `[T, d_I]` bf16, w `[T, H_I]` f32 ->
    int32 `[T, top_k]`, the top-k keys of each query by `I_ts = sum_a w_ta relu(q_ta . k_s)` over the causal keys
    s <= t (in topk's order, largest first), -1 where a query sees fewer than top_k keys."""
    seq_len = q.shape[0]
    out = torch.full((seq_len, top_k), -1, dtype=torch.int32, device=q.device)
    for start in range(0, seq_len, chunk):
        end = min(start + chunk, seq_len)  # the chunk's last query sees keys [0, end)
        logits = torch.einsum("chd,sd->chs", q[start:end], k[:end])  # bf16 [chunk, H_I, end]
        scores = torch.einsum("ch,chs->cs", w[start:end], logits.relu_().float())  # f32 [chunk, end]
        del logits
        rows = torch.arange(start, end, device=q.device)
        future = torch.arange(end, device=q.device)[None, :] > rows[:, None]
        scores.masked_fill_(future, float("-inf"))
        kept = min(top_k, end)
        values, indices = torch.topk(scores, kept, dim=-1, largest=True)
        out[start:end, :kept] = indices.masked_fill(values == float("-inf"), -1).to(torch.int32)
    return out


def check_discovery(seq_len=300, heads=4, dim=64, top_k=16):
    """Raises unless torch_discovery selects, on random inputs and at two chunk sizes, what a float64 computation of
    the full score matrix selects, up to ties within the rounding (module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(seq_len, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(seq_len, heads, device="cuda", dtype=torch.float32, generator=gen)
    logits = torch.einsum("thd,sd->ths", q.double(), k.double())
    exact = torch.einsum("th,ths->ts", w.double(), logits.relu()).cpu()
    logit_size = torch.einsum("th,ths->ts", w.double().abs(), logits.abs()).cpu()
    abs_products = torch.einsum("thd,sd->ths", q.double().abs(), k.double().abs())
    product_size = torch.einsum("th,ths->ts", w.double().abs(), abs_products).cpu()
    for chunk in (37, seq_len):
        got = torch_discovery(q, k, w, top_k, chunk).cpu()
        if got.dtype != torch.int32 or tuple(got.shape) != (seq_len, top_k):
            raise RuntimeError(f"dsa_peers: check (chunk {chunk}): got {got.dtype} {tuple(got.shape)}")
        for t in range(seq_len):
            n = min(top_k, t + 1)
            row = got[t].tolist()
            chosen = row[:n]
            if any(x != -1 for x in row[n:]) or len(set(chosen)) != n or not all(0 <= s <= t for s in chosen):
                raise RuntimeError(f"dsa_peers: check (chunk {chunk}): row {t} selects {row}")
            selected = torch.zeros(t + 1, dtype=torch.bool)
            selected[chosen] = True
            if selected.all():
                continue
            e, a, m = exact[t, : t + 1], logit_size[t, : t + 1], product_size[t, : t + 1]
            pair_max = lambda x: torch.maximum(x[selected][:, None], x[~selected][None, :])
            e_in, e_out = e[selected], e[~selected]
            # gap > 0: an unselected key scores above a selected one.
            gap = e_out[None, :] - e_in[:, None]
            relative = 1e-3 * pair_max(e.abs())
            rounding = 2.0**-7 * pair_max(a) + 2.0**-15 * pair_max(m)
            worst = (gap - torch.maximum(relative, rounding)).max().item()
            if worst > 0:
                raise RuntimeError(
                    f"dsa_peers: check (chunk {chunk}): row {t} leaves out a key that beats a selected one by "
                    f"{worst:.3e} beyond the tie tolerance"
                )
    print(f"dsa_peers: self-check passed (T = {seq_len}, H_I = {heads}, d_I = {dim}, k = {top_k})", file=sys.stderr)


def parse_shape(shape):
    """`(T,H_I,d_I,k)` -> four ints."""
    seq_len, heads, dim, top_k = (int(x) for x in shape.strip("()").split(","))
    return seq_len, heads, dim, top_k


def read_ours(path):
    """Our `dsa-index` rows: (shape, tiling, default, ms)."""
    ours = []
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["direction"] == DIRECTION:
                ours.append((row["shape"], row["tiling"], row["default"] == "1", float(row["ms"])))
    return ours


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, help="the bench binary's CSV")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-t", type=int, help="skip shapes with more tokens than this")
    ap.add_argument("--chunk", type=int, help="queries per chunk (default: bf16 logits of a chunk within 4 GiB)")
    ap.add_argument("--csv", help="write the rows here")
    args = ap.parse_args()
    if args.reps < 1 or args.warmup < 0:
        sys.exit("dsa_peers: --reps must be at least 1 and --warmup at least 0")
    if args.chunk is not None and args.chunk < 1:
        sys.exit("dsa_peers: --chunk must be at least 1")
    ours = read_ours(args.ours)
    if not ours:
        sys.exit(f"dsa_peers: no {DIRECTION} rows in {args.ours}")
    check_discovery()
    shapes = sorted({shape for shape, _, _, _ in ours}, key=parse_shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch_ms, chunks = {}, {}
    for shape in shapes:
        seq_len, heads, dim, top_k = parse_shape(shape)
        if args.max_t is not None and seq_len > args.max_t:
            print(f"dsa_peers: {shape}: skipped (T > --max-t {args.max_t})", file=sys.stderr)
            continue
        chunk = args.chunk or default_chunk(seq_len, heads)
        chunks[shape] = chunk
        sets = [
            (
                torch.randn(seq_len, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn(seq_len, dim, device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn(seq_len, heads, device="cuda", dtype=torch.float32, generator=gen),
            )
            for _ in range(SETS)
        ]
        try:
            torch_ms[shape] = median_ms(
                lambda q, k, w: torch_discovery(q, k, w, top_k, chunk), sets, args.reps, args.warmup
            )
        except Exception as e:  # out of memory is a row entry, not a crash
            print(f"dsa_peers: torch {shape}: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
            torch_ms[shape] = math.nan
        print(f"dsa_peers: {shape} chunk {chunk}: torch {torch_ms[shape]:.3f} ms", file=sys.stderr, flush=True)
        del sets
        torch.cuda.empty_cache()
    rows = []
    print(f"{'shape (T,H_I,d_I,k)':<24} {'tiling':<16} {'ours ms':>9} {'torch ms':>10} {'speed-up':>9}")
    for shape, tiling, default, ours_ms in sorted(ours, key=lambda r: (parse_shape(r[0]), not r[2], r[1])):
        if shape not in torch_ms:
            continue
        peer = torch_ms[shape]
        speed_up = peer / ours_ms if ours_ms > 0 else math.nan
        label = tiling + ("*" if default else "")
        print(f"{shape:<24} {label:<16} {ours_ms:>9.3f} {peer:>10.3f} {speed_up:>9.2f}")
        rows.append([shape, DIRECTION, tiling, int(default), chunks[shape], ours_ms, peer, speed_up])
    print("speed-up = torch ms / ours ms (above 1: ours is faster; the target is at least 8 at T = 64K); "
          "* marks our default tiling")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["shape", "direction", "tiling", "default", "torch_chunk", "ours_ms", "torch_ms", "speed_up"])
            w.writerows(rows)


if __name__ == "__main__":
    main()
