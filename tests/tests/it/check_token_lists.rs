//! `check` on token-sparse cases (`token_indices`: per query row, the keys it may attend to, as DSA's selection and
//! FlashMLA's and TileLang's sparse kernels take them). An exact candidate (the oracle over the listed keys, rounded
//! to storage) passes forward and backward; one that left out a listed key, or ignored the lists, fails, and ignoring
//! them is the cause named. The visibility the tests compute is their own (from the lists and the mask, key by key),
//! not the checker's. A property test draws dense and packed layouts with empty sequences, GQA groups of 1 to 5, list
//! heads shared, per KV head and per query head, lists in any order with `−1` anywhere, and causal masks.

use attnproof_harness::case::build::CaseBuilder;
use attnproof_harness::case::safetensors::Dtype;
use attnproof_harness::case::{CaseReport, OracleChoice, Status, check, format};
use attnproof_harness::generate::{Distribution, ListStream, ValueProfile, make_case, make_d_out};
use attnproof_harness::strategies::suite_config;
use attnproof_oracle::attention::backward_with_visibility;
use attnproof_oracle::spec::{Layout, Sequence};
use attnproof_oracle::{AttentionSpec, DenseConfig, Mask, Qkv};
use half::bf16;
use ndarray::{Array2, Array3, ArrayD, Axis, Ix3};
use proptest::prelude::*;

/// One token-sparse problem: the spec (its mask is the stated one), the lists `[query rows, list heads, κ]`, and the
/// seed of its inputs.
#[derive(Clone, Debug)]
struct Problem {
    spec: AttentionSpec,
    lists: Array3<i32>,
    seed: u64,
}

impl Problem {
    /// The list head serving query head `h`: one list for all heads, one per KV head, or one per query head.
    fn list_of(&self, h: usize) -> usize {
        match self.lists.dim().1 {
            1 => 0,
            n if n == self.spec.n_heads_q => h,
            _ => h / self.spec.group_size(),
        }
    }

    /// The first list row of `seq`.
    fn first_row(&self, seq: &Sequence) -> usize {
        match &self.spec.layout {
            Layout::Dense { len_q, .. } => seq.index * len_q,
            Layout::Varlen { .. } => seq.q_start,
        }
    }

    /// Whether query `i` of `seq` sees key `j` for head `h`: listed and shown by the mask.
    fn visibility(&self, seq: &Sequence, h: usize) -> Array2<bool> {
        let mask = self.spec.mask.matrix(seq.len_q, seq.len_k);
        let (row0, list) = (self.first_row(seq), self.list_of(h));
        Array2::from_shape_fn((seq.len_q, seq.len_k), |(i, j)| {
            mask[[i, j]]
                && self.lists.index_axis(Axis(0), row0 + i).index_axis(Axis(0), list).iter().any(|&k| k == j as i32)
        })
    }
}

/// What a candidate does wrong, if anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Nothing: the oracle over the listed keys.
    None,
    /// The listed key of largest score left out of one row of head 0 (the first row that sees a key).
    DroppedKey,
    /// Every key the mask shows attended, the lists ignored.
    ListsIgnored,
}

/// The keys a candidate with `fault` attends to.
fn faulty_visibility(problem: &Problem, q: &ArrayD<f64>, k: &ArrayD<f64>, fault: Fault) -> Vec<Vec<Array2<bool>>> {
    let spec = &problem.spec;
    let mut out: Vec<Vec<Array2<bool>>> = spec
        .sequences()
        .iter()
        .map(|seq| {
            (0..spec.n_heads_q)
                .map(|h| match fault {
                    Fault::ListsIgnored => spec.mask.matrix(seq.len_q, seq.len_k),
                    _ => problem.visibility(seq, h),
                })
                .collect()
        })
        .collect();
    if fault == Fault::DroppedKey {
        let first = spec.sequences().into_iter().find_map(|seq| {
            let vis = &out[seq.index][0];
            (0..seq.len_q).find(|&i| vis.row(i).iter().any(|&v| v)).map(|i| (seq, i))
        });
        if let Some((seq, i)) = first {
            let (q3, k3) = (stacked(spec, q, &seq, true), stacked(spec, k, &seq, false));
            let score = |j: usize| (0..spec.head_dim).map(|c| q3[[i, 0, c]] * k3[[j, 0, c]]).sum::<f64>();
            let vis = &mut out[seq.index][0];
            let best = (0..seq.len_k)
                .filter(|&j| vis[[i, j]])
                .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                .expect("a visible key");
            vis[[i, best]] = false;
        }
    }
    out
}

/// One sequence's rows of a case tensor, `[len, heads, dim]`.
fn stacked(spec: &AttentionSpec, x: &ArrayD<f64>, seq: &Sequence, query: bool) -> Array3<f64> {
    let (start, len) = if query { (seq.q_start, seq.len_q) } else { (seq.k_start, seq.len_k) };
    match spec.layout {
        Layout::Dense { .. } => {
            x.index_axis(Axis(0), seq.index).permuted_axes(vec![1, 0, 2]).to_owned().into_dimensionality::<Ix3>()
        }
        Layout::Varlen { .. } => x.slice_axis(Axis(0), (start..start + len).into()).to_owned().into_dimensionality(),
    }
    .expect("a 3-D sequence")
}

/// The case of `problem` whose outputs (forward and backward) come from the oracle under `fault`'s visibility.
fn case_of(problem: &Problem, fault: Fault) -> CaseBuilder {
    let spec = &problem.spec;
    let case = make_case::<bf16>(spec, profile(), problem.seed);
    let [q, k, v] = case.widened();
    let d_out = make_d_out::<bf16>(spec, problem.seed ^ 3).mapv(|x| f64::from(x.to_f32()));
    let visible = faulty_visibility(problem, &q, &k, fault);
    let vis = |seq: &Sequence, h: usize| visible[seq.index][h].clone();
    let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
    // The gradients and the forward they used.
    let g =
        backward_with_visibility(spec, qkv, d_out.view(), &vis, DenseConfig::default(), ()).expect("oracle backward");
    let f = &g.forward;
    let mut builder = CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &q)
        .tensor("k", Dtype::Bf16, &k)
        .tensor("v", Dtype::Bf16, &v)
        .tensor("o", Dtype::Bf16, &f.o)
        .tensor("lse", Dtype::F32, &f.lse)
        .tensor("do", Dtype::Bf16, &d_out)
        .tensor("dq", Dtype::Bf16, &g.dq)
        .tensor("dk", Dtype::Bf16, &g.dk)
        .tensor("dv", Dtype::Bf16, &g.dv)
        .tensor("token_indices", Dtype::I32, &problem.lists.mapv(f64::from).into_dyn())
        .meta("causal", if matches!(spec.mask, Mask::Causal) { "true" } else { "false" })
        .meta("recipe", "bf16-in/f32-acc/p-bf16");
    if let Layout::Varlen { cu_seqlens_q, cu_seqlens_k } = &spec.layout {
        let cu = |c: &[i32]| ArrayD::from_shape_vec(vec![c.len()], c.iter().map(|&x| f64::from(x)).collect());
        builder = builder
            .tensor("cu_seqlens_q", Dtype::I32, &cu(cu_seqlens_q).expect("1-D"))
            .tensor("cu_seqlens_k", Dtype::I32, &cu(cu_seqlens_k).expect("1-D"))
            .meta("layout", "thd");
    }
    builder
}

fn profile() -> ValueProfile {
    ValueProfile { distribution: Distribution::Gaussian, logit_scale: 2.0, value_mean: 0.0 }
}

fn checked(builder: &CaseBuilder) -> CaseReport {
    check(&format::from_bytes(&builder.bytes()).expect("the case loads"), OracleChoice::F64)
}

fn status<'a>(r: &'a CaseReport, name: &str) -> &'a Status {
    &r.outputs.iter().find(|o| o.output == name).unwrap_or_else(|| panic!("no {name} in {r:?}")).status
}

/// Lists for `spec` with `heads` list heads of `width` slots: each row's keys drawn from its sequence, in a random
/// order, `−1` in the unused slots wherever they fall; every `empty_every`-th row lists nothing.
fn draw_lists(spec: &AttentionSpec, heads: usize, width: usize, seed: u64, empty_every: usize) -> Array3<i32> {
    let mut rng = ListStream::new(seed);
    let rows: usize = spec.sequences().iter().map(|s| s.len_q).sum();
    let mut lists = Array3::from_elem((rows, heads, width), -1);
    let mut row = 0;
    for seq in spec.sequences() {
        for _ in 0..seq.len_q {
            for h in 0..heads {
                let n = if row % empty_every == 0 { 0 } else { rng.below(width + 1) };
                let keys = rng.pick((0..seq.len_k).collect(), n);
                let mut slots = rng.pick((0..width).collect(), keys.len());
                // A random order of the keys in random slots.
                for i in (1..slots.len()).rev() {
                    slots.swap(i, rng.below(i + 1));
                }
                for (slot, key) in slots.into_iter().zip(keys) {
                    lists[[row, h, slot]] = key as i32;
                }
            }
            row += 1;
        }
    }
    lists
}

/// Batch 2, 4 query heads over 2 KV heads, Lq = 24 < Lk = 40, causal, lists per KV head of 9 slots; every fifth row
/// lists nothing (O = 0, LSE = −∞ there).
fn gqa_problem() -> Problem {
    let spec = AttentionSpec::dense(2, 4, 2, 24, 40, 16, 16).with_mask(Mask::Causal);
    let lists = draw_lists(&spec, 2, 9, 41, 5);
    Problem { spec, lists, seed: 17 }
}

#[test]
fn exact_token_sparse_candidates_pass_and_ignoring_the_lists_is_named() {
    let problem = gqa_problem();
    let r = checked(&case_of(&problem, Fault::None));
    let order: Vec<&str> = r.outputs.iter().map(|o| o.output).collect();
    assert_eq!(order, ["O", "LSE", "dQ", "dK", "dV"], "every output checked");
    assert!(r.outputs.iter().all(|o| o.status == Status::Pass), "{r:?}");
    let r = checked(&case_of(&problem, Fault::ListsIgnored));
    for o in &r.outputs {
        assert_eq!(o.status, Status::Fail, "{o:?}");
        let cause = o.cause.as_deref().unwrap_or_else(|| panic!("no cause for {}: {o:?}", o.output));
        assert!(cause.starts_with("lists ignored") && cause.contains("token_indices"), "{cause}");
    }
    let r = checked(&case_of(&problem, Fault::DroppedKey));
    assert_eq!(status(&r, "LSE"), &Status::Fail, "{r:?}");
}

/// In layout `bhld` the lists may also come as `[B, Lq, list heads, κ]`: the same lists, the same report.
#[test]
fn four_dimensional_lists_read_as_their_rows() {
    let problem = gqa_problem();
    let builder = case_of(&problem, Fault::None);
    let (rows, heads, width) = problem.lists.dim();
    let four = problem.lists.mapv(f64::from).into_shape_with_order(vec![2, rows / 2, heads, width]).expect("B·Lq rows");
    let (a, b) = (checked(&builder), checked(&builder.tensor("token_indices", Dtype::I32, &four)));
    assert_eq!(a, b);
    assert!(!b.failed());
}

/// One drawn problem: dense or packed (with empty sequences), GQA groups of 1 to 5, causal or not, list heads 1,
/// `Hkv` or `Hq`, up to 12 slots.
fn problem() -> impl Strategy<Value = Problem> {
    let dense =
        (1usize..=2, 1usize..=20, 1usize..=28).prop_map(|(b, lq, lk)| Layout::Dense { batch: b, len_q: lq, len_k: lk });
    let varlen = prop::collection::vec((0usize..=12, 0usize..=20), 1..=3).prop_map(|lens| {
        let (mut cu_q, mut cu_k) = (vec![0], vec![0]);
        for (lq, lk) in lens {
            cu_q.push(cu_q.last().copied().unwrap_or(0) + lq as i32);
            cu_k.push(cu_k.last().copied().unwrap_or(0) + lk as i32);
        }
        Layout::Varlen { cu_seqlens_q: cu_q, cu_seqlens_k: cu_k }
    });
    (prop_oneof![dense, varlen], 1usize..=2, 1usize..=5, any::<bool>(), 0usize..3, 0usize..=12, any::<u64>()).prop_map(
        |(layout, hkv, group, causal, heads, width, seed)| {
            let base = AttentionSpec::dense(1, hkv * group, hkv, 1, 1, 8, 8);
            let spec = AttentionSpec { layout, ..base }.with_mask(if causal { Mask::Causal } else { Mask::None });
            let heads = [1, hkv, hkv * group][heads];
            let lists = draw_lists(&spec, heads, width, seed, 7);
            Problem { spec, lists, seed }
        },
    )
}

proptest! {
    #![proptest_config(suite_config("check_token_lists", 32))]

    /// The exact candidate passes every output; one that left out a listed key fails its LSE (the dropped key has
    /// the row's largest score, so the LSE moves by at least `ln(n / (n − 1))` for `n ≤ 12` listed keys, or to `−∞`).
    #[test]
    fn exact_candidates_pass_and_a_dropped_key_fails(problem in problem()) {
        let r = checked(&case_of(&problem, Fault::None));
        prop_assert!(r.outputs.iter().all(|o| o.status == Status::Pass), "{:?}\n{:?}", problem, r);
        let sees_a_key = problem.spec.sequences().iter().any(|seq| problem.visibility(seq, 0).iter().any(|&v| v));
        if sees_a_key {
            let r = checked(&case_of(&problem, Fault::DroppedKey));
            prop_assert_eq!(status(&r, "LSE"), &Status::Fail, "{:?}\n{:?}", problem, r);
        }
    }
}
