//! The checker's named causes, each planted: a candidate computed exactly (the oracle, rounded to storage) but for
//! one bug (the causal diagonal off by one, the last key or last KV tile dropped, a window side off by one, the scale
//! `1/√Dv`, the GQA head map `h % Hkv`) fails, and the cause named is the planted one. A property test draws shapes,
//! masks, GQA groups and bugs, and requires that every failure the bug causes is explained and that the cause named
//! is never a wrong one: it is the planted bug, or a bug whose candidate is bit for bit the planted one on that
//! problem (the two are then the same fault there).

use attnproof_harness::case::build::CaseBuilder;
use attnproof_harness::case::format::{CausalAlign, MaskShift, MaskSpec};
use attnproof_harness::case::safetensors::Dtype;
use attnproof_harness::case::{CaseReport, OracleChoice, Status, check, format};
use attnproof_harness::generate::{Distribution, ValueProfile, make_case};
use attnproof_harness::strategies::suite_config;
use attnproof_oracle::attention::forward_with_visibility;
use attnproof_oracle::spec::Sequence;
use attnproof_oracle::{AttentionSpec, DenseConfig, Qkv, Scale};
use half::bf16;
use ndarray::{Array2, ArrayD, Axis};
use proptest::prelude::*;

/// A bug planted in an otherwise exact candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// Each query's diagonal key left out (`j < i`).
    DiagonalExcluded,
    /// One key past the diagonal seen (`j ≤ i + 1`).
    PastDiagonal,
    /// The last key of each sequence left out.
    LastKey,
    /// The last KV tile of this many keys left out.
    LastTile(usize),
    /// The window's left reach moved by this many keys.
    WindowLeft(i64),
    /// The window's right reach moved by this many keys.
    WindowRight(i64),
    /// Scale `1/√Dv` instead of `1/√D`.
    ScaleSqrtDv,
    /// Query head `h` reads KV head `h % Hkv`.
    GqaModulo,
    /// A causal mask applied with this alignment where the case states none (a cause the checker names for other
    /// faults too: a window whose right side is 0 is a causal mask; never planted, only compared).
    CausalAdded(CausalAlign),
    /// No causal mask where the case states one (never planted, only compared).
    CausalOmitted,
    /// The causal mask or window aligned from the other corner (never planted, only compared).
    AlignFlipped,
}

impl Bug {
    /// The start of the cause the checker must name for this bug.
    fn cause(self, mask: MaskSpec) -> String {
        match self {
            Bug::DiagonalExcluded => "causal off by one: the candidate excluded each query's diagonal key".into(),
            Bug::PastDiagonal => "causal off by one: the candidate included one key past the diagonal".into(),
            Bug::LastKey => "dropped keys: the candidate left out the last key of each sequence".into(),
            Bug::LastTile(t) => format!("dropped keys: the candidate left out the last KV tile ({t} keys)"),
            Bug::WindowLeft(by) => format!(
                "window off by one: the candidate's window reaches {} keys to the left",
                mask.window_left.expect("a left side") as i64 + by
            ),
            Bug::WindowRight(by) => format!(
                "window off by one: the candidate's window reaches {} keys to the right",
                mask.window_right.expect("a right side") as i64 + by
            ),
            Bug::ScaleSqrtDv => "wrong scale: the candidate used scale 1/sqrt(dv)".into(),
            Bug::GqaModulo => "GQA head map: the candidate read KV head h %".into(),
            Bug::CausalAdded(align) => format!("mask: the candidate applied a causal mask ({})", align.name()),
            Bug::CausalOmitted => "mask: the candidate applied no causal mask".into(),
            Bug::AlignFlipped => {
                format!("{} alignment: the candidate aligned", if mask.causal { "causal" } else { "window" })
            }
        }
    }

    /// The bugs that change something on `spec` under `mask`.
    fn applicable(spec: &AttentionSpec, mask: MaskSpec, kv_tile: usize) -> Vec<Bug> {
        let mut out = vec![Bug::LastKey, Bug::LastTile(kv_tile)];
        if mask.causal {
            out.extend([Bug::DiagonalExcluded, Bug::PastDiagonal]);
        }
        for by in [-1, 1] {
            if mask.window_left.is_some_and(|l| l as i64 + by >= 0) {
                out.push(Bug::WindowLeft(by));
            }
            if mask.window_right.is_some_and(|r| r as i64 + by >= 0) {
                out.push(Bug::WindowRight(by));
            }
        }
        if spec.head_dim_v != spec.head_dim {
            out.push(Bug::ScaleSqrtDv);
        }
        if spec.n_heads_kv > 1 && spec.n_heads_q > spec.n_heads_kv {
            out.push(Bug::GqaModulo);
        }
        out
    }

    /// The bugs a report may name on `spec` under `mask`: the planted kinds and the checker's other mask causes.
    fn nameable(spec: &AttentionSpec, mask: MaskSpec, kv_tile: usize) -> Vec<Bug> {
        let mut out = Bug::applicable(spec, mask, kv_tile);
        out.extend([
            Bug::CausalAdded(CausalAlign::BottomRight),
            Bug::CausalAdded(CausalAlign::TopLeft),
            Bug::CausalOmitted,
            Bug::AlignFlipped,
        ]);
        out
    }
}

/// Small logits: every visible key carries a weight near `1/Lk`, so leaving one out or adding one moves `O` by far
/// more than the bf16 bound for the lengths drawn here.
fn profile() -> ValueProfile {
    ValueProfile { distribution: Distribution::Gaussian, logit_scale: 0.3, value_mean: 0.0 }
}

/// One problem: the stated spec (its mask built from `mask`), the stated kernel KV tile and the inputs' seed.
#[derive(Clone, Debug)]
struct Problem {
    spec: AttentionSpec,
    mask: MaskSpec,
    kv_tile: usize,
    seed: u64,
}

/// `x` (`[B, Hkv, L, D]`) with one head per query head, query head `h` holding KV head `h % hkv`.
fn heads_modulo(x: &ArrayD<f64>, n_heads_q: usize, n_heads_kv: usize) -> ArrayD<f64> {
    let heads: Vec<_> = (0..n_heads_q).map(|h| x.index_axis(Axis(1), h % n_heads_kv).insert_axis(Axis(1))).collect();
    ndarray::concatenate(Axis(1), &heads).expect("same shapes")
}

/// The candidate's `O` and `LSE`: the oracle's, computed with `bug` planted (or none).
fn candidate(problem: &Problem, bug: Option<Bug>) -> (ArrayD<f64>, ArrayD<f64>) {
    let Problem { spec, mask, seed, .. } = problem;
    let [q, k, v] = make_case::<bf16>(spec, profile(), *seed).widened();
    let shifted = |shift: MaskShift| spec.clone().with_mask(mask.shifted(shift));
    let (buggy, k, v) = match bug {
        Some(Bug::DiagonalExcluded) => (shifted(MaskShift { diagonal: -1, ..MaskShift::default() }), k, v),
        Some(Bug::PastDiagonal) => (shifted(MaskShift { diagonal: 1, ..MaskShift::default() }), k, v),
        Some(Bug::WindowLeft(by)) => (shifted(MaskShift { left: by, ..MaskShift::default() }), k, v),
        Some(Bug::WindowRight(by)) => (shifted(MaskShift { right: by, ..MaskShift::default() }), k, v),
        Some(Bug::ScaleSqrtDv) => (spec.clone().with_scale(Scale::Value(1.0 / (spec.head_dim_v as f64).sqrt())), k, v),
        Some(Bug::CausalAdded(align)) => {
            (spec.clone().with_mask(MaskSpec { causal: true, align, ..*mask }.mask()), k, v)
        }
        Some(Bug::CausalOmitted) => (spec.clone().with_mask(MaskSpec { causal: false, ..*mask }.mask()), k, v),
        Some(Bug::AlignFlipped) => {
            let align = match mask.align {
                CausalAlign::BottomRight => CausalAlign::TopLeft,
                CausalAlign::TopLeft => CausalAlign::BottomRight,
            };
            (spec.clone().with_mask(MaskSpec { align, ..*mask }.mask()), k, v)
        }
        Some(Bug::GqaModulo) => {
            let (hq, hkv) = (spec.n_heads_q, spec.n_heads_kv);
            let modulo = AttentionSpec { n_heads_kv: hq, ..spec.clone() };
            (modulo, heads_modulo(&k, hq, hkv), heads_modulo(&v, hq, hkv))
        }
        _ => (spec.clone(), k, v),
    };
    let first_dropped = |len_k: usize| match bug {
        Some(Bug::LastKey) => len_k.saturating_sub(1),
        Some(Bug::LastTile(t)) => len_k.saturating_sub(1) / t * t,
        _ => len_k,
    };
    let visibility = |seq: &Sequence, _h: usize| -> Array2<bool> {
        let mut visible = buggy.mask.matrix(seq.len_q, seq.len_k);
        let from = first_dropped(seq.len_k);
        visible.slice_axis_mut(Axis(1), ndarray::Slice::from(from..)).fill(false);
        visible
    };
    let f = forward_with_visibility(
        &buggy,
        Qkv { q: q.view(), k: k.view(), v: v.view() },
        &visibility,
        DenseConfig::default(),
        (),
    )
    .expect("oracle");
    // Rounded as the case file stores them: O in bf16, LSE in f32.
    let o = f.o.mapv(|x| bf16::from_f64(x).to_f64());
    let lse = f.lse.mapv(|x| x as f32 as f64);
    (o, lse)
}

/// The case of `problem` holding the candidate with `bug` planted, stating the problem as it is.
fn planted(problem: &Problem, bug: Option<Bug>) -> CaseBuilder {
    let [q, k, v] = make_case::<bf16>(&problem.spec, profile(), problem.seed).widened();
    let (o, lse) = candidate(problem, bug);
    let side = |s: Option<usize>| s.map_or("-1".to_string(), |s| s.to_string());
    CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &q)
        .tensor("k", Dtype::Bf16, &k)
        .tensor("v", Dtype::Bf16, &v)
        .tensor("o", Dtype::Bf16, &o)
        .tensor("lse", Dtype::F32, &lse)
        .meta("recipe", "bf16-in/f32-acc/p-bf16")
        .meta("causal", if problem.mask.causal { "true" } else { "false" })
        .meta("causal_align", problem.mask.align.name())
        .meta("window_left", &side(problem.mask.window_left))
        .meta("window_right", &side(problem.mask.window_right))
        .meta("kernel_kv_tile", &problem.kv_tile.to_string())
}

fn report(problem: &Problem, bug: Option<Bug>) -> CaseReport {
    let case = format::from_bytes(&planted(problem, bug).bytes()).expect("the case loads");
    check(&case, OracleChoice::F64)
}

/// The bugs named by the failing outputs of `r`, mapped back from their causes; `None` for a failure no cause
/// explains, and an error for a cause that is not one of `candidates`.
fn named_bugs(r: &CaseReport, mask: MaskSpec, candidates: &[Bug]) -> Result<Vec<Option<Bug>>, String> {
    r.outputs
        .iter()
        .filter(|o| o.status == Status::Fail)
        .map(|o| match &o.cause {
            None => Ok(None),
            Some(cause) => candidates
                .iter()
                .find(|b| cause.starts_with(&b.cause(mask)))
                .map(|b| Some(*b))
                .ok_or_else(|| format!("{}: cause {cause:?} is none of the planted kinds", o.output)),
        })
        .collect()
}

fn dense(hq: usize, hkv: usize, len_q: usize, len_k: usize, d: usize, dv: usize) -> AttentionSpec {
    AttentionSpec::dense(1, hq, hkv, len_q, len_k, d, dv)
}

fn mask(causal: bool, align: CausalAlign, left: Option<usize>, right: Option<usize>) -> MaskSpec {
    MaskSpec { causal, align, window_left: left, window_right: right }
}

/// Each planted bug, on a problem where it shows, fails `O` with exactly its cause named (and `LSE` too, where it
/// fails), while the same problem without a bug passes.
#[test]
fn every_planted_bug_is_named() {
    let causal = mask(true, CausalAlign::BottomRight, None, None);
    let window = mask(false, CausalAlign::BottomRight, Some(5), Some(2));
    let cases = [
        (dense(2, 1, 24, 40, 16, 16), causal, Bug::DiagonalExcluded),
        (dense(2, 1, 24, 40, 16, 16), causal, Bug::PastDiagonal),
        (dense(2, 1, 24, 40, 16, 16), causal, Bug::LastKey),
        (dense(2, 2, 20, 40, 16, 16), mask(false, CausalAlign::TopLeft, None, None), Bug::LastKey),
        (dense(2, 1, 24, 40, 16, 16), mask(false, CausalAlign::BottomRight, None, None), Bug::LastTile(16)),
        (dense(3, 1, 17, 35, 16, 16), causal, Bug::LastTile(16)),
        (dense(2, 1, 24, 40, 16, 16), window, Bug::WindowLeft(1)),
        (dense(2, 1, 24, 40, 16, 16), window, Bug::WindowLeft(-1)),
        (dense(2, 1, 24, 40, 16, 16), window, Bug::WindowRight(1)),
        (dense(2, 1, 24, 40, 16, 16), window, Bug::WindowRight(-1)),
        (dense(2, 1, 24, 24, 32, 8), causal, Bug::ScaleSqrtDv),
        (dense(6, 2, 24, 40, 16, 16), causal, Bug::GqaModulo),
        (dense(6, 3, 16, 16, 16, 16), mask(false, CausalAlign::BottomRight, None, None), Bug::GqaModulo),
    ];
    for (i, (spec, mask, bug)) in cases.into_iter().enumerate() {
        let problem = Problem { spec: spec.clone().with_mask(mask.mask()), mask, kv_tile: 16, seed: 100 + i as u64 };
        let clean = report(&problem, None);
        assert!(!clean.failed(), "{bug:?}: the exact candidate fails: {clean:?}");
        let r = report(&problem, Some(bug));
        let o = r.outputs.iter().find(|o| o.output == "O").expect("O");
        assert_eq!(o.status, Status::Fail, "{bug:?}: the planted bug does not show in O: {o:?}");
        let all = Bug::nameable(&problem.spec, mask, problem.kv_tile);
        let named = named_bugs(&r, mask, &all).unwrap_or_else(|e| panic!("{bug:?}: {e}"));
        assert!(named.iter().all(|b| *b == Some(bug)), "{bug:?}: named {named:?}\n{r:?}");
    }
}

/// One drawn problem and a bug that applies to it.
fn problem_and_bug() -> impl Strategy<Value = (Problem, Bug)> {
    (1usize..=3, 1usize..=5, 1usize..=40, 1usize..=64, prop::sample::select(vec![8usize, 16]))
        .prop_flat_map(|(hkv, group, len_q, len_k, d)| {
            let spec = dense(hkv * group, hkv, len_q, len_k, d, d);
            let masks = (
                any::<bool>(),
                prop::sample::select(vec![CausalAlign::BottomRight, CausalAlign::TopLeft]),
                prop::option::of(0usize..8),
                prop::option::of(0usize..8),
            );
            let dv = prop::sample::select(vec![d, d / 2 + 4]);
            (Just(spec), masks, dv, prop::sample::select(vec![8usize, 16]), any::<u64>())
        })
        .prop_flat_map(|(spec, (causal, align, left, right), dv, kv_tile, seed)| {
            let mask = mask(causal, align, left, right);
            let spec = AttentionSpec { head_dim_v: dv, ..spec }.with_mask(mask.mask());
            let bugs = Bug::applicable(&spec, mask, kv_tile);
            (Just(Problem { spec, mask, kv_tile, seed }), prop::sample::select(bugs))
        })
}

proptest! {
    #![proptest_config(suite_config("check_causes", 48))]

    /// A planted bug that shows is named on every output it fails, and the cause named is that bug, or one whose
    /// candidate equals the planted candidate bit for bit.
    #[test]
    fn a_planted_bug_is_named_and_never_a_wrong_one((problem, bug) in problem_and_bug()) {
        let r = report(&problem, Some(bug));
        let all = Bug::nameable(&problem.spec, problem.mask, problem.kv_tile);
        let named = named_bugs(&r, problem.mask, &all).map_err(TestCaseError::fail)?;
        prop_assert!(named.iter().all(Option::is_some), "planted {:?}, a failure left unexplained\n{:?}", bug, r);
        let planted = candidate(&problem, Some(bug));
        for other in named.into_iter().flatten().filter(|b| *b != bug) {
            let same = candidate(&problem, Some(other));
            prop_assert!(
                same.0 == planted.0 && same.1 == planted.1,
                "planted {:?}, named {:?}, whose candidate differs\n{:?}", bug, other, r
            );
        }
    }
}
