"""Textbook NumPy f64 attention, forward and forward + backward, timed on the inputs `bench_dense` wrote.

The peer of `cargo xtask bench-oracle` (oracle/examples/bench_dense.rs, which runs this script when NumPy is
importable): one head, `Lq = Lk = L`, no mask, the forward `S = α Q Kᵀ`, `P = softmax(S)`, `O = P V`, and the
backward `dV = Pᵀ dO`, `dP = dO Vᵀ`, `D = rowsum(dO ∘ O)`, `dS = P ∘ (dP − D)`, `dQ = α dS K`, `dK = α dSᵀ Q`, with the
whole `[L, L]` matrices in memory, as a reader of the equations would write it. Usage:
`python3 bench/numpy_attention.py DIR L D REPS`, where DIR holds q.f64, k.f64, v.f64 and do.f64 (little-endian, row
major [L, D]). Prints `numpy forward S` and `numpy forward+backward S`, the best of REPS runs each.
"""

import sys
import time

import numpy as np


def forward(q, k, v, scale):
    s = scale * (q @ k.T)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    p /= p.sum(axis=1, keepdims=True)
    return p, p @ v


def forward_backward(q, k, v, d_out, scale):
    p, o = forward(q, k, v, scale)
    dv = p.T @ d_out
    dp = d_out @ v.T
    delta = (d_out * o).sum(axis=1, keepdims=True)
    ds = p * (dp - delta)
    return o, scale * (ds @ k), scale * (ds.T @ q), dv


def best(reps, f):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    folder, length, head_dim, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    load = lambda name: np.fromfile(f"{folder}/{name}.f64", dtype="<f8").reshape(length, head_dim)
    q, k, v, d_out = load("q"), load("k"), load("v"), load("do")
    scale = 1.0 / np.sqrt(head_dim)
    print(f"numpy forward {best(reps, lambda: forward(q, k, v, scale)):.3f}")
    print(f"numpy forward+backward {best(reps, lambda: forward_backward(q, k, v, d_out, scale)):.3f}")


if __name__ == "__main__":
    main()
