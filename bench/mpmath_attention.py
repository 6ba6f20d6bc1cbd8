"""mpmath peer of the oracle's MPFR forward, timed on the inputs `bench_dense` wrote.

The peer of the MPFR row of `cargo xtask bench-oracle` (oracle/examples/bench_dense.rs runs this script when mpmath
is importable): one head, `Lq = Lk = L`, no mask, at `mp.prec = PREC` bits, the forward `S = α Q Kᵀ`,
`P = softmax(S)`, `O = P V`, with `mpmath.exp` per score, twice: its products as the textbook loop writes them
(`acc += a * b`, one rounding per product and per sum, as the oracle's MPFR path does) and through mpmath's fastest
plain tool, `mpmath.fdot` (one call per dot product). Usage: `python3 bench/mpmath_attention.py DIR L D PREC REPS`,
where DIR holds q.f64, k.f64 and v.f64 (little-endian, row major [L, D]). Prints `mpmath textbook S` and
`mpmath fdot S`, the best of REPS runs each, and `mpmath backend NAME` (python, or gmpy when gmpy2 is installed).
"""

import struct
import sys
import time

import mpmath
from mpmath import mp


def read(path, rows, cols):
    with open(path, "rb") as f:
        data = f.read()
    values = struct.unpack("<%dd" % (rows * cols), data)
    return [[mp.mpf(values[r * cols + c]) for c in range(cols)] for r in range(rows)]


def textbook_dot(a, b):
    acc = mp.mpf(0)
    for x, y in zip(a, b):
        acc += x * y
    return acc


def forward(q, k, v, scale, dot):
    vt = [list(col) for col in zip(*v)]
    out = []
    for qi in q:
        s = [scale * dot(qi, kj) for kj in k]
        m = max(s)
        p = [mpmath.exp(x - m) for x in s]
        total = mpmath.fsum(p)
        out.append([dot(p, col) / total for col in vt])
    return out


def main():
    folder, length, dim, prec, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    mp.prec = prec
    q, k, v = (read(f"{folder}/{name}.f64", length, dim) for name in ("q", "k", "v"))
    scale = 1 / mpmath.sqrt(dim)
    print(f"mpmath backend {mpmath.libmp.BACKEND}")
    for label, dot in (("textbook", textbook_dot), ("fdot", mpmath.fdot)):
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            forward(q, k, v, scale, dot)
            best = min(best, time.perf_counter() - start)
        print(f"mpmath {label} {best:.6f}")


if __name__ == "__main__":
    main()
