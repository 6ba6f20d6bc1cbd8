"""Times a forward check from Python against the same check by the `check` binary on a file (issue 19's speed item).

    cargo run --release -p attnproof-harness --example write_case -- CASE.safetensors   # (1, 8, 4096, 128) bf16
    cargo build --release -p attnproof-harness --bin check
    python python/examples/bench_check.py CASE.safetensors [--reps 3]

The case's gradients are dropped (a forward case: q, k, v, o, lse), the forward-only file is written beside the
input, and each side is timed `--reps` times (best reported): the binary on that file (its process start and file
read included, as a user pays them), and `attnproof.check_forward` on NumPy arrays holding the same tensors (the
conversion to a case's bytes included). Both must give the same verdicts; the ratio is Python's time over the
binary's.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import attnproof

REPO = Path(__file__).resolve().parents[2]
NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I32": np.int32, "BF16": np.uint16}


def read_case(path: Path):
    """The tensors (NumPy arrays; bf16 as its raw bits, marked) and the metadata of a safetensors file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, t in header.items():
        start, end = t["data_offsets"]
        raw = np.frombuffer(data[8 + length + start : 8 + length + end], dtype=NUMPY[t["dtype"]]).reshape(t["shape"])
        tensors[name] = (t["dtype"], raw)
    return tensors, meta


def as_array(dtype: str, raw: np.ndarray):
    if dtype != "BF16":
        return raw
    import ml_dtypes

    return raw.view(ml_dtypes.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", type=Path)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    tensors, meta = read_case(args.case)
    forward = {name: as_array(*tensors[name]) for name in ("q", "k", "v", "o", "lse")}
    path = args.case.with_name(args.case.stem + "-forward.safetensors")
    path.write_bytes(attnproof.case_bytes(forward, meta))
    binary = REPO / "target" / "release" / "check"

    cli_times, py_times = [], []
    for _ in range(args.reps):
        start = time.perf_counter()
        out = subprocess.run([str(binary), "--json", str(path)], capture_output=True, text=True)
        cli_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        report = attnproof.check_forward(
            forward["q"], forward["k"], forward["v"], forward["o"], forward["lse"],
            causal=meta.get("causal") == "true", recipe=meta["recipe"], scale=float(meta["scale"]),
        )
        py_times.append(time.perf_counter() - start)
    cli = json.loads(out.stdout)[0]
    same = [o["status"] for o in cli["outputs"]] == [o.status for o in report.outputs]
    shape = tuple(forward["q"].shape)
    print(f"forward check of {shape} {tensors['q'][0]}: check binary best {min(cli_times):.2f} s, "
          f"attnproof.check_forward best {min(py_times):.2f} s, ratio {min(py_times) / min(cli_times):.2f}; "
          f"same verdicts: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
