"""The Python API of attnproof: verdicts on correct and planted-bug attention outputs, computed here with NumPy in f64
and rounded to the storage dtype, the diagnosed causes, typed errors on bad input, the pytest helpers, and the same
report as `cargo xtask check` on the same case bytes. Torch paths run where torch is installed and skip elsewhere."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import attnproof

REPO = Path(__file__).resolve().parents[2]


def attention(q, k, v, *, scale=None, causal=False, top_left=False, window=None, keep=None):
    """The textbook forward in f64 over `[B, H, L, D]` arrays (GQA by head groups): O and LSE (base e). `keep`: a
    boolean `[B, Hq, Lq, Lk]` array of the keys each query may see besides the mask (token lists)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    i = np.arange(lq)[:, None] + (0 if top_left else lk - lq)
    j = np.arange(lk)[None, :]
    visible = np.ones((lq, lk), dtype=bool)
    if causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    if keep is not None:
        visible = visible & keep
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.where(visible, np.exp(s - m_safe), 0.0)
    ell = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", p / np.where(ell > 0, ell, 1.0), v)
    lse = np.where(ell[..., 0] > 0, m_safe[..., 0] + np.log(np.where(ell[..., 0] > 0, ell[..., 0], 1.0)), -np.inf)
    return o, lse


def inputs(shape_q, shape_kv, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_kv).astype(dtype)
    v = rng.standard_normal(shape_kv).astype(dtype)
    return q, k, v


@pytest.mark.parametrize(
    "shape_q, shape_kv, causal, window",
    [
        ((1, 2, 33, 16), (1, 2, 33, 16), False, None),
        ((2, 4, 17, 32), (2, 2, 40, 32), True, None),  # GQA, Lq != Lk, bottom-right causal
        ((1, 3, 64, 8), (1, 1, 65, 8), False, (5, 0)),  # MQA, a narrow window
    ],
)
def test_a_correct_f32_forward_passes(shape_q, shape_kv, causal, window):
    q, k, v = inputs(shape_q, shape_kv)
    o, lse = attention(q, k, v, causal=causal, window=window)
    report = attnproof.check_forward(
        q, k, v, o.astype(np.float32), lse.astype(np.float32), causal=causal, window=window
    )
    assert report.passed and report.verified, report
    assert report.recipe == "f32-in/f32-acc"
    assert {o.output for o in report.outputs} == {"O", "LSE"}
    assert all(o.max_error_over_bound < 1 for o in report.outputs)
    assert report.to_dict()["status"] == "pass"


def test_a_wrong_scale_fails_and_is_named():
    q, k, v = inputs((1, 2, 40, 16), (1, 2, 40, 16), seed=1)
    o, lse = attention(q, k, v, scale=1.0 / 16)
    report = attnproof.check_forward(q, k, v, o.astype(np.float32), lse.astype(np.float32))
    assert not report.passed
    assert "wrong scale" in report.output("O").cause and "1/d" in report.output("O").cause
    with pytest.raises(AssertionError, match="cause: wrong scale"):
        attnproof.assert_attention_close(q, k, v, o.astype(np.float32), lse.astype(np.float32))


def test_top_left_causal_with_lq_ne_lk_is_named():
    q, k, v = inputs((1, 1, 12, 16), (1, 1, 30, 16), seed=2)
    o, lse = attention(q, k, v, causal=True, top_left=True)
    with pytest.raises(AssertionError, match="causal alignment"):
        attnproof.assert_attention_close(q, k, v, o.astype(np.float32), lse.astype(np.float32), causal=True)
    # Stated as top-left, the same outputs pass.
    attnproof.assert_attention_close(
        q, k, v, o.astype(np.float32), lse.astype(np.float32), causal=True, causal_align="top_left"
    )


def test_lse_in_base_two_is_named():
    q, k, v = inputs((1, 2, 20, 16), (1, 2, 20, 16), seed=3)
    o, lse = attention(q, k, v)
    report = attnproof.check_forward(q, k, v, o.astype(np.float32), (lse / math.log(2)).astype(np.float32))
    assert report.output("O").passed and not report.output("LSE").passed
    assert "base 2" in report.output("LSE").cause
    assert attnproof.check_forward(
        q, k, v, o.astype(np.float32), (lse / math.log(2)).astype(np.float32), lse_base="2"
    ).passed


def test_bf16_through_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes gives NumPy a bf16 dtype")
    bf16 = ml_dtypes.bfloat16
    q, k, v = (x.astype(bf16) for x in inputs((1, 2, 70, 64), (1, 2, 70, 64), seed=4))
    o, lse = attention(q, k, v, causal=True)
    report = attnproof.check_forward(q, k, v, o.astype(bf16), lse.astype(np.float32), causal=True)
    assert report.passed and report.recipe == "bf16-in/f32-acc/p-bf16", report
    # One output element off by far more than bf16's rounding: the check fails at that element.
    bad = o.astype(bf16)
    bad[0, 1, 69, 3] = bf16(float(bad[0, 1, 69, 3]) + 0.5)
    report = attnproof.check_forward(q, k, v, bad, lse.astype(np.float32), causal=True)
    assert not report.output("O").passed and report.output("O").worst_index == (0, 1, 69, 3)


def test_the_backward_is_checked():
    q, k, v = inputs((1, 2, 24, 16), (1, 2, 24, 16), seed=5)
    d_out = np.random.default_rng(6).standard_normal(q.shape).astype(np.float32)
    o, lse = attention(q, k, v)
    # Gradients by central differences would be too coarse; the exact ones come from the textbook backward.
    qd, kd, vd, gd = (x.astype(np.float64) for x in (q, k, v, d_out))
    s = np.einsum("bhid,bhjd->bhij", qd, kd) / 4.0
    p = np.exp(s - lse[..., None])
    dv = np.einsum("bhij,bhid->bhjd", p, gd)
    dp = np.einsum("bhid,bhjd->bhij", gd, vd)
    ds = p * (dp - (gd * o).sum(-1, keepdims=True))
    dq = np.einsum("bhij,bhjd->bhid", ds, kd) / 4.0
    dk = np.einsum("bhij,bhid->bhjd", ds, qd) / 4.0
    f32 = [x.astype(np.float32) for x in (o, lse, dq, dk, dv)]
    report = attnproof.check_backward(q, k, v, f32[0], f32[1], d_out, f32[2], f32[3], f32[4])
    assert report.passed, report
    assert {o.output for o in report.outputs} >= {"dQ", "dK", "dV"}
    # dK with the wrong sign fails.
    report = attnproof.check_backward(q, k, v, f32[0], f32[1], d_out, f32[2], -f32[3], f32[4])
    assert not report.output("dK").passed and report.output("dQ").passed


def token_lists(rows, heads, width, keys, seed):
    """Key lists `[rows, heads, width]`: each row's keys drawn from `range(keys)` in a random order and random slots,
    -1 in the others."""
    rng = np.random.default_rng(seed)
    lists = np.full((rows, heads, width), -1, np.int32)
    for r in range(rows):
        for h in range(heads):
            chosen = rng.choice(keys, size=min(int(rng.integers(0, width + 1)), keys), replace=False)
            lists[r, h, rng.choice(width, size=len(chosen), replace=False)] = chosen
    return lists


def listed(lists, b, hq, lq, lk):
    """The boolean `[B, Hq, Lq, Lk]` keys of lists `[B*Lq, list heads, width]` (list head `h // (Hq / heads)`)."""
    out = np.zeros((b, hq, lq, lk), dtype=bool)
    group = hq // lists.shape[1]
    for batch in range(b):
        for h in range(hq):
            for i in range(lq):
                keys = lists[batch * lq + i, h // group]
                out[batch, h, i, keys[keys >= 0]] = True
    return out


def test_token_lists_select_the_keys_each_query_sees():
    # GQA 4 over 2, Lq = 9 < Lk = 20, bottom-right causal, one list per KV head (DSA's selection, FlashMLA's indices).
    q, k, v = inputs((2, 4, 9, 16), (2, 2, 20, 16), seed=3)
    lists = token_lists(2 * 9, 2, 5, 20, seed=4)
    o, lse = attention(q, k, v, causal=True, keep=listed(lists, 2, 4, 9, 20))
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    report = attnproof.check_forward(q, k, v, o, lse, causal=True, token_indices=lists)
    assert report.passed, report
    # Stating one listed key fewer than the candidate attended to (a visible key of batch 0, KV head 0) fails.
    row, key = next((r, j) for r in range(9) for j in lists[r, 0] if 0 <= j <= r + 20 - 9)
    fewer = lists.copy()
    fewer[row, 0][fewer[row, 0] == key] = -1
    report = attnproof.check_forward(q, k, v, o, lse, causal=True, token_indices=fewer)
    assert not report.output("O").passed and not report.output("LSE").passed


@pytest.mark.parametrize(
    "change, argument",
    [
        (lambda a: dict(a, q=a["q"][..., :-1]), "k"),  # D of q and k differ
        (lambda a: dict(a, causal_align="diagonal"), "causal_align"),
        (lambda a: dict(a, lse_base="10"), "lse_base"),
        (lambda a: dict(a, window=(3,)), "window"),
        (lambda a: dict(a, q=a["q"].astype(np.int8)), "q"),
        (lambda a: dict(a, block_indices=np.zeros((1, 1, 1, 1), np.int32)), "block_size"),
        (lambda a: dict(a, token_indices=np.full((8, 1, 2), 8, np.int32)), "token_indices"),  # key 8 of Lk = 8
        (lambda a: dict(a, token_indices=np.zeros((8, 1, 2), np.int32)), "token_indices"),  # key 0 twice
        (lambda a: dict(a, q=np.full_like(a["q"], np.nan)), "q"),
        (lambda a: dict(a, masked_lse="nan"), "masked_lse"),
        (lambda a: dict(a, kernel_params={"tile": 64}), "kernel_params"),
        (lambda a: dict(a, kernel_params={"kv_tile": 0}), "kernel_kv_tile"),
        (lambda a: dict(a, kernel_params={"exp": "exp10"}), "kernel_exp"),
    ],
)
def test_bad_input_is_a_case_error_naming_the_argument(change, argument):
    q, k, v = inputs((1, 1, 8, 8), (1, 1, 8, 8))
    o, lse = attention(q, k, v)
    args = change(dict(q=q, k=k, v=v, o=o.astype(np.float32), lse=lse.astype(np.float32)))
    with pytest.raises(attnproof.CaseError, match=argument) as caught:
        attnproof.check_forward(**args)
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert "Some(" not in message and "None" not in message
    # Every backquoted span is a bare name: no nested quotes, no prose inside them.
    assert all(span.replace("_", "").isalnum() for span in message.split("`")[1::2]), message


def tf32(x):
    """`x` rounded to TF32 (10 fraction bits, to nearest with ties to even), as a TF32 tensor core reads an f32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    return bits.astype(np.uint32).view(np.float32)


def test_stated_kernel_parameters_are_used_and_reported():
    """The bound takes the stated parameters and says so. A kernel whose products run in TF32 (here the exact forward
    of TF32-rounded inputs) passes the worst-case f32 bound over 4096 keys, fails it once the kernel's 64-key tiles
    are stated, with TF32 named, and passes the f32-in/tf32 recipe. The inputs make TF32 show: every query element
    1 + 3*2^-12 (rounded up by TF32), keys of negative scores, and a last key that TF32 raises and that carries most of
    the weight."""
    _, k, v = inputs((1, 1, 4, 32), (1, 1, 4096, 32), seed=11)
    q = np.full((1, 1, 4, 32), 1 + 3 * 2.0**-12, np.float32)
    k = (0.3 * k - 0.35).astype(np.float32)
    k[:, :, -1, :] = 1.5 + 4.5 * 2.0**-12
    o, lse = attention(tf32(q), tf32(k), tf32(v))
    args = (q, k, v, o.astype(np.float32), lse.astype(np.float32))
    params = {"kv_tile": 64, "mma_k": 8, "exp": "ex2", "split_kv": 1}
    stated = attnproof.check_forward(*args, kernel_params=params)
    assert stated.kernel_params == {"kv_tile": 64, "q_tile": None, "mma_k": 8, "exp": "ex2", "split_kv": 1}
    assert "kv_tile 64 (stated)" in stated.assumptions and "q_tile 1 (worst case)" in stated.assumptions
    assert "bound assumes: kv_tile 64 (stated)" in stated.text
    unstated = attnproof.check_forward(*args)
    assert "kv_tile 1 (worst case)" in unstated.assumptions
    assert unstated.passed and not stated.passed, (unstated, stated)
    assert "TF32" in (stated.output("LSE").cause or ""), stated
    assert attnproof.check_forward(*args, recipe="f32-in/tf32", kernel_params=params).passed


def test_plus_infinity_for_rows_that_see_no_key():
    """FlashAttention's LSE of +inf for a row that sees no key passes when stated, fails when not."""
    q, k, v = inputs((1, 1, 12, 8), (1, 1, 6, 8), seed=13)
    o, lse = attention(q, k, v, causal=True)  # bottom-right: the first 6 rows see no key
    assert np.isneginf(lse[0, 0, :6]).all()
    flash_lse = np.where(np.isneginf(lse), np.inf, lse).astype(np.float32)
    args = (q, k, v, o.astype(np.float32), flash_lse)
    assert attnproof.check_forward(*args, causal=True, masked_lse="+inf").passed
    assert not attnproof.check_forward(*args, causal=True).output("LSE").passed


def test_planted_mask_bugs_are_named():
    """An exact forward with the causal diagonal left out, or the last key dropped, fails with that cause named."""
    q, k, v = inputs((1, 2, 20, 16), (1, 2, 32, 16), seed=14)
    o_strict = np.stack([np.stack([_row_strict(q[0, h], k[0, h], v[0, h]) for h in range(2)])])
    report = attnproof.check_forward(q, k, v, o_strict.astype(np.float32), causal=True)
    assert "causal off by one" in (report.output("O").cause or ""), report
    o_short, _ = attention(q, k[:, :, :-1], v[:, :, :-1])
    report = attnproof.check_forward(q, k, v, o_short.astype(np.float32))
    assert "left out the last key" in (report.output("O").cause or ""), report


def _row_strict(q, k, v):
    """O of one head under a bottom-right causal mask that leaves out each query's diagonal key (j < i)."""
    lq, lk = q.shape[0], k.shape[0]
    s = q @ k.T / math.sqrt(q.shape[1])
    visible = np.arange(lk)[None, :] < np.arange(lq)[:, None] + (lk - lq)
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.where(visible, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    ell = p.sum(axis=1, keepdims=True)
    return (p / np.where(ell > 0, ell, 1.0)) @ v


def test_the_fixture(attention_check):
    q, k, v = inputs((1, 1, 9, 8), (1, 1, 9, 8))
    o, lse = attention(q, k, v)
    report = attention_check(q, k, v, o.astype(np.float32), lse.astype(np.float32))
    assert report.passed


def test_the_report_reads_cleanly():
    q, k, v = inputs((1, 1, 9, 8), (1, 1, 9, 8))
    o, lse = attention(q, k, v, scale=1.0)
    report = attnproof.check_forward(q, k, v, o.astype(np.float32), lse.astype(np.float32), kernel="mine")
    text = repr(report)
    assert text.startswith("FAIL") and "kernel \"mine\"" in text and "<in memory>" not in text
    assert json.loads(json.dumps(report.to_dict()))["outputs"][0]["output"] == "O"


def check_binary():
    """The `check` binary the CLI comparisons run, or a skip where it is not built (a failure in CI, which builds it
    and sets ATTNPROOF_REQUIRE_CLI, so that these comparisons cannot silently skip there)."""
    binary = Path(os.environ.get("ATTNPROOF_CHECK_BINARY", REPO / "target" / "release" / "check"))
    if not binary.exists():
        assert not os.environ.get("ATTNPROOF_REQUIRE_CLI"), f"ATTNPROOF_REQUIRE_CLI is set but {binary} is missing"
        pytest.skip(f"no {binary}: build it with `cargo build --release -p attnproof-harness --bin check`")
    return binary


def assert_same_report_as_the_cli(path: Path):
    """The in-process report of the case file at `path` equals the `check` binary's, field for field."""
    cli = subprocess.run([str(check_binary()), "--json", str(path)], capture_output=True, text=True)
    assert cli.returncode in (0, 1), (path, cli.returncode, cli.stdout, cli.stderr)
    from_cli = json.loads(cli.stdout)[0]
    in_process = json.loads(attnproof._native.check_case(path.read_bytes())[0])
    from_cli.pop("path"), in_process.pop("path")
    assert in_process == from_cli, path
    return from_cli


def _cases():
    """Case files of every kind the checker reads, passing and failing: (name, tensors, metadata)."""
    q, k, v = inputs((1, 2, 30, 16), (1, 1, 45, 16), seed=7)
    o, lse = attention(q, k, v, causal=True, scale=0.5)
    f32 = {"q": q, "k": k, "v": v, "o": o.astype(np.float32), "lse": lse.astype(np.float32)}
    yield "wrong scale", f32, {"recipe": "f32-in/f32-acc", "causal": "true", "scale": "0.25"}
    yield "stated parameters", f32, {
        "recipe": "f32-in/f32-acc", "causal": "true", "scale": "0.5", "kernel_kv_tile": "16", "kernel_exp": "ex2"
    }
    yield "tf32 recipe", f32, {"recipe": "f32-in/tf32", "causal": "true", "scale": "0.5", "kernel_mma_k": "8"}
    q, k, v = inputs((1, 4, 24, 16), (1, 2, 24, 8 * 2), seed=8)
    o, lse = attention(q, k, v, window=(5, 2))
    yield "window off by one", {"q": q, "k": k, "v": v, "o": o.astype(np.float32)}, {
        "recipe": "f32-in/f32-acc", "window_left": "4", "window_right": "2"
    }
    q, k, v = inputs((1, 1, 12, 8), (1, 1, 6, 8), seed=13)
    o, lse = attention(q, k, v, causal=True)
    plus_inf = np.where(np.isneginf(lse), np.inf, lse).astype(np.float32)
    yield "masked lse", {"q": q, "k": k, "v": v, "o": o.astype(np.float32), "lse": plus_inf}, {
        "recipe": "f32-in/f32-acc", "causal": "true", "masked_lse": "+inf"
    }
    packed = {"q": q[0].transpose(1, 0, 2), "k": k[0].transpose(1, 0, 2), "v": v[0].transpose(1, 0, 2)}
    cu = {"cu_seqlens_q": np.array([0, 5, 12], np.int32), "cu_seqlens_k": np.array([0, 2, 6], np.int32)}
    o_varlen = np.zeros((12, 1, 8), np.float32)
    yield "varlen", {**packed, **cu, "o": o_varlen}, {"recipe": "f32-in/f32-acc", "layout": "thd"}


@pytest.mark.parametrize("name, tensors, metadata", list(_cases()), ids=[c[0] for c in _cases()])
def test_the_same_report_as_the_cli(tmp_path, name, tensors, metadata):
    """The bytes the Python API checks, written to a file and given to the `check` binary, get the same report."""
    path = tmp_path / "case.safetensors"
    path.write_bytes(attnproof.case_bytes(tensors, metadata))
    report = assert_same_report_as_the_cli(path)
    assert report["status"] in ("pass", "fail"), (name, report)


def test_peer_cases_get_the_same_report_as_the_cli():
    """The case files `python/examples/dump_peers.py` writes from PyTorch's kernels (a directory named by
    ATTNPROOF_PEER_CASES; the GPU bundle's Python run sets it), each reported alike in-process and by the CLI."""
    directory = os.environ.get("ATTNPROOF_PEER_CASES")
    if not directory:
        assert not os.environ.get("ATTNPROOF_REQUIRE_TORCH"), "the GPU bundle's run must name its peer cases"
        pytest.skip("ATTNPROOF_PEER_CASES names no directory of peer case files (the GPU bundle sets it)")
    paths = sorted(Path(directory).glob("*.safetensors"))
    assert paths, f"no case files in {directory}"
    for path in paths:
        assert_same_report_as_the_cli(path)


def import_torch():
    """torch, or a skip where it is not installed (a failure where ATTNPROOF_REQUIRE_TORCH is set: the GPU bundle)."""
    if os.environ.get("ATTNPROOF_REQUIRE_TORCH"):
        import torch

        return torch
    return pytest.importorskip("torch", reason="torch is not installed")


def test_torch_tensors_when_torch_is_installed():
    torch = import_torch()
    if os.environ.get("ATTNPROOF_REQUIRE_TORCH"):
        assert torch.cuda.is_available(), "ATTNPROOF_REQUIRE_TORCH is set, but torch sees no CUDA device"
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in inputs((1, 2, 50, 32), (1, 2, 50, 32), seed=8))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        qd, kd, vd = (x.to(device) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        report = attnproof.check_forward(
            qd, kd, vd, o, causal=True, causal_align="top_left", recipe="bf16-in/f32-math"
        )
        assert report.passed, (device, report)


def test_every_public_function_has_a_docstring():
    for name in attnproof.__all__:
        obj = getattr(attnproof, name)
        if callable(obj):
            assert obj.__doc__, name

