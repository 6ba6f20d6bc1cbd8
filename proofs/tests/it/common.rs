//! Proptest strategies, small deterministic generators and the agreement bar shared by the theorem tests.

use attnproof_oracle::{AttentionSpec, Layout, Mask, Mp, Precision, Scale};
use attnproof_proofs::Bits;
use attnproof_proofs::backward::{HeadCase, ProblemCase};
use attnproof_proofs::online::RowProblem;
use ndarray::{Array1, Array2, ArrayD, IxDyn};
use proptest::prelude::*;

/// The theorems' working precision.
pub const PREC: Precision = Precision(256);

/// The bits of agreement an identity theorem must reach at [`PREC`]; the 56 bits below the working precision are room
/// for the rounding of the two sides, not for a wrong formula.
pub const REQUIRED: Bits = Bits(200.0);

/// A theorem's refusal (a `Violation` or an oracle error) as a failed proptest case, keeping its message.
pub fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// An MPFR vector from f64 entries.
pub fn mp_vector(values: &[f64]) -> Array1<Mp> {
    values.iter().map(|&x| Mp::new(x, PREC)).collect()
}

/// An MPFR matrix from f64 entries.
pub fn mp_matrix(rows: usize, cols: usize, values: &[f64]) -> Array2<Mp> {
    Array2::from_shape_vec((rows, cols), values.iter().map(|&x| Mp::new(x, PREC)).collect()).expect("sizes agree")
}

pub use attnproof_oracle::inputs::uniform as pseudo_random;

/// Values in `[-1, 1]` times `magnitude`.
pub fn values(n: usize, magnitude: f64) -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(-1.0f64..=1.0, n).prop_map(move |v| v.into_iter().map(|x| x * magnitude).collect())
}

/// A row problem: `rows × keys` scores up to `±1000` (e^1000 overflows f64; MPFR does not
/// care), random visibility (fully masked rows and blocks happen), values with a non-zero mean.
pub fn row_problem() -> impl Strategy<Value = RowProblem> {
    (1usize..=3, 0usize..=9, 1usize..=3, prop::sample::select(vec![1.0, 10.0, 100.0, 1000.0]))
        .prop_flat_map(|(rows, keys, dv, logit)| {
            (
                values(rows * keys, logit),
                prop::collection::vec(prop::bool::weighted(0.75), rows * keys),
                values(keys * dv, 4.0),
                Just((rows, keys, dv)),
            )
        })
        .prop_map(|(s, vis, v, (rows, keys, dv))| RowProblem {
            scores: mp_matrix(rows, keys, &s),
            visible: Array2::from_shape_vec((rows, keys), vis).expect("sizes agree"),
            v: mp_matrix(keys, dv, &v.iter().map(|x| x + 1.0).collect::<Vec<_>>()),
        })
}

/// A row problem with a partition of its keys into contiguous blocks (some empty) and a
/// permutation of the blocks.
pub fn split_row_problem() -> impl Strategy<Value = (RowProblem, Vec<std::ops::Range<usize>>, Vec<usize>)> {
    row_problem().prop_flat_map(|p| {
        let keys = p.scores.ncols();
        (prop::collection::vec(0..=keys, 0..5), Just(p)).prop_flat_map(|(mut cuts, p)| {
            cuts.push(0);
            cuts.push(p.scores.ncols());
            cuts.sort_unstable();
            let blocks: Vec<_> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
            let order: Vec<usize> = (0..blocks.len()).collect();
            (Just(p), Just(blocks), Just(order).prop_shuffle())
        })
    })
}

/// One head's case: `Lq ≤ 4`, `Lk ≤ 5`, `d, dv ≤ 3`, random visibility, logits up to ~90.
pub fn head_case() -> impl Strategy<Value = HeadCase> {
    (1usize..=4, 1usize..=5, 1usize..=3, 1usize..=3).prop_flat_map(|(lq, lk, d, dv)| {
        (
            values(lq * d, 1.0),
            values(lk * d, 1.0),
            values(lk * dv, 3.0),
            values(lq * dv, 2.0),
            prop::collection::vec(prop::bool::weighted(0.8), lq * lk),
            prop::sample::select(vec![0.5, 3.0, 30.0]),
        )
            .prop_map(move |(q, k, v, g, vis, scale)| HeadCase {
                q: mp_matrix(lq, d, &q),
                k: mp_matrix(lk, d, &k),
                v: mp_matrix(lk, dv, &v.iter().map(|x| x - 0.5).collect::<Vec<_>>()),
                d_out: mp_matrix(lq, dv, &g),
                visible: Array2::from_shape_vec((lq, lk), vis).expect("sizes agree"),
                scale: Mp::new(scale, PREC),
            })
    })
}

/// The masks a problem strategy draws from.
pub fn mask() -> impl Strategy<Value = Mask> {
    prop_oneof![
        Just(Mask::None),
        Just(Mask::Causal),
        (0usize..3, 0usize..3).prop_map(|(left, right)| Mask::Window { left, right }),
        (0usize..3).prop_map(|left| Mask::And(vec![Mask::Causal, Mask::Window { left, right: 0 }])),
    ]
}

/// A whole problem's spec: dense or varlen (with zero-length sequences), GQA with `Hkv ≥ 1`,
/// `Lq ≠ Lk` both ways, `d ≠ dv`, all masks; lengths up to `max_len`, dims up to `max_dim`.
pub fn spec(max_len: usize, max_dim: usize) -> impl Strategy<Value = AttentionSpec> {
    let layout = prop_oneof![
        (1usize..=2, 0usize..=max_len, 0usize..=max_len).prop_map(|(batch, len_q, len_k)| Layout::Dense {
            batch,
            len_q,
            len_k
        }),
        prop::collection::vec((0usize..=max_len, 0usize..=max_len), 1..=3).prop_map(|lens| {
            let mut cu_q = vec![0i32];
            let mut cu_k = vec![0i32];
            for (lq, lk) in lens {
                cu_q.push(cu_q.last().unwrap() + lq as i32);
                cu_k.push(cu_k.last().unwrap() + lk as i32);
            }
            Layout::Varlen { cu_seqlens_q: cu_q, cu_seqlens_k: cu_k }
        }),
    ];
    (
        layout,
        1usize..=2,
        1usize..=2,
        1..=max_dim,
        1..=max_dim,
        mask(),
        prop::option::of(prop::sample::select(vec![0.25, 2.0, 8.0])),
    )
        .prop_map(|(layout, n_heads_kv, group, head_dim, head_dim_v, mask, scale)| AttentionSpec {
            layout,
            n_heads_q: n_heads_kv * group,
            n_heads_kv,
            head_dim,
            head_dim_v,
            scale: scale.map_or(Scale::InverseSqrtHeadDim, Scale::Value),
            mask,
        })
}

/// f64 tensors `q, k, v, d_out` for `spec`, entries in `[-1, 1]` (values shifted off zero mean).
pub fn f64_inputs(spec: AttentionSpec) -> impl Strategy<Value = (AttentionSpec, [ArrayD<f64>; 4])> {
    use attnproof_oracle::spec::Operand;
    let shapes = [Operand::Q, Operand::K, Operand::V, Operand::O].map(|op| spec.expected_shape(op));
    let sizes = shapes.clone().map(|s| s.iter().product::<usize>());
    (values(sizes[0], 1.0), values(sizes[1], 1.0), values(sizes[2], 2.0), values(sizes[3], 1.0)).prop_map(
        move |(q, k, v, g)| {
            let t = |i: usize, data: Vec<f64>| ArrayD::from_shape_vec(IxDyn(&shapes[i]), data).expect("sizes agree");
            (spec.clone(), [t(0, q), t(1, k), t(2, v.into_iter().map(|x| x + 0.5).collect()), t(3, g)])
        },
    )
}

/// A whole problem in MPFR for the finite-difference theorem.
pub fn problem_case() -> impl Strategy<Value = ProblemCase> {
    spec(3, 2).prop_flat_map(f64_inputs).prop_map(|(spec, [q, k, v, g])| ProblemCase {
        spec,
        q: q.mapv(|x| Mp::new(x, PREC)),
        k: k.mapv(|x| Mp::new(x, PREC)),
        v: v.mapv(|x| Mp::new(x, PREC)),
        d_out: g.mapv(|x| Mp::new(x, PREC)),
        precision: PREC,
    })
}
