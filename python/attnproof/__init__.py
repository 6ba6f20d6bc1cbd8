"""attnproof for Python: check an attention kernel's outputs against the oracle, under a derived error bound.

    import attnproof
    report = attnproof.check_forward(q, k, v, o, lse, causal=True)
    assert report.passed, report

    attnproof.assert_attention_close(q, k, v, o, lse, causal=True)   # raises AssertionError with the report

Arrays are NumPy arrays or anything NumPy can take (objects with ``__dlpack__`` or ``__array__``); torch tensors
are read directly (a CUDA tensor is copied to the host once, bf16 through its raw bits). ``[B, H, L, D]`` arrays
are the ``bhld`` layout; packed ``[T, H, D]`` arrays with ``cu_seqlens_q``/``cu_seqlens_k`` the ``thd`` layout.

The check runs in-process: the arguments become the bytes of a case file (docs/case-format.md in the repository) and
the native module runs the same checker as ``cargo xtask check`` on them, so both give the same verdicts.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ._native import CaseError, __version__, check_case

__all__ = [
    "CaseError",
    "OutputReport",
    "Report",
    "__version__",
    "assert_attention_close",
    "case_bytes",
    "check_backward",
    "check_forward",
]

CAUSAL_ALIGNS = ("bottom_right", "top_left")
LSE_BASES = ("e", "2")
MASKED_LSES = ("-inf", "+inf")

# The kernel parameters a check may state (`kernel_params`), each written as the metadata key `kernel_<name>`: KV and
# query tile sizes, products per MMA instruction, the exponential ("ex2" or "expf") and the split-KV count. A stated
# one replaces the worst case over all kernels in the bound (docs/case-format.md).
KERNEL_PARAMS = ("kv_tile", "q_tile", "mma_k", "exp", "split_kv")

# The recipe a storage dtype implies when none is given: a fused FlashAttention-style kernel in that dtype.
DEFAULT_RECIPES = {"BF16": "bf16-in/f32-acc/p-bf16", "F16": "f16-in/f32-acc/p-f16", "F32": "f32-in/f32-acc"}

# Safetensors names of the NumPy dtypes a case may hold (bf16 comes as ml_dtypes' bfloat16 or as torch's raw bits).
_NUMPY_DTYPES = {
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}


@dataclass(frozen=True)
class _Tensor:
    """A tensor ready for the case file: its safetensors dtype, shape and little-endian bytes."""

    dtype: str
    shape: Tuple[int, ...]
    data: bytes


def _torch_tensor(x: Any, name: str) -> Optional[_Tensor]:
    """A torch tensor as a `_Tensor` (None when `x` is not one): detached, on the host, bf16 by its raw bits."""
    module = type(x).__module__
    if not (module == "torch" or module.startswith("torch.")) or not hasattr(x, "detach"):
        return None
    import torch

    t = x.detach()
    if t.device.type != "cpu":
        try:
            t = t.to("cpu")
        except Exception as e:  # a device tensor that cannot be copied to the host
            raise CaseError(f"{name}: cannot copy the {t.device} tensor to the host: {e}") from e
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy()
        return _Tensor("BF16", tuple(bits.shape), bits.astype("<i2", copy=False).tobytes())
    return _from_numpy(t.numpy(), name)


def _from_numpy(a: np.ndarray, name: str) -> _Tensor:
    if a.dtype.name == "bfloat16":  # ml_dtypes.bfloat16: two bytes, the bf16 bits
        bits = np.ascontiguousarray(a).view(np.uint16)
        return _Tensor("BF16", tuple(a.shape), bits.astype("<u2", copy=False).tobytes())
    dtype = _NUMPY_DTYPES.get(a.dtype.newbyteorder("="))
    if dtype is None:
        raise CaseError(f"{name}: dtype {a.dtype} is not one a case holds (bf16, f16, f32, f64, i32, i64)")
    little = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)
    return _Tensor(dtype, tuple(a.shape), little.tobytes())


def _tensor(x: Any, name: str) -> _Tensor:
    """`x` (a torch tensor, a NumPy array, anything with `__dlpack__` or `__array__`) as a `_Tensor`."""
    t = _torch_tensor(x, name)
    if t is not None:
        return t
    if isinstance(x, np.ndarray):
        return _from_numpy(x, name)
    if hasattr(x, "__dlpack__"):
        try:
            return _from_numpy(np.from_dlpack(x), name)
        except (TypeError, RuntimeError, BufferError):
            pass  # a device array: NumPy's own conversion below may still copy it
    try:
        return _from_numpy(np.asarray(x), name)
    except CaseError:
        raise
    except Exception as e:
        raise CaseError(f"{name}: not an array ({type(x).__name__}): {e}") from e


def _int_tensor(x: Any, name: str) -> _Tensor:
    """An integer argument (sequence offsets, block lists) as int32."""
    a = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if a.dtype.kind not in "iu":
        raise CaseError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
        raise CaseError(f"{name}: values outside the int32 range")
    return _from_numpy(a.astype(np.int32), name)


def case_bytes(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """The bytes of a case file (safetensors: header length, JSON header, tensor data) holding `tensors` (arrays,
    converted as the check functions convert them) and the string `metadata` (docs/case-format.md)."""
    prepared = {name: t if isinstance(t, _Tensor) else _tensor(t, name) for name, t in tensors.items()}
    header: Dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for name, t in prepared.items():
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writers do
    return struct.pack("<Q", len(text)) + text + b"".join(t.data for t in prepared.values())


@dataclass(frozen=True)
class OutputReport:
    """The verdict on one output (`O`, `LSE`, `dQ`, `dK`, `dV`)."""

    output: str
    #: "pass", "fail" or "not verified" (the model's hypothesis does not hold, or no model covers the output).
    status: str
    #: Why the output is not verified, if it is not.
    reason: Optional[str]
    #: The largest |candidate − oracle| / bound over the elements (below 1: within the bound).
    max_error_over_bound: Optional[float]
    #: The index of that element, and the candidate, the oracle and the bound there.
    worst_index: Optional[Tuple[int, ...]]
    worst_candidate: Optional[float]
    worst_oracle: Optional[float]
    worst_bound: Optional[float]
    #: For a failure: the hypothesis under which it passes (the diagnosed cause), when one does.
    cause: Optional[str]
    #: For a failure no hypothesis explains: rectangles of failing elements.
    regions: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Not failed (a not-verified output has not failed)."""
        return self.status != "fail"

    @property
    def verified(self) -> bool:
        """Compared with the oracle under a bound (pass or fail)."""
        return self.status != "not verified"


def _number(x: Any) -> Optional[float]:
    return None if x is None else float(x)  # the report writes non-finite numbers as strings ("NaN", "inf")


@dataclass(frozen=True)
class Report:
    """The verdict on one kernel call: one `OutputReport` per output given, and the whole text report."""

    #: "pass" or "fail".
    status: str
    recipe: str
    kernel: str
    #: "f64" or "mpfr".
    oracle: str
    oracle_note: Optional[str]
    outputs: List[OutputReport]
    #: Whether the bound rejects canned wrong answers (the discriminability gate), when it applies.
    gate_valid: Optional[bool]
    text: str
    #: The kernel parameters the case stated (None for those it did not: the bound took their worst case).
    kernel_params: Dict[str, Any] = field(default_factory=dict)
    #: What the bound assumed, one phrase per kernel parameter ("kv_tile 128 (stated), q_tile 1 (worst case), ...").
    assumptions: str = ""

    @property
    def passed(self) -> bool:
        """Every output within its bound (or not verified)."""
        return self.status == "pass"

    @property
    def verified(self) -> bool:
        """Every output was compared under a bound."""
        return all(o.verified for o in self.outputs)

    def output(self, name: str) -> OutputReport:
        """The report of output `name` (`"O"`, `"LSE"`, `"dQ"`, `"dK"`, `"dV"`)."""
        for o in self.outputs:
            if o.output == name:
                return o
        raise KeyError(f"no output {name!r} in this report (it has {[o.output for o in self.outputs]})")

    def to_dict(self) -> Dict[str, Any]:
        """The report as plain data (the JSON form of `cargo xtask check --json`, without the path)."""
        return {
            "status": self.status,
            "recipe": self.recipe,
            "kernel": self.kernel,
            "kernel_params": dict(self.kernel_params),
            "assumptions": self.assumptions,
            "oracle": self.oracle,
            "oracle_note": self.oracle_note,
            "outputs": [dict(o.__dict__, worst_index=list(o.worst_index or [])) for o in self.outputs],
            "gate_valid": self.gate_valid,
        }

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text

    @staticmethod
    def _from_native(json_text: str, text: str) -> "Report":
        d = json.loads(json_text)
        outputs = [
            OutputReport(
                output=o["output"],
                status=o["status"],
                reason=o.get("reason"),
                max_error_over_bound=_number(o.get("max_error_over_bound")),
                worst_index=tuple(o["worst_index"]) if "worst_index" in o else None,
                worst_candidate=_number(o.get("worst_candidate")),
                worst_oracle=_number(o.get("worst_oracle")),
                worst_bound=_number(o.get("worst_bound")),
                cause=o.get("cause"),
                regions=o.get("regions", []),
            )
            for o in d["outputs"]
        ]
        gate = d.get("gate")
        return Report(
            status=d["status"],
            recipe=d["recipe"],
            kernel=d["kernel"],
            oracle=d["oracle"],
            oracle_note=d.get("oracle_note"),
            outputs=outputs,
            gate_valid=None if gate is None else bool(gate["valid"]),
            text=text.replace("<in memory>: ", "", 1),
            kernel_params=d.get("kernel_params", {}),
            assumptions=d.get("assumptions", ""),
        )


def _metadata(
    q: _Tensor,
    *,
    causal: bool,
    causal_align: str,
    window: Optional[Tuple[int, int]],
    scale: Optional[float],
    lse_base: str,
    recipe: Optional[str],
    kernel: str,
    block_size: Optional[Tuple[int, int]],
    kernel_params: Optional[Mapping[str, Any]],
    masked_lse: str,
) -> Dict[str, str]:
    if causal_align not in CAUSAL_ALIGNS:
        raise CaseError(f"causal_align: must be one of {CAUSAL_ALIGNS}, not {causal_align!r}")
    if lse_base not in LSE_BASES:
        raise CaseError(f"lse_base: must be one of {LSE_BASES}, not {lse_base!r}")
    if masked_lse not in MASKED_LSES:
        raise CaseError(f"masked_lse: must be one of {MASKED_LSES}, not {masked_lse!r}")
    if recipe is None:
        recipe = DEFAULT_RECIPES.get(q.dtype)
        if recipe is None:
            raise CaseError(f"recipe: none given, and q's dtype {q.dtype} implies none (give one)")
    meta = {
        "format_version": "1",
        "layout": "bhld" if len(q.shape) == 4 else "thd",
        "causal": "true" if causal else "false",
        "causal_align": causal_align,
        "lse_base": lse_base,
        "recipe": recipe,
        "kernel": kernel,
        "masked_lse": masked_lse,
    }
    for name, value in dict(kernel_params or {}).items():
        if name not in KERNEL_PARAMS:
            raise CaseError(f"kernel_params: unknown parameter {name!r} (known: {', '.join(KERNEL_PARAMS)})")
        if value is not None:
            meta[f"kernel_{name}"] = str(value)
    if scale is not None:
        if not math.isfinite(float(scale)):
            raise CaseError(f"scale: must be finite, not {scale}")
        meta["scale"] = repr(float(scale))
    if window is not None:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise CaseError(f"window: expected (left, right) with -1 for unbounded, not {window!r}") from None
        meta["window_left"], meta["window_right"] = str(int(left)), str(int(right))
    if block_size is not None:
        sizes = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        if len(sizes) != 2:
            raise CaseError(f"block_size: expected an int or (block_q, block_k), not {block_size!r}")
        meta["block_q"], meta["block_k"] = str(int(sizes[0])), str(int(sizes[1]))
    return meta


def _check(
    tensors: Dict[str, Any],
    *,
    causal: bool,
    causal_align: str,
    window: Optional[Tuple[int, int]],
    scale: Optional[float],
    lse_base: str,
    recipe: Optional[str],
    kernel: str,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    block_indices: Any,
    block_size: Optional[Tuple[int, int]],
    token_indices: Any,
    kernel_params: Optional[Mapping[str, Any]],
    masked_lse: str,
    mpfr: bool,
) -> Report:
    prepared = {name: _tensor(t, name) for name, t in tensors.items() if t is not None}
    integer_tensors = (
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k", cu_seqlens_k),
        ("block_indices", block_indices),
        ("token_indices", token_indices),
    )
    for name, t in integer_tensors:
        if t is not None:
            prepared[name] = _int_tensor(t, name)
    if (block_indices is None) != (block_size is None):
        raise CaseError("block_size: block_indices and block_size go together")
    meta = _metadata(
        prepared["q"],
        causal=causal,
        causal_align=causal_align,
        window=window,
        scale=scale,
        lse_base=lse_base,
        recipe=recipe,
        kernel=kernel,
        block_size=block_size,
        kernel_params=kernel_params,
        masked_lse=masked_lse,
    )
    json_text, text = check_case(case_bytes(prepared, meta), mpfr)
    return Report._from_native(json_text, text)


# The keyword options every check takes, passed on to `_check` as given.
_OPTIONS = (
    "causal",
    "causal_align",
    "window",
    "scale",
    "lse_base",
    "recipe",
    "kernel",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "block_indices",
    "block_size",
    "token_indices",
    "kernel_params",
    "masked_lse",
    "mpfr",
)


def _options(arguments: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword options among a check function's `locals()`."""
    return {name: arguments[name] for name in _OPTIONS}


def check_forward(
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any = None,
    *,
    causal: bool = False,
    causal_align: str = "bottom_right",
    window: Optional[Tuple[int, int]] = None,
    scale: Optional[float] = None,
    lse_base: str = "e",
    recipe: Optional[str] = None,
    kernel: str = "",
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    block_indices: Any = None,
    block_size: Any = None,
    token_indices: Any = None,
    kernel_params: Optional[Mapping[str, Any]] = None,
    masked_lse: str = "-inf",
    mpfr: bool = False,
) -> Report:
    """Checks a forward call's outputs `o` (and `lse`, when given) against the oracle.

    `causal_align`: "bottom_right" (query i sees key j <= i + Lk - Lq, FlashAttention) or "top_left" (j <= i,
    PyTorch SDPA's `is_causal`). `window`: (left, right) key counts around the aligned diagonal, -1 unbounded.
    `scale`: the softmax scale (None: 1/sqrt(D)). `lse_base`: "e" or "2". `recipe`: the kernel's precision recipe
    (docs/case-format.md; None: the fused-kernel recipe of q's dtype). `block_indices` with `block_size` (an int or
    (block_q, block_k)): block-sparse lists. `token_indices`: int32 `[rows, list heads, k]` (rows B*Lq or Tq;
    `[B, Lq, list heads, k]` also for 4-D q) key lists per query row, -1 for an unused slot, any order, as DSA's
    selection and FlashMLA's sparse kernels take them; 1, Hkv or Hq list heads. `kernel_params`: the kernel's real parameters, any of
    {"kv_tile": int, "q_tile": int, "mma_k": int, "exp": "ex2" | "expf", "split_kv": int}; each one given replaces
    the worst case over all kernels in the bound (the report's `assumptions` says which were used). `masked_lse`: what
    the kernel writes as the LSE of a row that sees no key, "-inf" or "+inf" (FlashAttention 2 and 3). `mpfr`: the
    256-bit oracle instead of f64 (small cases).
    Raises `CaseError` (a `ValueError`) naming the argument when the call cannot be checked.
    """
    return _check({"q": q, "k": k, "v": v, "o": o, "lse": lse}, **_options(locals()))


def check_backward(
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    do: Any,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    *,
    causal: bool = False,
    causal_align: str = "bottom_right",
    window: Optional[Tuple[int, int]] = None,
    scale: Optional[float] = None,
    lse_base: str = "e",
    recipe: Optional[str] = None,
    kernel: str = "",
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    block_indices: Any = None,
    block_size: Any = None,
    token_indices: Any = None,
    kernel_params: Optional[Mapping[str, Any]] = None,
    masked_lse: str = "-inf",
    mpfr: bool = False,
) -> Report:
    """Checks a backward call's gradients `dq`, `dk`, `dv` (those given) for the output gradient `do`, and the
    forward outputs `o`, `lse` it started from, against the oracle. Options as for `check_forward`."""
    tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do, "dq": dq, "dk": dk, "dv": dv}
    return _check(tensors, **_options(locals()))


def _failure_message(report: Report) -> str:
    lines = ["attention outputs are not within attnproof's bound"]
    for o in report.outputs:
        if o.status != "fail":
            continue
        line = f"  {o.output}: error/bound {o.max_error_over_bound:.3g} at {list(o.worst_index or [])}"
        line += f" (kernel {o.worst_candidate!r}, oracle {o.worst_oracle!r}, bound {o.worst_bound!r})"
        if o.cause:
            line += f"; cause: {o.cause}"
        lines.append(line)
    lines.append(report.text)
    return "\n".join(lines)


def assert_attention_close(
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any = None,
    do: Any = None,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    *,
    require_verified: bool = False,
    **options: Any,
) -> Report:
    """Raises `AssertionError` (the cause, the worst element and the whole report in its message) unless every
    output given is within its bound; returns the report otherwise. With gradients (`do` and any of `dq`, `dk`,
    `dv`) it checks the backward too. `require_verified`: an output the model cannot bound fails too. Options as
    for `check_forward`."""
    if do is not None:
        report = check_backward(q, k, v, o, lse, do, dq, dk, dv, **options)
    else:
        if any(g is not None for g in (dq, dk, dv)):
            raise CaseError("do: gradients given without the output gradient do")
        report = check_forward(q, k, v, o, lse, **options)
    if not report.passed:
        raise AssertionError(_failure_message(report))
    if require_verified and not report.verified:
        raise AssertionError("some outputs could not be verified (require_verified=True)\n" + report.text)
    return report

