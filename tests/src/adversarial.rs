//! One table of named adversarial cases, run over every [`Candidate`] by the same runners: `Lq ≠ Lk` both ways,
//! lengths 1 and tile ± 1 around KV tiles of 64 and 128 keys, fully masked rows, logit scale 100 and the maximum in
//! the last tile, GQA groups 1–16 (non-powers of two included) and MQA, varlen with empty sequences, every head dim
//! that is a multiple of 8 from 8 to 256 (with `d ≠ dv`), sliding windows of every width relative to the tiles, and
//! NSA's strided causal mask over compression windows.
//!
//! [`candidate_tests!`](crate::candidate_tests) turns the table into one `#[test]` per [`Group`] and direction for a
//! candidate. The cases alternate between bf16 and f16 (see [`run_cases`]). A candidate that
//! keeps state between runs ([`Candidate::keeps_state`]: the GPU kernels) runs inputs A and B (seeds 11 and 12) and
//! A again, and the two runs of A must agree bit for bit (no state leaks); a pure one runs input A. Every verdict
//! must pass and the discriminability gate must be valid; the backward runs every strategy of the candidate against
//! one expectation per input and requires dK, dV and D bitwise equal across strategies.

use std::collections::BTreeMap;

use attnproof_oracle::{AttentionSpec, Layout, Mask};
use ndarray::ArrayD;
use proptest::test_runner::TestCaseError;
use thiserror::Error;

use crate::backward::BackwardExpectation;
use crate::candidate::{Candidate, CandidateError, ForwardRun, Gradients, Storage};
use crate::flash::{Case, HarnessError, verify_forward};
use crate::generate::{Distribution, ValueProfile, make_case, make_d_out};
use crate::verdict::Verdict;

/// A family of adversarial cases: one test per family and direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Group {
    /// More queries than keys and fewer, across tiles.
    LqNeLk,
    /// Lengths 1 and tile − 1, tile, tile + 1 for KV tiles of 64 and 128 keys.
    TileEdges,
    /// Rows that see no key (`O = 0`, `LSE = −∞`, zero gradients).
    FullyMasked,
    /// Logit scale 100, peaked rows and the row maximum in the last KV tile.
    ExtremeValues,
    /// GQA groups 1–16, non-powers of two included, and MQA.
    GroupedHeads,
    /// Varlen batches with empty sequences.
    Varlen,
    /// Every head dim that is a multiple of 8 from 8 to 256, with `d = dv` and `d ≠ dv`.
    HeadDims,
    /// Sliding windows narrow (0, 1), one-sided, and wider than a query or key tile on either side, with and without
    /// causal.
    SlidingWindows,
    /// NSA's compressed-branch mask (`Mask::StridedCausal`, E18): overlapping, adjacent and gapped windows, windows
    /// longer than a tile, queries before the first window ends, and keys past the last complete window.
    StridedCausal,
}

impl Group {
    /// Every group, in table order.
    pub const ALL: [Group; 9] = [
        Group::LqNeLk,
        Group::TileEdges,
        Group::FullyMasked,
        Group::ExtremeValues,
        Group::GroupedHeads,
        Group::Varlen,
        Group::HeadDims,
        Group::SlidingWindows,
        Group::StridedCausal,
    ];
}

/// Which directions a case is run in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Directions {
    /// Forward and backward.
    Both,
    /// Forward only (the case is outside the backward model's hypothesis: a limit of the model, not a verdict).
    ForwardOnly,
}

/// A direction of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// `(O, LSE)`.
    Forward,
    /// `(dQ, dK, dV, D)`.
    Backward,
}

impl Directions {
    /// Whether `direction` is among these.
    pub fn include(self, direction: Direction) -> bool {
        self == Directions::Both || direction == Direction::Forward
    }
}

/// A named adversarial case.
#[derive(Clone, Debug)]
pub struct AdversarialCase {
    /// Its name in messages.
    pub name: String,
    /// Its family.
    pub group: Group,
    /// The problem.
    pub spec: AttentionSpec,
    /// How the values are drawn.
    pub profile: ValueProfile,
    /// Where it runs.
    pub directions: Directions,
}

/// A dense spec with a mask.
pub fn dense(b: usize, hq: usize, hkv: usize, lq: usize, lk: usize, d: usize, dv: usize, mask: Mask) -> AttentionSpec {
    AttentionSpec::dense(b, hq, hkv, lq, lk, d, dv).with_mask(mask)
}

/// A varlen spec with a mask.
pub fn varlen(cu_q: &[i32], cu_k: &[i32], hq: usize, hkv: usize, d: usize, dv: usize, mask: Mask) -> AttentionSpec {
    AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: cu_q.to_vec(), cu_seqlens_k: cu_k.to_vec() },
        ..AttentionSpec::dense(1, hq, hkv, 1, 1, d, dv).with_mask(mask)
    }
}

/// Gaussian inputs at a logit scale.
pub fn gaussian(logit_scale: f64) -> ValueProfile {
    ValueProfile { distribution: Distribution::Gaussian, logit_scale, value_mean: 0.0 }
}

/// `Causal ∧ Window { left, right }`.
fn causal_window(left: usize, right: usize) -> Mask {
    Mask::And(vec![Mask::Causal, Mask::Window { left, right }])
}

/// The whole table.
pub fn adversarial_cases() -> Vec<AdversarialCase> {
    let mut cases = vec![];
    let mut add = |group: Group, spec: AttentionSpec, profile: ValueProfile, directions: Directions| {
        let name = format!(
            "{group:?} #{}: {spec:?} {profile:?}",
            cases.iter().filter(|c: &&AdversarialCase| c.group == group).count()
        );
        cases.push(AdversarialCase { name, group, spec, profile, directions });
    };
    use Directions::{Both, ForwardOnly};

    for mask in [Mask::None, Mask::Causal, Mask::Window { left: 7, right: 3 }] {
        for (lq, lk) in [(1, 130), (130, 1), (65, 200), (200, 65)] {
            add(Group::LqNeLk, dense(1, 2, 1, lq, lk, 64, 64, mask.clone()), gaussian(1.0), Both);
        }
    }

    for (lq, lk) in [(1, 1), (63, 63), (64, 64), (65, 65), (127, 129), (129, 127), (128, 64), (64, 129), (1, 128)] {
        for mask in [Mask::None, Mask::Causal] {
            add(Group::TileEdges, dense(2, 2, 2, lq, lk, 128, 128, mask), gaussian(4.0), Both);
        }
    }

    // Bottom-right causal with Lq > Lk: the first Lq − Lk rows see no key.
    add(Group::FullyMasked, dense(1, 2, 2, 100, 30, 64, 64, Mask::Causal), gaussian(1.0), Both);
    add(Group::FullyMasked, dense(1, 1, 1, 70, 5, 32, 16, Mask::Window { left: 0, right: 0 }), gaussian(1.0), Both);
    add(Group::FullyMasked, dense(1, 1, 1, 129, 129, 64, 64, causal_window(3, 0)), gaussian(1.0), Both);
    // A sequence with queries and no keys; and one with keys and no queries (dK = dV = 0 there).
    add(Group::FullyMasked, varlen(&[0, 5, 70], &[0, 0, 64], 2, 1, 64, 64, Mask::None), gaussian(1.0), Both);
    add(Group::FullyMasked, varlen(&[0, 5, 70, 70], &[0, 0, 64, 100], 2, 1, 64, 64, Mask::None), gaussian(1.0), Both);

    let extreme = |distribution, logit_scale, value_mean| ValueProfile { distribution, logit_scale, value_mean };
    add(Group::ExtremeValues, dense(1, 2, 1, 129, 129, 64, 64, Mask::None), gaussian(100.0), Both);
    add(Group::ExtremeValues, dense(1, 2, 1, 129, 129, 64, 64, Mask::Causal), gaussian(100.0), Both);
    // At d = 128 this profile's score error exceeds the backward model's first-order hypothesis (2^-5), a limit of
    // the model, not a verdict on a candidate: the backward runs it at d = 64.
    let last = extreme(Distribution::MaxInLastTile, 100.0, 3.0);
    add(Group::ExtremeValues, dense(1, 1, 1, 65, 200, 128, 64, Mask::None), last, ForwardOnly);
    add(Group::ExtremeValues, dense(1, 1, 1, 65, 200, 64, 64, Mask::None), last, Both);
    add(
        Group::ExtremeValues,
        dense(1, 1, 1, 64, 64, 32, 32, Mask::None),
        extreme(Distribution::Peaked, 100.0, 0.0),
        Both,
    );
    for lk in [65, 129] {
        let last = extreme(Distribution::MaxInLastTile, 20.0, 0.0);
        add(Group::ExtremeValues, dense(1, 2, 1, 40, lk, 64, 64, Mask::Causal), last, Both);
    }

    add(Group::GroupedHeads, dense(2, 6, 3, 70, 90, 128, 64, Mask::None), gaussian(1.0), Both);
    add(Group::GroupedHeads, dense(1, 4, 1, 129, 129, 64, 128, Mask::Causal), gaussian(4.0), Both);
    add(Group::GroupedHeads, dense(1, 8, 2, 33, 65, 16, 16, Mask::Window { left: 10, right: 2 }), gaussian(1.0), Both);
    // Groups of 1 to 8 over two KV heads, 9 to 16 over one (Hq ≤ 16 keeps CPU candidates cheap).
    let masks = [Mask::None, Mask::Causal, Mask::Window { left: 9, right: 4 }];
    for group in 1..=16 {
        let mask = masks[group % masks.len()].clone();
        let n_heads_kv = if group <= 8 { 2 } else { 1 };
        add(Group::GroupedHeads, dense(1, group * n_heads_kv, n_heads_kv, 17, 70, 16, 16, mask), gaussian(1.0), Both);
    }
    // MQA: every query head shares one KV head.
    add(Group::GroupedHeads, dense(1, 7, 1, 40, 70, 64, 64, Mask::Causal), gaussian(1.0), Both);
    add(Group::GroupedHeads, dense(1, 16, 1, 20, 65, 32, 32, Mask::None), gaussian(1.0), Both);

    let (cu_q, cu_k) = ([0, 70, 70, 71, 200], [0, 65, 130, 130, 259]);
    add(Group::Varlen, varlen(&cu_q, &cu_k, 2, 1, 64, 64, Mask::None), gaussian(1.0), Both);
    add(Group::Varlen, varlen(&cu_q, &cu_k, 4, 2, 64, 32, Mask::Causal), gaussian(4.0), Both);
    add(
        Group::Varlen,
        varlen(&[0, 0, 129], &[0, 10, 10], 1, 1, 128, 128, Mask::Window { left: 5, right: 5 }),
        gaussian(1.0),
        Both,
    );
    // Empty sequences first and last, a GQA group of 3.
    let (cu_q, cu_k) = ([0, 0, 33, 33, 100, 100], [0, 20, 20, 65, 200, 200]);
    add(Group::Varlen, varlen(&cu_q, &cu_k, 6, 2, 32, 32, Mask::Window { left: 70, right: 5 }), gaussian(1.0), Both);
    add(Group::Varlen, varlen(&cu_q, &cu_k, 3, 1, 32, 48, Mask::Causal), gaussian(1.0), Both);

    for (d, dv) in [(8, 256), (256, 8), (256, 256), (128, 128), (64, 64), (24, 40), (200, 72)] {
        add(Group::HeadDims, dense(1, 2, 1, 65, 129, d, dv, Mask::Causal), gaussian(1.0), Both);
    }
    // Every multiple of 8, with dv = d and with dv = 264 − d (never equal to d): small lengths keep the sweep cheap
    // while the keys still cross a 64-key tile.
    for d in (8..=256).step_by(8) {
        for dv in [d, 264 - d] {
            add(Group::HeadDims, dense(1, 1, 1, 9, 70, d, dv, Mask::Causal), gaussian(1.0), Both);
        }
    }

    // Window widths against query tiles of 64 rows and KV tiles of 64 or 128 keys: narrow, one-sided, and wider than
    // a tile on the left, on the right or both, each without and with causal.
    let windows =
        [(0, 0), (1, 1), (0, 1), (1, 0), (20, 0), (0, 20), (70, 0), (0, 70), (130, 0), (0, 130), (130, 130), (65, 129)];
    for (left, right) in windows {
        for mask in [Mask::Window { left, right }, causal_window(left, right)] {
            add(Group::SlidingWindows, dense(1, 1, 1, 200, 200, 32, 32, mask), gaussian(1.0), Both);
        }
    }
    // NSA's compressed branch: the keys are the complete windows of the queries' tokens (Lk = ⌊(Lq − l)/s⌋ + 1), one
    // more key that never completes, or a sequence too short for any window.
    for (len, stride) in [(32, 16), (64, 64), (16, 16), (5, 3), (3, 5), (1, 1), (100, 2)] {
        let windows = |lq: usize| if lq >= len { (lq - len) / stride + 1 } else { 0 };
        for (lq, extra) in [(200, 0), (130, 1), (len - 1, 0)] {
            let mask = Mask::StridedCausal { len, stride };
            add(Group::StridedCausal, dense(1, 4, 2, lq, windows(lq) + extra, 32, 32, mask), gaussian(1.0), Both);
        }
    }
    for (lq, lk) in [(130, 260), (260, 130)] {
        for (left, right) in [(0, 0), (70, 3), (3, 130)] {
            add(
                Group::SlidingWindows,
                dense(1, 1, 1, lq, lk, 32, 32, Mask::Window { left, right }),
                gaussian(1.0),
                Both,
            );
        }
    }
    cases
}

/// The cases of one group.
pub fn cases_in(group: Group) -> Vec<AdversarialCase> {
    adversarial_cases().into_iter().filter(|c| c.group == group).collect()
}

/// Why a run did not give passing, valid verdicts.
#[derive(Debug, Error)]
pub enum RunError {
    /// The candidate gave no outputs (unsupported, or failed).
    #[error(transparent)]
    Candidate(#[from] CandidateError),
    /// The case could not be verified (the oracle refused it, or it is outside the model's hypothesis).
    #[error(transparent)]
    Harness(#[from] HarnessError),
    /// Repeated runs or strategies that must agree bitwise did not.
    #[error("{0}")]
    Disagreement(String),
    /// A verdict failed, or the gate found the case unable to discriminate.
    #[error("{0}")]
    Verdict(String),
}

impl RunError {
    /// The outcome of a property test: a case outside the model's hypothesis is rejected (not a failure of the
    /// candidate), everything else fails.
    pub fn into_test_case_error(self) -> TestCaseError {
        match self {
            RunError::Harness(HarnessError::Model(m)) => TestCaseError::reject(m.to_string()),
            e => TestCaseError::fail(e.to_string()),
        }
    }
}

/// Whether a run repeats its first input to check that nothing leaks between runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repeat {
    /// Run the first input again after the others and require bitwise equal outputs.
    FirstInput,
    /// Run each input once.
    Never,
}

/// Fails unless the verdict passes and the gate is valid.
pub fn require(label: &str, verdict: Verdict) -> Result<Verdict, RunError> {
    if verdict.passed() && verdict.valid() {
        Ok(verdict)
    } else {
        Err(RunError::Verdict(format!("{label}:\n{verdict}")))
    }
}

/// The forward of `candidate` on every case, each verified under the candidate's recipe and required to pass with a
/// valid gate; with [`Repeat::FirstInput`], the first case again, bitwise equal. Returns the verdicts.
pub fn forward_verdicts<C: Candidate, T: Storage>(
    candidate: &C,
    cases: &[&Case<T>],
    repeat: Repeat,
) -> Result<Vec<Verdict>, RunError> {
    let runs = cases.iter().map(|case| candidate.forward(case)).collect::<Result<Vec<_>, _>>()?;
    if let (Repeat::FirstInput, Some(first)) = (repeat, cases.first())
        && !candidate.forward(first)?.same(&runs[0])
    {
        return Err(RunError::Disagreement(format!("{}: two runs of input A differ bitwise", candidate.name())));
    }
    let mut verdicts = vec![];
    for (case, run) in cases.iter().zip(&runs) {
        let recipe = candidate.forward_recipe::<T>(&case.spec)?;
        let verdict = verify_forward(case, recipe, run.o.view(), run.lse.view())?;
        verdicts.push(require(&format!("{} {}", candidate.name(), <T as attnproof_gpu::GpuElement>::NAME), verdict)?);
    }
    Ok(verdicts)
}

/// The backward of `candidate`, every strategy, on every `(case, dO)` (the candidate's own forward gives `O` and
/// LSE), each verified against one expectation per case and required to pass with a valid gate. dK, dV and D must
/// agree bitwise across strategies; with [`Repeat::FirstInput`] the first case runs again per strategy (bitwise
/// equal for a deterministic strategy; dK, dV and D equal and dQ verified again for the others).
pub fn backward_verdicts<C: Candidate, T: Storage>(
    candidate: &C,
    problems: &[(&Case<T>, &ArrayD<T>)],
    repeat: Repeat,
) -> Result<Vec<Verdict>, RunError> {
    let label = |strategy: &dyn std::fmt::Debug| {
        format!("{} {} {strategy:?}", candidate.name(), <T as attnproof_gpu::GpuElement>::NAME)
    };
    let mut prepared: Vec<(ForwardRun<T>, BackwardExpectation)> = vec![];
    for (case, d_out) in problems {
        let forward = candidate.forward(case)?;
        let recipe = candidate.backward_recipe::<T>(&case.spec)?;
        prepared.push((forward, BackwardExpectation::new(case, d_out, recipe.q_tile, recipe.recipe)?));
    }
    let mut verdicts = vec![];
    let mut first_strategy: Option<Gradients<T>> = None;
    for strategy in candidate.strategies() {
        let mut first_input: Option<Gradients<T>> = None;
        for ((case, d_out), (forward, expect)) in problems.iter().zip(&prepared) {
            let grads = candidate.backward(strategy, case, forward, d_out)?;
            verdicts.push(require(&label(&strategy), expect.verify(grads.candidate())?)?);
            first_input.get_or_insert(grads);
        }
        let Some(first) = first_input else { continue };
        if let (Repeat::FirstInput, Some(((case, d_out), (forward, expect)))) =
            (repeat, problems.iter().zip(&prepared).next())
        {
            let again = candidate.backward(strategy, case, forward, d_out)?;
            if candidate.is_deterministic(strategy) {
                if !again.same(&first) {
                    return Err(RunError::Disagreement(format!(
                        "{}: two runs of input A differ bitwise",
                        label(&strategy)
                    )));
                }
            } else {
                if !again.same_dk_dv_delta(&first) {
                    return Err(RunError::Disagreement(format!(
                        "{}: dK, dV or D of input A differ bitwise",
                        label(&strategy)
                    )));
                }
                verdicts.push(require(&label(&strategy), expect.verify(again.candidate())?)?);
            }
        }
        match &first_strategy {
            None => first_strategy = Some(first),
            Some(reference) if !reference.same_dk_dv_delta(&first) => {
                return Err(RunError::Disagreement(format!(
                    "{}: dK, dV or D differ from the first strategy's",
                    label(&strategy)
                )));
            }
            Some(_) => {}
        }
    }
    Ok(verdicts)
}

/// The worst `error/bound` per output over a run of cases, for the summary line.
#[derive(Clone, Debug, Default)]
pub struct Worst(BTreeMap<&'static str, f64>);

impl Worst {
    /// Records a verdict's ratios.
    pub fn record(&mut self, verdict: &Verdict) {
        for o in &verdict.outputs {
            let e = self.0.entry(o.output).or_insert(0.0);
            *e = e.max(o.max_ratio);
        }
    }
}

impl std::fmt::Display for Worst {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{k} {v:.3e}")).collect();
        write!(f, "{}", parts.join(", "))
    }
}

/// Seeds of the inputs A and B of every case.
pub const SEEDS: [u64; 2] = [11, 12];

/// One case in storage type `T`, every check of the module docs: inputs A, B, A for a candidate that keeps state,
/// input A once for one that does not ([`Candidate::keeps_state`]).
pub fn run_case<C: Candidate, T: Storage>(
    candidate: &C,
    case: &AdversarialCase,
    direction: Direction,
) -> Result<Vec<Verdict>, RunError> {
    let (seeds, repeat) =
        if candidate.keeps_state() { (&SEEDS[..], Repeat::FirstInput) } else { (&SEEDS[..1], Repeat::Never) };
    let inputs: Vec<Case<T>> = seeds.iter().map(|&seed| make_case::<T>(&case.spec, case.profile, seed)).collect();
    match direction {
        Direction::Forward => forward_verdicts(candidate, &inputs.iter().collect::<Vec<_>>(), repeat),
        Direction::Backward => {
            let d_outs: Vec<ArrayD<T>> = seeds.iter().map(|&seed| make_d_out::<T>(&case.spec, seed)).collect();
            let problems: Vec<(&Case<T>, &ArrayD<T>)> = inputs.iter().zip(&d_outs).collect();
            backward_verdicts(candidate, &problems, repeat)
        }
    }
}

/// Runs `cases` in `direction` (those that include it); panics naming the first case that fails (an unsupported
/// case included). The storage type alternates between bf16 and f16 from case to case, so that each group sees both
/// at half the CPU time: the oracle's verdicts (and, for the GPU, NVRTC compiling one module per head dim, storage
/// type and tiling) are what a run of the table costs, and the property tests draw both types over random shapes.
/// Returns the worst ratios and the number of cases run.
pub fn run_cases<C: Candidate>(candidate: &C, cases: &[AdversarialCase], direction: Direction) -> (Worst, usize) {
    let mut worst = Worst::default();
    let mut count = 0;
    for (n, case) in cases.iter().filter(|c| c.directions.include(direction)).enumerate() {
        let (bf16, f16) = (n % 2 == 0, n % 2 == 1);
        let runs = [
            bf16.then(|| run_case::<C, half::bf16>(candidate, case, direction)),
            f16.then(|| run_case::<C, half::f16>(candidate, case, direction)),
        ];
        for verdicts in runs.into_iter().flatten() {
            match verdicts {
                Ok(verdicts) => verdicts.iter().for_each(|v| worst.record(v)),
                Err(e) => panic!("{} {direction:?} {}: {e}", candidate.name(), case.name),
            }
        }
        count += 1;
    }
    (worst, count)
}

/// The test of one group and direction for a candidate (`None`: the candidate's constructor has reported a skip).
pub fn run_group<C: Candidate>(candidate: Option<C>, group: Group, direction: Direction, test_name: &str) {
    let Some(candidate) = candidate else {
        return;
    };
    let (worst, count) = run_cases(&candidate, &cases_in(group), direction);
    assert!(count > 0, "{test_name}: no case of {group:?} runs {direction:?}");
    println!("{test_name}: {} {count} cases, worst error/bound {worst}", candidate.name());
}

/// One `#[test]` per [`Group`] of the adversarial table for a candidate, in each direction listed:
/// `candidate_tests!(ReferenceCandidate::for_tests, [forward, backward])` expands to modules `forward` and `backward`
/// with a test per group (`forward::sliding_windows`, ...) and a test that every group has one. The first argument
/// is a constructor `fn(&str) -> Option<C>` given the test's name; `None` means it reported a skip (a GPU candidate
/// without a device).
#[macro_export]
macro_rules! candidate_tests {
    ($make:path, [$($direction:ident),+ $(,)?]) => {
        $( $crate::candidate_tests!(@direction $make, $direction); )+
    };
    (@direction $make:path, forward) => {
        $crate::candidate_tests!(@groups $make, forward, Forward);
    };
    (@direction $make:path, backward) => {
        $crate::candidate_tests!(@groups $make, backward, Backward);
    };
    (@groups $make:path, $module:ident, $direction:ident) => {
        $crate::candidate_tests!(@tests $make, $module, $direction, [
            (lq_ne_lk_both_ways, LqNeLk),
            (lengths_one_and_tile_edges, TileEdges),
            (fully_masked_rows, FullyMasked),
            (extreme_values, ExtremeValues),
            (gqa_groups_and_mqa, GroupedHeads),
            (varlen_with_empty_sequences, Varlen),
            (head_dims_multiples_of_8_up_to_256, HeadDims),
            (sliding_windows, SlidingWindows),
            (strided_causal_masks, StridedCausal),
        ]);
    };
    (@tests $make:path, $module:ident, $direction:ident, [$(($test:ident, $group:ident)),+ $(,)?]) => {
        /// The adversarial table in this direction, one test per group.
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            $(
                #[test]
                fn $test() {
                    let name = concat!(module_path!(), "::", stringify!($test));
                    $crate::adversarial::run_group(
                        $make(name),
                        $crate::adversarial::Group::$group,
                        $crate::adversarial::Direction::$direction,
                        name,
                    );
                }
            )+

            /// A group added to the table without a test here would never run.
            #[test]
            fn every_group_has_a_test() {
                assert_eq!(vec![$($crate::adversarial::Group::$group),+], $crate::adversarial::Group::ALL.to_vec());
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table reaches what the module docs promise; a shrunk table would fail here.
    #[test]
    fn the_table_covers_its_promises() {
        let cases = adversarial_cases();
        for group in Group::ALL {
            assert!(cases.iter().any(|c| c.group == group), "{group:?} is empty");
        }
        let dims = |c: &AdversarialCase| (c.spec.head_dim, c.spec.head_dim_v);
        for d in (8..=256).step_by(8) {
            for direction in [Direction::Forward, Direction::Backward] {
                let runs = |c: &&AdversarialCase| c.directions.include(direction);
                assert!(cases.iter().filter(runs).any(|c| dims(c) == (d, d)), "d = dv = {d} {direction:?}");
                assert!(cases.iter().filter(runs).any(|c| c.spec.head_dim == d && c.spec.head_dim_v != d), "d = {d}");
            }
        }
        for group in 1..=16 {
            assert!(cases.iter().any(|c| c.spec.group_size() == group), "GQA group {group}");
        }
        assert!(cases.iter().any(|c| c.spec.n_heads_kv == 1 && c.spec.n_heads_q > 1), "MQA");
        let lengths: Vec<(usize, usize)> = cases
            .iter()
            .filter_map(|c| match c.spec.layout {
                Layout::Dense { len_q, len_k, .. } => Some((len_q, len_k)),
                Layout::Varlen { .. } => None,
            })
            .collect();
        for tile in [64, 128] {
            for len in [tile - 1, tile, tile + 1] {
                assert!(lengths.iter().any(|&(_, lk)| lk == len), "Lk = {len}");
            }
        }
        assert!(lengths.iter().any(|&(lq, lk)| lq == 1 && lk == 1));
        assert!(lengths.iter().any(|&(lq, lk)| lq > lk) && lengths.iter().any(|&(lq, lk)| lq < lk));
        let empty = |cu: &[i32]| cu.windows(2).any(|w| w[0] == w[1]);
        assert!(cases.iter().any(|c| matches!(&c.spec.layout, Layout::Varlen { cu_seqlens_q, cu_seqlens_k }
            if empty(cu_seqlens_q) && empty(cu_seqlens_k))));
        assert!(cases.iter().any(|c| c.profile.logit_scale >= 100.0));
        assert!(cases.iter().any(|c| c.profile.distribution == Distribution::MaxInLastTile));
        let windows: Vec<(usize, usize, bool)> = cases
            .iter()
            .filter_map(|c| match &c.spec.mask {
                Mask::Window { left, right } => Some((*left, *right, false)),
                Mask::And(parts) => parts.iter().find_map(|p| match p {
                    Mask::Window { left, right } => Some((*left, *right, true)),
                    _ => None,
                }),
                _ => None,
            })
            .collect();
        for causal in [false, true] {
            let has = |f: &dyn Fn(usize, usize) -> bool| windows.iter().any(|&(l, r, c)| c == causal && f(l, r));
            assert!(has(&|l, r| l == 0 && r == 0), "window (0, 0), causal {causal}");
            assert!(has(&|l, r| l == 1 && r == 1), "window (1, 1), causal {causal}");
            assert!(has(&|l, r| l > 0 && r == 0), "left-only window, causal {causal}");
            assert!(has(&|l, r| l == 0 && r > 0), "right-only window, causal {causal}");
            assert!(has(&|l, _| l > 128), "left wider than a 128-key tile, causal {causal}");
            assert!(has(&|_, r| r > 128), "right wider than a 128-key tile, causal {causal}");
            assert!(has(&|l, r| l > 64 && l < 128 && r == 0), "left between the tiles, causal {causal}");
        }
    }
}
