//! `check` on case files written from Rust: correct candidates (the reference schedules, the
//! oracle rounded to storage) pass; deliberately wrong uses (scale 1/d, top-left causal stated
//! as bottom-right, LSE in base 2, unnormalized O, a corrupted tile) fail with the cause named;
//! the binary's exit codes are 0, 1 and 2.

use std::path::PathBuf;
use std::process::Command;

use attnproof_harness::Case;
use attnproof_harness::case::build::CaseBuilder;
use attnproof_harness::case::check::MAX_REGIONS;
use attnproof_harness::case::safetensors::Dtype;
use attnproof_harness::case::{CaseReport, OracleChoice, Status, check, format};
use attnproof_harness::generate::{Distribution, ValueProfile, make_case, make_d_out};
use attnproof_oracle::attention::forward_with_visibility;
use attnproof_oracle::spec::{Mask, Operand, Pair, Predicate, Sequence};
use attnproof_oracle::{AttentionSpec, DenseConfig, Layout, Qkv, Scale, forward};
use attnproof_reference::{
    BackwardOutputs, BackwardStrategy, Element, TileConfig, flash_backward, flash_forward_owned,
};
use half::bf16;
use ndarray::{ArrayD, Axis, s};

const TILES: TileConfig = TileConfig { q_tile: 16, kv_tile: 16 };

fn profile() -> ValueProfile {
    ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 }
}

/// A reference forward + backward on `spec` (computed under `computed`'s scale and mask),
/// written as a case stating `spec`'s metadata.
struct Written {
    builder: CaseBuilder,
    lse: ArrayD<f64>,
    o: ArrayD<f64>,
}

fn widen<T: Element>(t: &ArrayD<T>) -> ArrayD<f64> {
    t.mapv(|x| x.to_f32() as f64)
}

fn reference_case(stated: &AttentionSpec, computed: &AttentionSpec, seed: u64, causal: &str, align: &str) -> Written {
    let case: Case<bf16> = make_case(computed, profile(), seed);
    let (o, lse) = flash_forward_owned(computed, &case.inputs(), TILES).expect("reference forward");
    let d_out = make_d_out::<bf16>(computed, seed ^ 7);
    let zeros = |op| ArrayD::from_elem(computed.expected_shape(op), bf16::ZERO);
    let (mut dq, mut dk, mut dv) = (zeros(Operand::Q), zeros(Operand::K), zeros(Operand::V));
    let mut delta = ArrayD::from_elem(computed.expected_shape(Operand::RowStat), 0f32);
    let inputs = case.backward_inputs(&o, &lse, &d_out);
    let outputs = BackwardOutputs { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut(), delta: delta.view_mut() };
    flash_backward(computed, &inputs, TILES, BackwardStrategy::KvOwnerPartialDq, outputs).expect("reference backward");
    let scale = match stated.scale {
        Scale::Value(x) => x,
        Scale::InverseSqrtHeadDim => 1.0 / (stated.head_dim as f64).sqrt(),
    };
    let builder = CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &widen(&case.q))
        .tensor("k", Dtype::Bf16, &widen(&case.k))
        .tensor("v", Dtype::Bf16, &widen(&case.v))
        .tensor("o", Dtype::Bf16, &widen(&o))
        .tensor("lse", Dtype::F32, &lse.mapv(|x| x as f64))
        .tensor("do", Dtype::Bf16, &widen(&d_out))
        .tensor("dq", Dtype::Bf16, &widen(&dq))
        .tensor("dk", Dtype::Bf16, &widen(&dk))
        .tensor("dv", Dtype::Bf16, &widen(&dv))
        .meta("format_version", "1")
        .meta("layout", "bhld")
        .meta("causal", causal)
        .meta("causal_align", align)
        .meta("scale", &format!("{scale:?}"))
        .meta("lse_base", "e")
        .meta("recipe", "bf16-in/f32-acc/p-bf16")
        .meta("kernel", "attnproof reference schedule");
    Written { builder, lse: lse.mapv(|x| x as f64), o: widen(&o) }
}

/// Batch 1, 4 query heads over 2 KV heads, Lq = 24 < Lk = 40, d = 16.
fn gqa_spec() -> AttentionSpec {
    AttentionSpec::dense(1, 4, 2, 24, 40, 16, 16)
}

fn top_left() -> Mask {
    Mask::Predicate(Predicate {
        name: "top-left causal".into(),
        visible: std::sync::Arc::new(|p: Pair| p.key <= p.query),
    })
}

fn checked(builder: &CaseBuilder) -> CaseReport {
    let case = format::from_bytes(&builder.bytes()).expect("the case loads");
    check(&case, OracleChoice::F64)
}

fn output<'a>(r: &'a CaseReport, name: &str) -> &'a attnproof_harness::case::OutputReport {
    r.outputs.iter().find(|o| o.output == name).unwrap_or_else(|| panic!("no output {name} in {r:?}"))
}

fn assert_all_pass(r: &CaseReport) {
    for o in &r.outputs {
        assert_eq!(o.status, Status::Pass, "{o:?}");
    }
    let order: Vec<&str> = r.outputs.iter().map(|o| o.output).collect();
    assert_eq!(order, ["O", "LSE", "dQ", "dK", "dV"], "every output checked, in report order");
}

fn assert_cause(r: &CaseReport, name: &str, words: &str) {
    let o = output(r, name);
    assert_eq!(o.status, Status::Fail, "{o:?}");
    let cause = o.cause.as_deref().unwrap_or_else(|| panic!("no cause named for {name}: {o:?}"));
    assert!(cause.contains(words), "cause {cause:?} should mention {words:?}");
    // A named cause explains the whole output, so no rectangle of failing elements is listed beside it.
    assert!(o.regions.is_empty() && o.more_regions == 0, "{o:?}");
}

#[test]
fn reference_schedule_passes_causal_gqa_forward_and_backward() {
    let spec = gqa_spec().with_mask(Mask::Causal);
    let w = reference_case(&spec, &spec, 11, "true", "bottom_right");
    let r = checked(&w.builder);
    assert_all_pass(&r);
    assert!(
        r.gate.as_ref().is_some_and(|g| g.valid()),
        "the bounds must reject the canned wrong answers: {:?}",
        r.gate
    );
}

/// A case file is a candidate like the reference schedule and the GPU kernels: its forward, read from the file,
/// passes the same runner with a valid gate; the same file with a corrupted `O` fails it; what the seam does not
/// cover (a backward, whose D the file lacks; another storage type) is a typed `Unsupported`, never a pass.
#[test]
fn case_file_is_a_candidate_of_the_common_runner() {
    use attnproof_harness::adversarial::{Repeat, forward_verdicts};
    use attnproof_harness::candidate::{Candidate, CandidateError};
    use attnproof_harness::case::candidate::CaseFileCandidate;
    let spec = gqa_spec().with_mask(Mask::Causal);
    let w = reference_case(&spec, &spec, 11, "true", "bottom_right");
    let file = format::from_bytes(&w.builder.bytes()).expect("the case loads");
    let candidate = CaseFileCandidate { file: &file };
    let case = candidate.case::<bf16>().expect("bf16 inputs");
    let verdicts = forward_verdicts(&candidate, &[&case], Repeat::Never).expect("the file's forward passes");
    assert!(verdicts.iter().all(|v| v.passed() && v.valid()));

    let mut corrupted_o = w.o.clone();
    corrupted_o[[0, 1, 3, 2]] += 0.5;
    let corrupted = format::from_bytes(&w.builder.clone().tensor("o", Dtype::Bf16, &corrupted_o).bytes()).unwrap();
    let bad = CaseFileCandidate { file: &corrupted };
    assert!(forward_verdicts(&bad, &[&case], Repeat::Never).is_err(), "a corrupted O must fail");

    let unsupported = |r: Result<_, CandidateError>| matches!(r, Err(CandidateError::Unsupported { .. }));
    let forward = candidate.forward(&case).unwrap();
    let d_out = make_d_out::<bf16>(&spec, 1);
    assert!(unsupported(candidate.backward((), &case, &forward, &d_out).map(|_| ())));
    assert!(unsupported(candidate.case::<half::f16>().map(|_| ())));

    // What the runner asks of every candidate: a name naming the kernel and recipe, one strategy, deterministic,
    // stateless, and the backward recipe exactly when the recipe has a backward model.
    let name = candidate.name();
    assert!(name.contains("attnproof reference schedule") && name.contains("bf16-in/f32-acc/p-bf16"), "{name}");
    assert_eq!(candidate.strategies().len(), 1);
    assert!(candidate.is_deterministic(()) && !candidate.keeps_state());
    let recipe = candidate.backward_recipe::<bf16>(&spec).expect("this recipe has a backward model");
    assert_eq!(recipe.recipe, file.recipe.flash);
    let math = format::from_bytes(&w.builder.clone().meta("recipe", "bf16-in/bf16-math").bytes()).unwrap();
    assert!(!math.recipe.has_backward_model());
    assert!(unsupported(CaseFileCandidate { file: &math }.backward_recipe::<bf16>(&spec).map(|_| ())));

    // The file's outputs answer only for the file's own inputs: other values of the same shape are refused, one
    // tensor at a time.
    for (n, name) in ["q", "k", "v"].into_iter().enumerate() {
        let mut other = case.clone();
        let tensor = match n {
            0 => &mut other.q,
            1 => &mut other.k,
            _ => &mut other.v,
        };
        let first = tensor.iter_mut().next().unwrap();
        *first = bf16::from_f32(first.to_f32() + 1.0);
        assert!(unsupported(candidate.forward(&other).map(|_| ())), "{name} changed");
    }
    let base2 = format::from_bytes(&w.builder.clone().meta("lse_base", "2").bytes()).unwrap();
    assert!(unsupported(CaseFileCandidate { file: &base2 }.forward(&case).map(|_| ())), "an LSE in base 2");
}

/// The gate scores canned forward answers whenever the case has a forward output to judge (`O`, `LSE` or both), and
/// only then.
#[test]
fn the_gate_runs_when_a_forward_output_is_present() {
    let spec = gqa_spec();
    let w = reference_case(&spec, &spec, 18, "false", "bottom_right");
    for (without, gate) in [(&["lse"][..], true), (&["o"], true), (&["o", "lse"], false)] {
        let builder = without.iter().fold(w.builder.clone(), |b, name| b.without(name));
        let r = checked(&builder);
        assert_eq!(r.gate.is_some(), gate, "without {without:?}: {:?}", r.gate);
        if gate {
            assert!(r.gate.as_ref().is_some_and(|g| g.valid() && !g.canned.is_empty()), "{:?}", r.gate);
        }
    }
}

#[test]
fn reference_schedule_passes_top_left_causal_when_stated() {
    let spec = gqa_spec().with_mask(top_left());
    let w = reference_case(&spec, &spec, 12, "true", "top_left");
    assert_all_pass(&checked(&w.builder));
}

#[test]
fn scale_one_over_d_fails_and_is_named() {
    let stated = gqa_spec();
    let computed = stated.clone().with_scale(Scale::Value(1.0 / 16.0));
    let r = checked(&reference_case(&stated, &computed, 13, "false", "bottom_right").builder);
    for name in ["O", "LSE", "dQ", "dK", "dV"] {
        assert_cause(&r, name, "scale 1/d");
    }
}

#[test]
fn top_left_causal_stated_as_bottom_right_fails_and_is_named() {
    let stated = gqa_spec().with_mask(Mask::Causal);
    let computed = gqa_spec().with_mask(top_left());
    let r = checked(&reference_case(&stated, &computed, 14, "true", "bottom_right").builder);
    for name in ["O", "LSE"] {
        assert_cause(&r, name, "aligned the causal mask top_left");
    }
}

/// A causal mask left out against the statement, or applied against it (bottom-right or top-left when `Lq ≠ Lk`; the
/// one causal mask when `Lq = Lk`), is named as such.
#[test]
fn a_causal_mask_left_out_or_applied_against_the_statement_is_named() {
    let none = gqa_spec();
    let causal = gqa_spec().with_mask(Mask::Causal);
    let r = checked(&reference_case(&causal, &none, 21, "true", "bottom_right").builder);
    assert_cause(&r, "O", "applied no causal mask");
    let r = checked(&reference_case(&none, &causal, 22, "false", "bottom_right").builder);
    assert_cause(&r, "O", "applied a causal mask (bottom_right)");
    let r = checked(&reference_case(&none, &gqa_spec().with_mask(top_left()), 23, "false", "bottom_right").builder);
    assert_cause(&r, "O", "applied a causal mask (top_left)");
    let square = AttentionSpec::dense(1, 2, 1, 32, 32, 16, 16);
    let r =
        checked(&reference_case(&square, &square.clone().with_mask(Mask::Causal), 24, "false", "bottom_right").builder);
    assert_cause(&r, "O", "applied a causal mask (bottom_right)");
}

/// A sliding window placed from the wrong corner (top-left instead of the stated bottom-right, Lq ≠ Lk) is named,
/// as a causal mask's alignment is.
#[test]
fn a_window_aligned_from_the_wrong_corner_is_named() {
    let window = |align: &'static str| {
        let (left, right) = (3i64, 1i64);
        Mask::Predicate(Predicate {
            name: format!("{align} window"),
            visible: std::sync::Arc::new(move |p: Pair| {
                let i = if align == "top_left" { p.query as i64 } else { p.aligned_query() };
                let j = p.key as i64;
                i - left <= j && j <= i + right
            }),
        })
    };
    let stated = gqa_spec().with_mask(window("bottom_right"));
    let computed = gqa_spec().with_mask(window("top_left"));
    let builder = reference_case(&stated, &computed, 25, "false", "bottom_right").builder;
    let r = checked(&builder.meta("window_left", "3").meta("window_right", "1"));
    assert_cause(&r, "O", "aligned the window top_left");
}

#[test]
fn lse_in_base_two_fails_and_is_named_while_o_passes() {
    let spec = gqa_spec();
    let w = reference_case(&spec, &spec, 15, "false", "bottom_right");
    let base2 = w.lse.mapv(|x| x / std::f64::consts::LN_2);
    let r = checked(&w.builder.tensor("lse", Dtype::F32, &base2));
    assert_cause(&r, "LSE", "base 2");
    assert_eq!(output(&r, "O").status, Status::Pass);
}

/// Two faults at once, each judged on its own: an LSE in base 2 is named although `O` also fails, for a reason no
/// hypothesis explains (a corrupted tile), and that tile is still reported as its rectangle. A hypothesis is tried
/// only on the outputs it can explain.
#[test]
fn an_explained_fault_is_named_beside_an_unexplained_one() {
    let spec = gqa_spec();
    let w = reference_case(&spec, &spec, 19, "false", "bottom_right");
    let base2 = w.lse.mapv(|x| x / std::f64::consts::LN_2);
    let mut o = w.o.clone();
    o.slice_mut(s![0, 2, 0..8, 0..4]).mapv_inplace(|x| x + 0.5);
    let r = checked(&w.builder.clone().tensor("lse", Dtype::F32, &base2).tensor("o", Dtype::Bf16, &o));
    assert_cause(&r, "LSE", "base 2");
    let out = output(&r, "O");
    assert_eq!((out.status.clone(), out.cause.clone()), (Status::Fail, None), "{out:?}");
    assert_eq!(out.regions.len(), 1, "{out:?}");
}

#[test]
fn unnormalized_o_fails_and_is_named() {
    let spec = gqa_spec();
    let w = reference_case(&spec, &spec, 16, "false", "bottom_right");
    let case = format::from_bytes(&w.builder.bytes()).expect("loads");
    // A = O·ℓ with ℓ_i = exp(LSE_i − m_i), m_i the row max of the exact scores.
    let scale = 0.25;
    let mut a = w.o.clone();
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let q = spec.head_rows(case.q.view(), &seq, h, false);
            let k = spec.head_rows(case.k.view(), &seq, spec.kv_head(h), true);
            let lse = spec.head_row_stat(w.lse.view(), &seq, h);
            let mut rows = a.slice_mut(spec.head_slice(&seq, h, false));
            for (i, mut row) in rows.axis_iter_mut(Axis(0)).enumerate() {
                let m = k.rows().into_iter().map(|kj| scale * q.row(i).dot(&kj)).fold(f64::NEG_INFINITY, f64::max);
                let l = (lse[i] - m).exp();
                row.mapv_inplace(|x| x * l);
            }
        }
    }
    let r = checked(&w.builder.clone().tensor("o", Dtype::Bf16, &a));
    assert_cause(&r, "O", "unnormalized O");
}

#[test]
fn corrupted_tile_is_reported_as_its_rectangle() {
    let spec = gqa_spec();
    let w = reference_case(&spec, &spec, 17, "false", "bottom_right");
    let mut o = w.o.clone();
    o.slice_mut(s![0, 1, 8..16, 4..12]).mapv_inplace(|x| x + 0.5);
    let r = checked(&w.builder.clone().tensor("o", Dtype::Bf16, &o));
    let out = output(&r, "O");
    assert_eq!(out.status, Status::Fail);
    assert!(out.cause.is_none(), "no hypothesis explains a corrupted tile: {out:?}");
    assert_eq!(out.regions.len(), 1, "{out:?}");
    let region = &out.regions[0];
    assert_eq!((region.prefix.as_slice(), region.rows.clone(), region.cols.clone()), (&[0, 1][..], 8..16, 4..12));
    assert_eq!(region.failing, 64);
    assert_eq!(output(&r, "LSE").status, Status::Pass);
}

/// Failing elements are reported as rectangles per head: rows run together only when adjacent, and a rectangle spans
/// the widest of its rows whether that row comes first or last; a lone element is a rectangle of one.
#[test]
fn failing_elements_are_grouped_into_rectangles_of_adjacent_rows() {
    let spec = gqa_spec();
    let w = reference_case(&spec, &spec, 26, "false", "bottom_right");
    let mut o = w.o.clone();
    for (head, row, cols) in [(1, 8, 0..4), (1, 9, 0..10), (1, 12, 2..3), (2, 0, 0..8), (2, 1, 0..2)] {
        o.slice_mut(s![0, head, row, cols]).mapv_inplace(|x| x + 0.5);
    }
    let r = checked(&w.builder.clone().tensor("o", Dtype::Bf16, &o));
    let out = output(&r, "O");
    assert_eq!(out.status, Status::Fail);
    type Rectangle = (Vec<usize>, std::ops::Range<usize>, std::ops::Range<usize>, usize);
    let got: Vec<Rectangle> =
        out.regions.iter().map(|r| (r.prefix.clone(), r.rows.clone(), r.cols.clone(), r.failing)).collect();
    assert_eq!(
        got,
        [(vec![0, 1], 8..10, 0..10, 14), (vec![0, 1], 12..13, 2..3, 1), (vec![0, 2], 0..2, 0..8, 10)],
        "{out:?}"
    );
    assert_eq!(out.more_regions, 0);

    // Ten separate rows: the report lists MAX_REGIONS of them and counts the rest.
    let mut o = w.o.clone();
    for row in (0..20).step_by(2) {
        o[[0, 0, row, 5]] += 0.5;
    }
    let r = checked(&w.builder.clone().tensor("o", Dtype::Bf16, &o));
    let out = output(&r, "O");
    assert_eq!((out.regions.len(), out.more_regions), (MAX_REGIONS, 10 - MAX_REGIONS));
    assert_eq!(out.regions[0].rows, 0..1);
}

/// The oracle's forward rounded to storage: a correct candidate for any mask or layout.
fn oracle_candidate(
    spec: &AttentionSpec,
    visibility: attnproof_oracle::attention::Visibility<'_>,
    seed: u64,
) -> CaseBuilder {
    let case: Case<bf16> = make_case(spec, profile(), seed);
    let [q, k, v] = case.widened();
    let f = forward_with_visibility(
        spec,
        Qkv { q: q.view(), k: k.view(), v: v.view() },
        visibility,
        DenseConfig::default(),
        (),
    )
    .expect("oracle");
    CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &q)
        .tensor("k", Dtype::Bf16, &k)
        .tensor("v", Dtype::Bf16, &v)
        .tensor("o", Dtype::Bf16, &f.o)
        .tensor("lse", Dtype::F32, &f.lse)
        .meta("recipe", "bf16-in/f32-acc/p-bf16")
}

/// The key-block lists of [`block_sparse_candidate`]: two heads of two 16-row query blocks over two 16-key blocks;
/// query block 1 of head 0 sees no block, so its rows are fully masked (O = 0, LSE = −∞).
fn block_lists() -> ndarray::Array4<i32> {
    ndarray::Array4::from_shape_vec((1, 2, 2, 2), vec![0, 1, -1, -1, 1, -1, 0, 1]).expect("shape")
}

/// The oracle's block-sparse forward over [`block_lists`] as a case stating those lists.
fn block_sparse_candidate(seed: u64) -> CaseBuilder {
    let spec = AttentionSpec::dense(1, 2, 2, 32, 32, 8, 8);
    let lists = block_lists();
    let layout = attnproof_oracle::block_sparse::BlockSparseLayout { q_tile: 16, kv_tile: 16, lists: lists.clone() };
    let vis = |seq: &Sequence, h: usize| layout.visibility(&spec, seq, h);
    oracle_candidate(&spec, &vis, seed)
        .tensor("block_indices", Dtype::I32, &lists.mapv(f64::from).into_dyn())
        .meta("block_q", "16")
        .meta("block_k", "16")
}

#[test]
fn block_sparse_case_with_fully_masked_rows_passes_and_a_dropped_block_fails() {
    let builder = block_sparse_candidate(21);
    let lists = block_lists();
    let r = checked(&builder);
    assert!(r.outputs.iter().all(|o| o.status == Status::Pass), "{r:?}");
    let case = format::from_bytes(&builder.bytes()).expect("loads");
    assert!(case.outputs["lse"].slice(s![0, 0, 16..32]).iter().all(|x| *x == f64::NEG_INFINITY));
    // Stating one more visible block than the candidate used must fail.
    let mut wider = lists.mapv(f64::from);
    wider.slice_mut(s![0, 1, 0, ..]).assign(&ndarray::arr1(&[0.0, 1.0]));
    let r = checked(&builder.tensor("block_indices", Dtype::I32, &wider.into_dyn()));
    assert_eq!(output(&r, "O").status, Status::Fail, "{r:?}");
}

/// A block-sparse kernel that attended to every block (the lists ignored) fails, and that is the cause named.
#[test]
fn a_candidate_that_ignored_the_block_lists_is_named() {
    let spec = AttentionSpec::dense(1, 2, 2, 32, 32, 8, 8);
    let every_key = |seq: &Sequence, _h: usize| spec.mask.matrix(seq.len_q, seq.len_k);
    let builder = oracle_candidate(&spec, &every_key, 21)
        .tensor("block_indices", Dtype::I32, &block_lists().mapv(f64::from).into_dyn())
        .meta("block_q", "16")
        .meta("block_k", "16");
    let r = checked(&builder);
    for name in ["O", "LSE"] {
        assert_cause(
            &r,
            name,
            "lists ignored: the candidate attended to every key the mask shows, not only the stated block lists",
        );
    }
}

/// FlashAttention 2 and 3 write `LSE = +∞` for a row that sees no key: stated as `masked_lse = +inf`, such a case
/// passes; unstated, its LSE fails there; and the convention excuses no `+∞` in a row that sees keys.
#[test]
fn a_stated_plus_infinity_lse_for_empty_rows_passes_and_only_there() {
    let builder = block_sparse_candidate(31);
    let mut lse = format::from_bytes(&builder.bytes()).expect("loads").outputs["lse"].clone();
    lse.mapv_inplace(|x| if x == f64::NEG_INFINITY { f64::INFINITY } else { x });
    let flash_style = builder.tensor("lse", Dtype::F32, &lse);
    assert!(!checked(&flash_style.clone().meta("masked_lse", "+inf")).failed());
    assert_eq!(output(&checked(&flash_style.clone()), "LSE").status, Status::Fail);
    lse[[0, 0, 3]] = f64::INFINITY;
    let r = checked(&flash_style.tensor("lse", Dtype::F32, &lse).meta("masked_lse", "+inf"));
    assert_eq!(output(&r, "LSE").status, Status::Fail, "{r:?}");
    assert_eq!(output(&r, "LSE").verdict.as_ref().map(|v| v.worst_index.clone()), Some(vec![0, 0, 3]));
}

#[test]
fn varlen_case_passes_under_f64_and_mpfr_oracles() {
    let spec = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, 5, 5, 17], cu_seqlens_k: vec![0, 9, 12, 20] },
        ..AttentionSpec::dense(1, 2, 1, 1, 1, 8, 8).with_mask(Mask::Causal)
    };
    let masks = |seq: &Sequence, _h: usize| spec.mask.matrix(seq.len_q, seq.len_k);
    let cu = |v: &[i32]| ArrayD::from_shape_vec(vec![v.len()], v.iter().map(|&x| x as f64).collect()).expect("1-D");
    let builder = oracle_candidate(&spec, &masks, 22)
        .tensor("cu_seqlens_q", Dtype::I32, &cu(&[0, 5, 5, 17]))
        .tensor("cu_seqlens_k", Dtype::I32, &cu(&[0, 9, 12, 20]))
        .meta("layout", "thd")
        .meta("causal", "true");
    let case = format::from_bytes(&builder.bytes()).expect("loads");
    for oracle in [OracleChoice::F64, OracleChoice::Mpfr] {
        let r = check(&case, oracle);
        assert_eq!(r.oracle, oracle);
        assert!(r.outputs.iter().all(|o| o.status == Status::Pass), "{r:?}");
    }
}

#[test]
fn oracle_of_a_dense_problem_matches_the_loaded_spec() {
    // The loader's spec and the writer's agree: the case's own oracle output passes exactly.
    let spec = AttentionSpec::dense(2, 2, 2, 9, 13, 8, 4);
    let case: Case<bf16> = make_case(&spec, profile(), 23);
    let [q, k, v] = case.widened();
    let f = forward(&spec, Qkv { q: q.view(), k: k.view(), v: v.view() }, DenseConfig::default(), ()).expect("oracle");
    let builder = CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &q)
        .tensor("k", Dtype::Bf16, &k)
        .tensor("v", Dtype::Bf16, &v)
        .tensor("o", Dtype::F64, &f.o)
        .meta("recipe", "bf16-in/f32-acc/p-bf16");
    let r = checked(&builder);
    assert_eq!(output(&r, "O").verdict.as_ref().map(|v| v.max_ratio), Some(0.0));
}

fn case_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("attnproof-check-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn run_check(paths: &[PathBuf], extra: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_check")).args(paths).args(extra).output().expect("run check");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().expect("exit code"), text)
}

#[test]
fn binary_exits_zero_one_and_two() {
    let dir = case_dir("exit");
    let spec = gqa_spec().with_mask(Mask::Causal);
    let good = reference_case(&spec, &spec, 31, "true", "bottom_right");
    let write = |name: &str, bytes: Vec<u8>| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).expect("write case");
        p
    };
    let good_path = write("good.safetensors", good.builder.bytes());
    let wrong_path = write("wrong.safetensors", good.builder.clone().meta("scale", "0.0625").bytes());
    let bad_path = write("bad.safetensors", good.builder.clone().without("v").bytes());

    let (code, text) = run_check(std::slice::from_ref(&good_path), &[]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = run_check(&[good_path.clone(), wrong_path.clone()], &[]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("likely cause: wrong scale"), "{text}");
    let (code, text) = run_check(&[good_path.clone(), wrong_path.clone(), bad_path], &["--json"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("missing tensor `v`"), "{text}");
    assert!(text.trim_start().starts_with('[') && text.contains("\"status\":\"pass\""), "{text}");
    // A recipe without a backward model leaves dQ, dK, dV not verified: a pass by default, a failure when the
    // caller requires every output verified.
    let unbounded = write("unbounded.safetensors", good.builder.clone().meta("recipe", "bf16-in/bf16-math").bytes());
    let (code, text) = run_check(std::slice::from_ref(&unbounded), &[]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("not verified"), "{text}");
    let (code, text) = run_check(&[unbounded], &["--require-verified"]);
    assert_eq!(code, 1, "{text}");
    // A reader that closes the pipe early (`check … | head -1`) gets the exit status of the checks, not a panic.
    let mut child = Command::new(env!("CARGO_BIN_EXE_check"))
        .args([&good_path, &wrong_path])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run check");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("check ends");
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).ok();
}
