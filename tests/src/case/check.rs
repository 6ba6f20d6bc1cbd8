//! Checking a loaded case: the f64 oracle (or MPFR on request) recomputes the outputs, the bound
//! model of the stated recipe gives each element's allowed error, and every output gets a verdict.
//! A failing forward or backward output is then diagnosed: the check is re-run under alternative
//! hypotheses (another scale, the other causal alignment, LSE in the other base, `O` without the
//! division by `ℓ`) and the one under which the failures pass is named; when none does, the
//! failing elements are reported as rectangles.

use std::collections::BTreeMap;

use attnproof_oracle::attention::{backward_with_visibility, forward_with_visibility, to_mpfr};
use attnproof_oracle::dense::scores;
use attnproof_oracle::spec::Sequence;
use attnproof_oracle::{AttentionSpec, DenseConfig, Layout, Mp, Precision, Qkv, Real, Scale};
use attnproof_proofs::flash_bound::FlashRecipe;
use ndarray::{Array2, ArrayD, ArrayViewD, Axis, Dimension};

use super::format::{CaseFile, CausalAlign, LseBase, MaskShift, MaskSpec};
use super::recipe::{KernelParams, Recipe, RecipeKind};
use super::safetensors::Dtype;
use super::sparsity::Sparsity;
use crate::backward::problem_backward_bounds_with_visibility;
use crate::flash::{HarnessError, forward_gate, problem_forward_bounds_with_visibility};
use crate::gate::GateReport;
use crate::verdict::{OutputVerdict, compare, element_ratio};

/// Which oracle computes the truth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OracleChoice {
    /// The f64 oracle (its own error is below `2^-25` of every bound).
    F64,
    /// The MPFR oracle at 256 bits, for cases of at most [`MPFR_MAX_SCORES`] scores.
    Mpfr,
}

/// Largest `Σ Lq·Lk·Hq` the MPFR oracle is asked to compute.
pub const MPFR_MAX_SCORES: usize = 1 << 18;

/// The outcome of one output.
#[derive(Clone, Debug, PartialEq)]
pub enum Status {
    /// Every element within its bound.
    Pass,
    /// Some element outside its bound.
    Fail,
    /// The model's hypothesis does not hold (or no model covers this output): no verdict.
    NotVerified(String),
}

/// A rectangle of failing elements: `prefix` (batch and head, or head for packed layouts),
/// rows and columns as half-open ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    /// Leading coordinates (`[b, h]`, or `[h]` when packed).
    pub prefix: Vec<usize>,
    /// Rows (queries for `O`, `LSE`, `dQ`; keys for `dK`, `dV`).
    pub rows: std::ops::Range<usize>,
    /// Columns (head dims; `0..1` for `LSE`).
    pub cols: std::ops::Range<usize>,
    /// Failing elements inside.
    pub failing: usize,
}

/// The report of one output.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputReport {
    /// `O`, `LSE`, `dQ`, `dK`, `dV`.
    pub output: &'static str,
    /// The outcome.
    pub status: Status,
    /// The comparison (absent when not verified).
    pub verdict: Option<OutputVerdict>,
    /// For a failure: the hypothesis under which it passes, when one does.
    pub cause: Option<String>,
    /// For a failure no hypothesis explains: the failing rectangles (at most [`MAX_REGIONS`]).
    pub regions: Vec<Region>,
    /// Failing rectangles beyond those listed.
    pub more_regions: usize,
}

/// Rectangles listed per output.
pub const MAX_REGIONS: usize = 8;

/// The report of one case.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseReport {
    /// The recipe checked against.
    pub recipe: String,
    /// The `kernel` metadata.
    pub kernel: String,
    /// The kernel parameters the case states (the bound takes the worst case for the others).
    pub kernel_params: KernelParams,
    /// The oracle used.
    pub oracle: OracleChoice,
    /// A note on the oracle choice (MPFR skipped for size), if any.
    pub oracle_note: Option<String>,
    /// One entry per output present in the case.
    pub outputs: Vec<OutputReport>,
    /// The discriminability gate of the forward bounds (canned wrong answers that must fail),
    /// when the case has `o` or `lse` and the model applies.
    pub gate: Option<GateReport>,
}

impl CaseReport {
    /// Any output failed.
    pub fn failed(&self) -> bool {
        self.outputs.iter().any(|o| o.status == Status::Fail)
    }
}

/// One output's comparison, before diagnosis.
#[derive(Clone, Debug)]
enum Eval {
    Compared { verdict: OutputVerdict, failing: ArrayD<bool> },
    NotVerified(String),
}

impl Eval {
    fn passed(&self) -> bool {
        matches!(self, Eval::Compared { verdict, .. } if verdict.passed())
    }
}

/// The assumptions a check runs under: the stated ones, or an alternative hypothesis.
#[derive(Clone, Debug)]
struct Hypothesis {
    name: String,
    spec: AttentionSpec,
    lse_base: LseBase,
    normalize_o: bool,
    /// Keys the candidate left out at the end of every sequence.
    dropped_tail: Option<KeyTail>,
    /// Keys and values laid out per query head as the candidate read them (the GQA head map `h % Hkv`), with `spec`
    /// stating one KV head per query head; `None`: the case's own.
    kv: Option<[ArrayD<f64>; 2]>,
    /// The recipe whose bound the outputs are judged under, when not the case's (a recipe mismatch).
    recipe: Option<FlashRecipe>,
    /// The candidate attended to every key the mask shows, ignoring the stated block or token lists.
    lists_ignored: bool,
}

impl Hypothesis {
    /// The case as stated.
    fn stated(case: &CaseFile) -> Hypothesis {
        Hypothesis {
            name: "as stated".into(),
            spec: case.spec.clone(),
            lse_base: case.lse_base,
            normalize_o: false,
            dropped_tail: None,
            kv: None,
            recipe: None,
            lists_ignored: false,
        }
    }

    /// The keys and values the candidate read.
    fn keys_values<'a>(&'a self, case: &'a CaseFile) -> [&'a ArrayD<f64>; 2] {
        match &self.kv {
            Some([k, v]) => [k, v],
            None => [&case.k, &case.v],
        }
    }

    /// The keys of (sequence, head) the hypothesis has the candidate attend to.
    fn visibility(&self, case: &CaseFile, seq: &Sequence, head: usize) -> Array2<bool> {
        let mut visible = if self.lists_ignored {
            self.spec.mask.matrix(seq.len_q, seq.len_k)
        } else {
            case.visibility(&self.spec, seq, head)
        };
        if let Some(tail) = self.dropped_tail {
            visible.slice_axis_mut(Axis(1), ndarray::Slice::from(tail.first_dropped(seq.len_k)..)).fill(false);
        }
        visible
    }
}

/// The keys a candidate may leave out at the end of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyTail {
    /// The last key.
    LastKey,
    /// The last KV tile of this many keys (partial when the tile does not divide `Lk`).
    LastTile(usize),
}

impl KeyTail {
    /// The first key left out of a sequence of `len_k` keys.
    fn first_dropped(self, len_k: usize) -> usize {
        match self {
            KeyTail::LastKey => len_k.saturating_sub(1),
            KeyTail::LastTile(tile) => len_k.saturating_sub(1) / tile * tile,
        }
    }
}

const DISPLAY: [(&str, &str); 5] = [("o", "O"), ("lse", "LSE"), ("dq", "dQ"), ("dk", "dK"), ("dv", "dV")];

fn display(name: &str) -> &'static str {
    DISPLAY.iter().find(|(n, _)| *n == name).map_or("?", |(_, d)| d)
}

/// The oracle a check uses: the one asked for, except MPFR above [`MPFR_MAX_SCORES`] scores, where the f64 oracle
/// stands in and the report says why.
fn oracle_for(spec: &AttentionSpec, asked: OracleChoice) -> (OracleChoice, Option<String>) {
    match asked {
        OracleChoice::Mpfr if score_count(spec) > MPFR_MAX_SCORES => (
            OracleChoice::F64,
            Some(format!("MPFR skipped: {} scores exceed the limit {MPFR_MAX_SCORES}", score_count(spec))),
        ),
        other => (other, None),
    }
}

/// Checks one case.
pub fn check(case: &CaseFile, oracle: OracleChoice) -> CaseReport {
    let (oracle, oracle_note) = oracle_for(&case.spec, oracle);
    let stated = Hypothesis::stated(case);
    let evals = evaluate(case, &stated, oracle, &case.outputs.keys().copied().collect::<Vec<_>>());
    let failing: Vec<&'static str> = evals
        .iter()
        .filter(|(_, e)| matches!(e, Eval::Compared { verdict, .. } if !verdict.passed()))
        .map(|(n, _)| *n)
        .collect();
    let worst_head = HEAD_OUTPUTS.iter().find_map(|name| match evals.get(name) {
        Some(Eval::Compared { verdict, .. }) if !verdict.passed() => match verdict.worst_index.as_slice() {
            [b, h, ..] => Some([*b, *h]),
            _ => None,
        },
        _ => None,
    });
    let causes = if failing.is_empty() { BTreeMap::new() } else { diagnose(case, oracle, &failing, worst_head) };
    let mut evals: Vec<(&'static str, Eval)> = evals.into_iter().collect();
    // Report order: O, LSE, dQ, dK, dV.
    evals.sort_by_key(|(name, _)| DISPLAY.iter().position(|(n, _)| n == name));
    let outputs = evals
        .into_iter()
        .map(|(name, eval)| match eval {
            Eval::NotVerified(reason) => OutputReport {
                output: display(name),
                status: Status::NotVerified(reason),
                verdict: None,
                cause: None,
                regions: vec![],
                more_regions: 0,
            },
            Eval::Compared { verdict, failing } => {
                let passed = verdict.passed();
                let cause = causes.get(name).cloned();
                let (regions, more_regions) =
                    if passed || cause.is_some() { (vec![], 0) } else { regions(&case.spec, name, &failing) };
                OutputReport {
                    output: display(name),
                    status: if passed { Status::Pass } else { Status::Fail },
                    verdict: Some(verdict),
                    cause,
                    regions,
                    more_regions,
                }
            }
        })
        .collect();
    CaseReport {
        recipe: case.recipe.name.clone(),
        kernel: case.kernel.clone(),
        kernel_params: case.recipe.params,
        oracle,
        oracle_note,
        outputs,
        gate: forward_gate_of(case),
    }
}

/// KV tile of the gate's "last KV tile dropped" answer: the tile of the common peers.
const GATE_KV_TILE: usize = 64;

/// The canned wrong answers of `flash::forward_gate` scored against the case's forward bounds.
fn forward_gate_of(case: &CaseFile) -> Option<GateReport> {
    if !case.has("o") && !case.has("lse") {
        return None;
    }
    let spec = &case.spec;
    let vis = |seq: &Sequence, h: usize| case.visibility(spec, seq, h);
    let truth =
        problem_forward_bounds_with_visibility(spec, &case.q, &case.k, &case.v, &vis, case.recipe.flash).ok()?;
    let (unit, truths, bounds) =
        (case.recipe.flash.unit_roundoff, (&truth.o, &truth.lse), (&truth.bound_o, &truth.bound_lse));
    forward_gate(spec, &case.q, &case.k, &case.v, GATE_KV_TILE, unit, truths, bounds).ok()
}

fn score_count(spec: &AttentionSpec) -> usize {
    spec.sequences().iter().map(|s| s.len_q * s.len_k).sum::<usize>() * spec.n_heads_q
}

/// The alternative hypotheses for the failing outputs, tried in order; for each failing output
/// the first under which it passes (and every other failing output it touches passes too).
fn diagnose(
    case: &CaseFile,
    oracle: OracleChoice,
    failing: &[&'static str],
    worst_head: Option<[usize; 2]>,
) -> BTreeMap<&'static str, String> {
    // Each hypothesis is first tried on the (batch, head) of the worst failing element alone, where that is a
    // smaller problem: a hypothesis under which that head's outputs fail cannot make every element pass, so only
    // those that pass there are tried on the whole case (on a large case most are ruled out at 1/(B·Hq) of the cost).
    let screen = worst_head.and_then(|[b, h]| one_head(case, b, h));
    let screened: BTreeMap<String, Hypothesis> = screen
        .as_ref()
        .map_or_else(BTreeMap::new, |sub| hypotheses(sub).into_iter().map(|(h, _)| (h.name.clone(), h)).collect());
    let mut causes = BTreeMap::new();
    for (hyp, touches) in hypotheses(case) {
        let targets: Vec<&'static str> =
            failing.iter().copied().filter(|f| touches.contains(f) && !causes.contains_key(f)).collect();
        if targets.is_empty() {
            continue;
        }
        // Only the outputs of one query head can be judged on its own: dK and dV sum over a KV head's group.
        let per_head: Vec<&'static str> = targets.iter().copied().filter(|t| HEAD_OUTPUTS.contains(t)).collect();
        if let (Some(sub), Some(sub_hyp), false) = (&screen, screened.get(&hyp.name), per_head.is_empty()) {
            let evals = evaluate(sub, sub_hyp, oracle, &per_head);
            if !per_head.iter().all(|t| evals.get(t).is_some_and(Eval::passed)) {
                continue;
            }
        }
        let evals = evaluate(case, &hyp, oracle, &targets);
        if targets.iter().all(|t| evals.get(t).is_some_and(Eval::passed)) {
            for t in targets {
                causes.insert(t, hyp.name.clone());
            }
        }
    }
    causes
}

/// The outputs whose elements of a query head depend on that head's inputs alone.
const HEAD_OUTPUTS: [&str; 3] = ["o", "lse", "dq"];

/// The case restricted to batch `b` and query head `h` (with its KV head), for a dense layout with more than one
/// (batch, head) pair; `None` otherwise (a packed layout keeps its sequences together).
fn one_head(case: &CaseFile, b: usize, h: usize) -> Option<CaseFile> {
    let Layout::Dense { batch, len_q, len_k } = case.spec.layout else { return None };
    if batch * case.spec.n_heads_q <= 1 || b >= batch || h >= case.spec.n_heads_q {
        return None;
    }
    let kv = case.spec.kv_head(h);
    let pick = |x: &ArrayD<f64>, head: usize| {
        x.slice_axis(Axis(0), ndarray::Slice::from(b..=b))
            .slice_axis(Axis(1), ndarray::Slice::from(head..=head))
            .to_owned()
    };
    let spec = AttentionSpec {
        layout: Layout::Dense { batch: 1, len_q, len_k },
        n_heads_q: 1,
        n_heads_kv: 1,
        ..case.spec.clone()
    };
    let outputs = case
        .outputs
        .iter()
        .filter(|(name, _)| HEAD_OUTPUTS.contains(name))
        .map(|(name, x)| (*name, pick(x, h)))
        .collect();
    let sparsity = case.sparsity.as_ref().map(|lists| lists.one_head(&case.spec, b, h));
    // Field by field, so that the whole case's tensors are not copied only to be replaced.
    Some(CaseFile {
        spec,
        mask: case.mask,
        sparsity,
        recipe: case.recipe.clone(),
        lse_base: case.lse_base,
        masked_lse: case.masked_lse,
        kernel: case.kernel.clone(),
        storage: case.storage,
        q: pick(&case.q, h),
        k: pick(&case.k, kv),
        v: pick(&case.v, kv),
        outputs,
        d_out: case.d_out.as_ref().map(|g| pick(g, h)),
        metadata: case.metadata.clone(),
    })
}

/// Every output; the forward's alone, for hypotheses that change the shape of dK and dV or have no backward model.
const ALL_OUTPUTS: [&str; 5] = ["o", "lse", "dq", "dk", "dv"];
const FORWARD_OUTPUTS: [&str; 2] = ["o", "lse"];

/// KV tiles tried for a dropped last tile when the case states none: the common ones.
const COMMON_KV_TILES: [usize; 3] = [32, 64, 128];

fn hypotheses(case: &CaseFile) -> Vec<(Hypothesis, Vec<&'static str>)> {
    let all = ALL_OUTPUTS.to_vec();
    let (d, dv) = (case.spec.head_dim as f64, case.spec.head_dim_v as f64);
    let stated_scale = case.spec.scale_value::<f64>(());
    let base = |name: String, spec: AttentionSpec| Hypothesis { name, spec, ..Hypothesis::stated(case) };
    let mut out = Vec::new();
    let mut scales = vec![("1/d", 1.0 / d), ("1/sqrt(d)", 1.0 / d.sqrt()), ("1", 1.0)];
    if dv != d {
        scales.push(("1/sqrt(dv)", 1.0 / dv.sqrt()));
    }
    for (label, value) in scales {
        // A hypothesis equal to the statement could not make a failing output pass; one an ulp away is harmless.
        if value != stated_scale {
            let spec = case.spec.clone().with_scale(Scale::Value(value));
            let name =
                format!("wrong scale: the candidate used scale {label} = {value:.6}, not the stated {stated_scale:.6}");
            out.push((base(name, spec), all.clone()));
        }
    }
    let lens_differ = case.spec.sequences().iter().any(|s| s.len_q != s.len_k);
    let with_mask = |m: MaskSpec| case.spec.clone().with_mask(m.mask());
    let other = |a: CausalAlign| match a {
        CausalAlign::BottomRight => CausalAlign::TopLeft,
        CausalAlign::TopLeft => CausalAlign::BottomRight,
    };
    // A causal mask and a window are both placed relative to the aligned query position, which differs between the
    // two alignments only when Lq ≠ Lk.
    let windowed = case.mask.window_left.is_some() || case.mask.window_right.is_some();
    if (case.mask.causal || windowed) && lens_differ {
        let flipped = MaskSpec { align: other(case.mask.align), ..case.mask };
        let name = format!(
            "{} alignment: the candidate aligned the {} {}, the case states {}",
            if case.mask.causal { "causal" } else { "window" },
            if case.mask.causal { "causal mask" } else { "window" },
            flipped.align.name(),
            case.mask.align.name()
        );
        out.push((base(name, with_mask(flipped)), all.clone()));
    }
    if case.mask.causal {
        let name = "mask: the candidate applied no causal mask, the case states causal".to_string();
        out.push((base(name, with_mask(MaskSpec { causal: false, ..case.mask })), all.clone()));
    } else {
        for align in [CausalAlign::BottomRight, CausalAlign::TopLeft] {
            if align == CausalAlign::TopLeft && !lens_differ {
                continue;
            }
            let name = format!("mask: the candidate applied a causal mask ({}), the case states none", align.name());
            out.push((base(name, with_mask(MaskSpec { causal: true, align, ..case.mask })), all.clone()));
        }
    }
    // Local faults before global ones: a hypothesis that changes more elements than the fault did could pass where
    // its extra changes are too small to see, and be named wrongly; one that changes fewer cannot explain a wider
    // fault.
    out.extend(
        dropped_tails(case).into_iter().map(|(name, tail)| {
            (Hypothesis { dropped_tail: Some(tail), ..base(name, case.spec.clone()) }, all.clone())
        }),
    );
    out.extend(
        off_by_one_masks(case)
            .into_iter()
            .map(|(name, shift)| (base(name, case.spec.clone().with_mask(case.mask.shifted(shift))), all.clone())),
    );
    if let Some(sparsity) = &case.sparsity {
        let lists = match sparsity {
            Sparsity::Blocks(_) => "block lists (block_indices)",
            Sparsity::Tokens(_) => "token lists (token_indices)",
        };
        let name =
            format!("lists ignored: the candidate attended to every key the mask shows, not only the stated {lists}");
        out.push((Hypothesis { lists_ignored: true, ..base(name, case.spec.clone()) }, all.clone()));
    }
    let (hq, hkv) = (case.spec.n_heads_q, case.spec.n_heads_kv);
    // The two head maps differ only with several KV heads each shared by several query heads.
    if hkv > 1 && hq > hkv {
        let name = format!(
            "GQA head map: the candidate read KV head h % {hkv} for query head h, the case states h / {} \
             (Hq = {hq}, Hkv = {hkv})",
            hq / hkv
        );
        let spec = AttentionSpec { n_heads_kv: hq, ..case.spec.clone() };
        let kv = [heads_modulo(&case.k, hq, hkv), heads_modulo(&case.v, hq, hkv)];
        // dK and dV would have one head per query head: only the outputs shaped by the query heads are judged.
        out.push((Hypothesis { kv: Some(kv), ..base(name, spec) }, vec!["o", "lse", "dq"]));
    }
    let flipped_base = match case.lse_base {
        LseBase::E => (LseBase::Two, "LSE base: the candidate's LSE is in base 2, the case states base e"),
        LseBase::Two => (LseBase::E, "LSE base: the candidate's LSE is in base e, the case states base 2"),
    };
    out.push((Hypothesis { lse_base: flipped_base.0, ..base(flipped_base.1.into(), case.spec.clone()) }, vec!["lse"]));
    out.push((
        Hypothesis {
            normalize_o: true,
            ..base(
                "unnormalized O: the candidate's O is A = Σ_j exp(s_ij − m_i) v_j, without the division by ℓ_i".into(),
                case.spec.clone(),
            )
        },
        vec!["o"],
    ));
    // Last: a looser recipe passes any fault small enough for its bound, so it is named only when no structural
    // hypothesis explains the failure.
    out.extend(recipe_mismatches(case).into_iter().map(|(name, recipe)| {
        (Hypothesis { recipe: Some(recipe), ..base(name, case.spec.clone()) }, FORWARD_OUTPUTS.to_vec())
    }));
    out
}

/// The stated mask with one bound off by one key, each way, named: the causal diagonal, and each bounded side of a
/// window (a side that would become negative is not tried).
fn off_by_one_masks(case: &CaseFile) -> Vec<(String, MaskShift)> {
    let mut out = Vec::new();
    if case.mask.causal {
        out.push((
            "causal off by one: the candidate excluded each query's diagonal key (it sees keys j < i, the case \
             states j ≤ i)"
                .to_string(),
            MaskShift { diagonal: -1, ..MaskShift::default() },
        ));
        out.push((
            "causal off by one: the candidate included one key past the diagonal (it sees keys j ≤ i + 1, the case \
             states j ≤ i)"
                .to_string(),
            MaskShift { diagonal: 1, ..MaskShift::default() },
        ));
    }
    for (side, reach) in [("left", case.mask.window_left), ("right", case.mask.window_right)] {
        let Some(reach) = reach else { continue };
        for by in [-1i64, 1] {
            if reach as i64 + by < 0 {
                continue;
            }
            let name = format!(
                "window off by one: the candidate's window reaches {} keys to the {side}, the case states {reach}",
                reach as i64 + by
            );
            let shift = match side {
                "left" => MaskShift { left: by, ..MaskShift::default() },
                _ => MaskShift { right: by, ..MaskShift::default() },
            };
            out.push((name, shift));
        }
    }
    out
}

/// The key tails a candidate may have left out, named: the last key, then the last KV tile for the stated tile (or
/// each common one), where that tile holds more than one key of some sequence (a tile as long as the sequence is all
/// of it: a kernel that skips its last tile writes `O = 0` there). A tile that leaves out the same keys as one tried
/// before it is not tried again.
fn dropped_tails(case: &CaseFile) -> Vec<(String, KeyTail)> {
    let mut out =
        vec![("dropped keys: the candidate left out the last key of each sequence".to_string(), KeyTail::LastKey)];
    let tiles = match case.recipe.params.kv_tile {
        Some(tile) => vec![tile],
        None => COMMON_KV_TILES.to_vec(),
    };
    let lens: Vec<usize> = case.spec.sequences().iter().map(|s| s.len_k).collect();
    let cuts = |tail: KeyTail| -> Vec<usize> { lens.iter().map(|&len_k| tail.first_dropped(len_k)).collect() };
    let mut tried = vec![cuts(KeyTail::LastKey)];
    for tile in tiles {
        let tail = KeyTail::LastTile(tile);
        let cut = cuts(tail);
        if lens.iter().zip(&cut).any(|(&len_k, &from)| len_k >= from + 2) && !tried.contains(&cut) {
            out.push((
                format!("dropped keys: the candidate left out the last KV tile ({tile} keys) of each sequence"),
                tail,
            ));
            tried.push(cut);
        }
    }
    out
}

/// Computations looser than the stated recipe that a candidate may have run instead, named with the recipe to state
/// if it was meant: f32 products in TF32 for `f32-in/f32-acc`; inputs, scores and probabilities rounded to the
/// storage type for the bf16 and f16 recipes that keep scores in f32.
fn recipe_mismatches(case: &CaseFile) -> Vec<(String, FlashRecipe)> {
    let params = case.recipe.params;
    let with = |name: &str, storage, kind| Recipe::of(name.to_string(), storage, kind, params).flash;
    match (case.recipe.storage, case.recipe.kind) {
        (Dtype::F32, RecipeKind::Fused) => vec![(
            "recipe mismatch: the candidate's f32 products ran in TF32 (PyTorch's allow_tf32, cuBLAS's TF32 tensor \
             ops); if that is intended, state recipe f32-in/tf32"
                .into(),
            with("f32-in/tf32", Dtype::F32, RecipeKind::Tf32),
        )],
        (storage @ (Dtype::Bf16 | Dtype::F16), RecipeKind::Fused | RecipeKind::MathF32) => {
            let (name, recipe) =
                if storage == Dtype::Bf16 { ("bf16", "bf16-in/bf16-math") } else { ("f16", "f16-in/f16-math") };
            vec![(
                format!(
                    "recipe mismatch: the candidate rounded its scaled inputs, scores and probabilities to {name} \
                     before the products (PyTorch's math SDPA with reduced-precision reductions); if that is \
                     intended, state recipe {recipe}"
                ),
                with(recipe, storage, RecipeKind::MathReduced),
            )]
        }
        _ => vec![],
    }
}

/// `x` (`[B, Hkv, L, D]` or `[T, Hkv, D]`) with one head per query head, query head `h` holding KV head `h % hkv`.
fn heads_modulo(x: &ArrayD<f64>, n_heads_q: usize, n_heads_kv: usize) -> ArrayD<f64> {
    let heads: Vec<_> = (0..n_heads_q).map(|h| x.index_axis(Axis(1), h % n_heads_kv).insert_axis(Axis(1))).collect();
    ndarray::concatenate(Axis(1), &heads).expect("heads of one tensor share their shape")
}

/// The MPFR oracle's forward under `hyp`.
fn oracle_forward_mpfr(case: &CaseFile, hyp: &Hypothesis) -> Result<(ArrayD<f64>, ArrayD<f64>), HarnessError> {
    let vis = |seq: &Sequence, h: usize| hyp.visibility(case, seq, h);
    let p = Precision::default();
    let [k, v] = hyp.keys_values(case);
    let (q, k, v) = (to_mpfr(case.q.view(), p), to_mpfr(k.view(), p), to_mpfr(v.view(), p));
    let f = forward_with_visibility::<Mp>(
        &hyp.spec,
        Qkv { q: q.view(), k: k.view(), v: v.view() },
        &vis,
        DenseConfig::default(),
        p,
    )?;
    Ok((f.o.mapv(|x| x.to_f64()), f.lse.mapv(|x| x.to_f64())))
}

/// Row sums `ℓ_i = Σ_j exp(s_ij − m_i)` of the exact softmax under `hyp`, shaped like the LSE.
fn row_sums(case: &CaseFile, hyp: &Hypothesis, lse: &ArrayD<f64>) -> ArrayD<f64> {
    let mut out = lse.clone();
    let spec = &hyp.spec;
    let scale = spec.scale_value::<f64>(());
    let [k, _] = hyp.keys_values(case);
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let kv = spec.kv_head(h);
            let visible = hyp.visibility(case, &seq, h);
            let s = scores(
                spec.head_rows(case.q.view(), &seq, h, false),
                spec.head_rows(k.view(), &seq, kv, true),
                &scale,
                visible.view(),
                (),
            );
            let mut row = out.slice_mut(spec.row_stat_slice(&seq, h));
            for (i, l) in row.iter_mut().enumerate() {
                let m = s.row(i).iter().copied().fold(f64::NEG_INFINITY, f64::max);
                *l = if m == f64::NEG_INFINITY { 1.0 } else { (*l - m).exp() };
            }
        }
    }
    out
}

/// Compares `names` of the case's outputs under `hyp`.
fn evaluate(
    case: &CaseFile,
    hyp: &Hypothesis,
    oracle: OracleChoice,
    names: &[&'static str],
) -> BTreeMap<&'static str, Eval> {
    let mut out = BTreeMap::new();
    let spec = &hyp.spec;
    let vis = |seq: &Sequence, h: usize| hyp.visibility(case, seq, h);
    let flash = hyp.recipe.unwrap_or(case.recipe.flash);
    let [k, v] = hyp.keys_values(case);
    let forward_names: Vec<&'static str> = names.iter().copied().filter(|n| matches!(*n, "o" | "lse")).collect();
    if !forward_names.is_empty() {
        match problem_forward_bounds_with_visibility(spec, &case.q, k, v, &vis, flash) {
            Err(e) => forward_names.iter().for_each(|n| {
                out.insert(*n, Eval::NotVerified(e.to_string()));
            }),
            Ok(truth) => {
                let (o_true, lse_true) = match oracle {
                    OracleChoice::Mpfr => match oracle_forward_mpfr(case, hyp) {
                        Ok(t) => t,
                        Err(e) => {
                            forward_names.iter().for_each(|n| {
                                out.insert(*n, Eval::NotVerified(e.to_string()));
                            });
                            return out;
                        }
                    },
                    OracleChoice::F64 => (truth.o.clone(), truth.lse.clone()),
                };
                if let Some(o) = case.outputs.get("o").filter(|_| forward_names.contains(&"o")) {
                    let candidate = if hyp.normalize_o {
                        let l = row_sums(case, hyp, &lse_true);
                        let mut c = o.clone();
                        divide_rows(spec, &mut c, &l);
                        c
                    } else {
                        o.clone()
                    };
                    out.insert("o", compared("O", candidate.view(), o_true.view(), truth.bound_o.view()));
                }
                if let Some(lse) = case.outputs.get("lse").filter(|_| forward_names.contains(&"lse")) {
                    let natural = match hyp.lse_base {
                        LseBase::E => lse.clone(),
                        LseBase::Two => lse.mapv(|x| x * std::f64::consts::LN_2),
                    };
                    out.insert("lse", compared("LSE", natural.view(), lse_true.view(), truth.bound_lse.view()));
                }
            }
        }
    }
    let grads: Vec<&'static str> = names.iter().copied().filter(|n| matches!(*n, "dq" | "dk" | "dv")).collect();
    if let (false, Some(d_out)) = (grads.is_empty(), case.d_out.as_ref()) {
        if !case.recipe.has_backward_model() {
            let reason = format!("no backward model for recipe {:?}", case.recipe.name);
            grads.iter().for_each(|n| {
                out.insert(*n, Eval::NotVerified(reason.clone()));
            });
            return out;
        }
        let qkvg = [&case.q, k, v, d_out];
        match problem_backward_bounds_with_visibility(spec, qkvg, &vis, flash, case.recipe.q_tile) {
            Err(e) => grads.iter().for_each(|n| {
                out.insert(*n, Eval::NotVerified(e.to_string()));
            }),
            Ok(truth) => {
                let exact = match oracle {
                    OracleChoice::F64 => [truth.grads.dq.clone(), truth.grads.dk.clone(), truth.grads.dv.clone()],
                    OracleChoice::Mpfr => {
                        let p = Precision::default();
                        let [q, k, v, g] = qkvg.map(|t| to_mpfr(t.view(), p));
                        let qkv = Qkv { q: q.view(), k: k.view(), v: v.view() };
                        match backward_with_visibility::<Mp>(spec, qkv, g.view(), &vis, DenseConfig::default(), p) {
                            Ok(gr) => [gr.dq, gr.dk, gr.dv].map(|t| t.mapv(|x| x.to_f64())),
                            Err(e) => {
                                grads.iter().for_each(|n| {
                                    out.insert(*n, Eval::NotVerified(e.to_string()));
                                });
                                return out;
                            }
                        }
                    }
                };
                for (name, exact, bound) in [
                    ("dq", &exact[0], &truth.bound_dq),
                    ("dk", &exact[1], &truth.bound_dk),
                    ("dv", &exact[2], &truth.bound_dv),
                ] {
                    if let Some(c) = case.outputs.get(name).filter(|_| grads.contains(&name)) {
                        out.insert(name, compared(display(name), c.view(), exact.view(), bound.view()));
                    }
                }
            }
        }
    }
    out
}

fn compared(output: &'static str, c: ArrayViewD<'_, f64>, o: ArrayViewD<'_, f64>, b: ArrayViewD<'_, f64>) -> Eval {
    let verdict = compare(output, c.view(), o.view(), b.view());
    let mut failing = ArrayD::from_elem(c.raw_dim(), false);
    ndarray::Zip::from(&mut failing).and(&c).and(&o).and(&b).for_each(|f, &c, &o, &b| {
        *f = element_ratio(c, o, b) > 1.0;
    });
    Eval::Compared { verdict, failing }
}

/// Divides each row of an `O`-shaped tensor by its row statistic.
fn divide_rows(spec: &AttentionSpec, o: &mut ArrayD<f64>, l: &ArrayD<f64>) {
    for seq in spec.sequences() {
        for h in 0..spec.n_heads_q {
            let stat = spec.head_row_stat(l.view(), &seq, h).to_owned();
            let mut rows = o.slice_mut(spec.head_slice(&seq, h, false));
            for (mut row, li) in rows.axis_iter_mut(Axis(0)).zip(stat.iter()) {
                row.mapv_inplace(|x| x / li);
            }
        }
    }
}

/// Per failing row: (first failing column, last failing column, failing count).
type RowSpans = BTreeMap<usize, (usize, usize, usize)>;

/// The failing elements of `name` as rectangles: per (batch, head), maximal runs of rows that
/// hold a failure, each with the span of failing columns.
fn regions(spec: &AttentionSpec, name: &str, failing: &ArrayD<bool>) -> (Vec<Region>, usize) {
    let packed = matches!(spec.layout, Layout::Varlen { .. });
    // (prefix axes, row axis, column axis) of each output's layout.
    let (prefix_axes, row_axis, col_axis): (Vec<usize>, usize, Option<usize>) = match (name, packed) {
        ("lse", false) => (vec![0, 1], 2, None),
        ("lse", true) => (vec![0], 1, None),
        (_, false) => (vec![0, 1], 2, Some(3)),
        (_, true) => (vec![1], 0, Some(2)),
    };
    let mut by_prefix: BTreeMap<Vec<usize>, RowSpans> = BTreeMap::new();
    for (idx, &f) in failing.indexed_iter() {
        if !f {
            continue;
        }
        let idx = idx.slice();
        let prefix: Vec<usize> = prefix_axes.iter().map(|&a| idx[a]).collect();
        let col = col_axis.map_or(0, |a| idx[a]);
        let e = by_prefix.entry(prefix).or_default().entry(idx[row_axis]).or_insert((col, col, 0));
        e.0 = e.0.min(col);
        e.1 = e.1.max(col);
        e.2 += 1;
    }
    let mut all = Vec::new();
    for (prefix, rows) in by_prefix {
        let mut current: Option<Region> = None;
        for (row, (lo, hi, n)) in rows {
            match current.as_mut() {
                Some(r) if r.rows.end == row => {
                    r.rows.end = row + 1;
                    r.cols = r.cols.start.min(lo)..r.cols.end.max(hi + 1);
                    r.failing += n;
                }
                _ => {
                    all.extend(current.take());
                    current = Some(Region { prefix: prefix.clone(), rows: row..row + 1, cols: lo..hi + 1, failing: n });
                }
            }
        }
        all.extend(current);
    }
    let more = all.len().saturating_sub(MAX_REGIONS);
    all.truncate(MAX_REGIONS);
    (all, more)
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::Layout;

    /// An element exactly at its bound (error/bound = 1) passes the verdict, so it is not in the failing map that
    /// the failing rectangles are grouped from; one just above is.
    #[test]
    fn the_failing_map_uses_the_verdicts_strict_rule() {
        let arr = |x: &[f64]| ArrayD::from_shape_vec(vec![x.len()], x.to_vec()).unwrap();
        let (c, o, b) = (arr(&[1.5, 1.5, 1.0]), arr(&[1.0, 1.0, 1.0]), arr(&[0.5, 0.4999, 0.0]));
        match compared("O", c.view(), o.view(), b.view()) {
            Eval::Compared { verdict, failing } => {
                assert_eq!(failing.iter().copied().collect::<Vec<_>>(), [false, true, false]);
                assert!(!verdict.passed());
            }
            _ => panic!("a comparison"),
        }
    }

    #[test]
    fn scores_count_every_head_of_every_sequence() {
        // 4 query heads over sequences of 3×5 and 0×7 and 2×2 scores.
        let varlen = Layout::Varlen { cu_seqlens_q: vec![0, 3, 3, 5], cu_seqlens_k: vec![0, 5, 12, 14] };
        let spec = AttentionSpec { layout: varlen, ..AttentionSpec::dense(1, 4, 2, 1, 1, 8, 8) };
        assert_eq!(score_count(&spec), 4 * (15 + 2 * 2));
        assert_eq!(score_count(&AttentionSpec::dense(2, 3, 1, 6, 10, 8, 8)), 2 * 3 * 60);
    }

    /// The names of the alignment hypotheses tried for a `[1, 2, L, 4]` case with the given masks metadata.
    fn alignment_hypotheses(len_q: usize, len_k: usize, meta: &[(&str, &str)]) -> Vec<String> {
        use crate::case::build::CaseBuilder;
        use crate::case::safetensors::Dtype;
        let zeros = |shape: &[usize]| ArrayD::<f64>::zeros(shape.to_vec());
        let mut builder = CaseBuilder::new()
            .tensor("q", Dtype::Bf16, &zeros(&[1, 2, len_q, 4]))
            .tensor("k", Dtype::Bf16, &zeros(&[1, 2, len_k, 4]))
            .tensor("v", Dtype::Bf16, &zeros(&[1, 2, len_k, 4]))
            .tensor("o", Dtype::Bf16, &zeros(&[1, 2, len_q, 4]))
            .meta("format_version", "1")
            .meta("layout", "bhld")
            .meta("recipe", "bf16-in/f32-acc/p-bf16");
        for (key, value) in meta {
            builder = builder.meta(key, value);
        }
        let case = super::super::format::from_bytes(&builder.bytes()).expect("a valid case");
        hypotheses(&case).into_iter().map(|(h, _)| h.name).filter(|n| n.contains("alignment")).collect()
    }

    /// The other alignment is tried exactly where it changes the mask: a causal mask or a window (one-sided ones
    /// included) with Lq ≠ Lk. A square problem, or one without a mask to place, has one mask for both alignments,
    /// and a hypothesis equal to the statement could never explain a failure.
    #[test]
    fn the_other_alignment_is_tried_only_where_it_moves_the_mask() {
        let causal = [("causal", "true")];
        assert_eq!(alignment_hypotheses(5, 7, &causal).len(), 1);
        assert!(alignment_hypotheses(5, 7, &causal)[0].starts_with("causal alignment"));
        assert!(alignment_hypotheses(6, 6, &causal).is_empty(), "square causal");
        assert!(alignment_hypotheses(5, 7, &[("causal", "false")]).is_empty(), "no mask");
        for window in
            [vec![("window_left", "3")], vec![("window_right", "1")], vec![("window_left", "3"), ("window_right", "1")]]
        {
            let named = alignment_hypotheses(5, 7, &window);
            assert_eq!(named.len(), 1, "{window:?}: {named:?}");
            assert!(named[0].starts_with("window alignment"), "{named:?}");
            assert!(alignment_hypotheses(7, 7, &window).is_empty(), "square {window:?}");
        }
    }

    /// The one-head sub-case behind the diagnosis's screening holds that head's query rows and outputs and its KV
    /// head's keys and values (head 3 of 4 over 2 KV heads reads KV head 1), and exists only for a dense layout with
    /// more than one (batch, head) pair.
    #[test]
    fn one_head_picks_the_head_and_its_kv_head() {
        use crate::case::build::CaseBuilder;
        use crate::case::safetensors::Dtype;
        let ramp = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            ArrayD::from_shape_vec(shape.to_vec(), (0..n).map(|i| (i % 97) as f64 / 64.0).collect()).unwrap()
        };
        let bytes = CaseBuilder::new()
            .tensor("q", Dtype::F32, &ramp(&[2, 4, 3, 2]))
            .tensor("k", Dtype::F32, &ramp(&[2, 2, 5, 2]))
            .tensor("v", Dtype::F32, &ramp(&[2, 2, 5, 3]))
            .tensor("o", Dtype::F32, &ramp(&[2, 4, 3, 3]))
            .tensor("lse", Dtype::F32, &ramp(&[2, 4, 3]))
            .meta("recipe", "f32-in/f32-acc")
            .bytes();
        let case = super::super::format::from_bytes(&bytes).expect("a valid case");
        let sub = one_head(&case, 1, 3).expect("a dense case with eight (batch, head) pairs");
        assert_eq!(sub.spec.expected_shape(attnproof_oracle::spec::Operand::O), [1, 1, 3, 3]);
        let at = |x: &ArrayD<f64>, b: usize, h: usize| {
            x.index_axis(Axis(0), b).index_axis(Axis(0), h).insert_axis(Axis(0)).insert_axis(Axis(0)).to_owned()
        };
        assert_eq!(sub.q, at(&case.q, 1, 3));
        assert_eq!(sub.k, at(&case.k, 1, 1));
        assert_eq!(sub.v, at(&case.v, 1, 1));
        assert_eq!(sub.outputs["lse"], at(&case.outputs["lse"], 1, 3));
        assert!(one_head(&case, 2, 0).is_none() && one_head(&case, 0, 4).is_none(), "out of range");
        assert!(one_head(&sub, 0, 0).is_none(), "a single head is its own screen");
    }

    #[test]
    fn mpfr_stands_down_only_above_its_limit() {
        // One head, Lq · Lk scores: exactly the limit keeps MPFR, one query row more does not.
        let at = AttentionSpec::dense(1, 1, 1, 512, MPFR_MAX_SCORES / 512, 8, 8);
        assert_eq!(score_count(&at), MPFR_MAX_SCORES);
        assert_eq!(oracle_for(&at, OracleChoice::Mpfr), (OracleChoice::Mpfr, None));
        let above = AttentionSpec::dense(1, 1, 1, 513, MPFR_MAX_SCORES / 512, 8, 8);
        let (oracle, note) = oracle_for(&above, OracleChoice::Mpfr);
        assert_eq!(oracle, OracleChoice::F64);
        assert!(note.is_some_and(|n| n.contains(&score_count(&above).to_string())));
        assert_eq!(oracle_for(&above, OracleChoice::F64), (OracleChoice::F64, None), "f64 is never replaced");
    }
}
