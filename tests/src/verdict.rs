//! Verdicts: a candidate's outputs compared with the oracle's, element by element, against a
//! bound per element; the worst `error / bound` and where it sits.

use std::fmt;

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::spec::Sequence;
use ndarray::{ArrayViewD, Dimension};

/// The comparison of one output.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputVerdict {
    /// Output name (`O`, `LSE`, ...).
    pub output: &'static str,
    /// `max(error / bound)`; `∞` when an error is non-zero where the bound is 0, or when a NaN or
    /// infinity appears on one side only.
    pub max_ratio: f64,
    /// Coordinates of the worst element.
    pub worst_index: Vec<usize>,
    /// Candidate and oracle values at the worst element.
    pub worst_values: (f64, f64),
    /// Bound at the worst element.
    pub worst_bound: f64,
    /// Elements compared.
    pub elements: usize,
}

impl OutputVerdict {
    /// Whether every element is within its bound.
    pub fn passed(&self) -> bool {
        self.max_ratio <= 1.0
    }
}

impl fmt::Display for OutputVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<4} {} max error/bound {:.3e} at {:?} (candidate {:e}, oracle {:e}, bound {:e})",
            self.output,
            if self.passed() { "ok    " } else { "FAILED" },
            self.max_ratio,
            self.worst_index,
            self.worst_values.0,
            self.worst_values.1,
            self.worst_bound
        )
    }
}

/// Compares `candidate` with `oracle` under `bound`. Infinities must match exactly (a fully
/// masked row's `LSE = −∞`); NaN anywhere, or an infinity on one side only, fails. The worst
/// element is the first, in row-major order, of those with the largest ratio.
pub fn compare(
    output: &'static str,
    candidate: ArrayViewD<'_, f64>,
    oracle: ArrayViewD<'_, f64>,
    bound: ArrayViewD<'_, f64>,
) -> OutputVerdict {
    assert_eq!(candidate.shape(), oracle.shape(), "compare {output}: shapes differ");
    let mut v = OutputVerdict {
        output,
        max_ratio: 0.0,
        worst_index: vec![],
        worst_values: (0.0, 0.0),
        worst_bound: 0.0,
        elements: 0,
    };
    for ((idx, &c), (&o, &b)) in candidate.indexed_iter().zip(oracle.iter().zip(bound.iter())) {
        v.elements += 1;
        let ratio = element_ratio(c, o, b);
        if v.elements == 1 || ratio > v.max_ratio {
            v.max_ratio = ratio;
            v.worst_index = idx.slice().to_vec();
            v.worst_values = (c, o);
            v.worst_bound = b;
        }
    }
    v
}

/// One element's `error / bound`: 0 for an exact match (under any bound, 0 included), `∞` for a NaN on either side
/// or an infinity the other side does not match exactly, `|candidate − oracle| / bound` otherwise. The element
/// fails when the ratio is above 1.
pub fn element_ratio(candidate: f64, oracle: f64, bound: f64) -> f64 {
    if candidate.is_nan() || oracle.is_nan() {
        f64::INFINITY
    } else if candidate.is_infinite() || oracle.is_infinite() {
        if candidate == oracle { 0.0 } else { f64::INFINITY }
    } else {
        let err = (candidate - oracle).abs();
        if err == 0.0 { 0.0 } else { err / bound }
    }
}

/// The largest [`element_ratio`] met so far and where: for checks that judge scattered quantities one at a time (a
/// kernel's statistics, its scores) rather than whole outputs. A later ratio replaces the worst only when larger, so
/// the first of equal ratios is named.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorstRatio {
    /// The largest ratio (0 before any offer).
    pub ratio: f64,
    /// Where it is: what `at` returned for it.
    pub at: String,
}

impl WorstRatio {
    /// Offers `candidate` against `oracle` under `bound`; `at` names it, called only when it becomes the worst.
    pub fn offer(&mut self, candidate: f64, oracle: f64, bound: f64, at: impl FnOnce() -> String) {
        let ratio = element_ratio(candidate, oracle, bound);
        if ratio > self.ratio {
            self.ratio = ratio;
            self.at = at();
        }
    }
}

/// A verdict over all outputs of one case, with its discriminability gate.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// One entry per output.
    pub outputs: Vec<OutputVerdict>,
    /// The canned wrong answers and whether each was rejected.
    pub gate: crate::gate::GateReport,
}

impl Verdict {
    /// Every output within bound.
    pub fn passed(&self) -> bool {
        self.outputs.iter().all(OutputVerdict::passed)
    }
    /// The case discriminates: every applicable canned wrong answer failed.
    pub fn valid(&self) -> bool {
        self.gate.valid()
    }
    /// The largest ratio over the outputs.
    pub fn max_ratio(&self) -> f64 {
        self.outputs.iter().map(|o| o.max_ratio).fold(0.0, f64::max)
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for o in &self.outputs {
            writeln!(f, "{o}")?;
        }
        write!(f, "{}", self.gate)
    }
}

/// `O`'s coordinates of row `i` of (sequence `seq`, query head `h`), less the column: dense `[b, h, i]`, varlen
/// `[q_start + i, h]`.
pub fn output_row(spec: &AttentionSpec, seq: &Sequence, h: usize, i: usize) -> Vec<usize> {
    match spec.layout {
        attnproof_oracle::Layout::Dense { .. } => vec![seq.index, h, i],
        attnproof_oracle::Layout::Varlen { .. } => vec![seq.q_start + i, h],
    }
}

/// The LSE's coordinates of row `i` of (sequence `seq`, query head `h`): dense `[b, h, i]`, varlen `[h, q_start + i]`.
pub fn lse_row(spec: &AttentionSpec, seq: &Sequence, h: usize, i: usize) -> Vec<usize> {
    match spec.layout {
        attnproof_oracle::Layout::Dense { .. } => vec![seq.index, h, i],
        attnproof_oracle::Layout::Varlen { .. } => vec![h, seq.q_start + i],
    }
}

#[cfg(test)]
mod tests {
    //! The verdict's own rules, each stated by the test that would fail without it.

    use super::*;
    use crate::gate::{CannedResult, GateReport};
    use ndarray::{ArrayD, IxDyn, arr1, arr2};

    fn verdict(candidate: &[f64], oracle: &[f64], bound: &[f64]) -> OutputVerdict {
        let view = |x: &[f64]| arr1(x).into_dyn();
        compare("O", view(candidate).view(), view(oracle).view(), view(bound).view())
    }

    #[test]
    fn the_ratio_is_error_over_bound() {
        let v = verdict(&[1.5, 2.0], &[1.0, 2.25], &[0.25, 1.0]);
        assert_eq!(v.max_ratio, 2.0, "|1.5 − 1| / 0.25");
        assert_eq!(v.elements, 2);
        assert!(!v.passed());
    }

    #[test]
    fn a_ratio_of_exactly_one_passes_and_just_above_fails() {
        assert!(verdict(&[1.5], &[1.0], &[0.5]).passed(), "error equal to its bound is within it");
        let above = verdict(&[1.5], &[1.0], &[0.5f64.next_down()]);
        assert!(above.max_ratio > 1.0 && !above.passed());
    }

    #[test]
    fn nan_on_either_side_fails() {
        for (c, o) in [(f64::NAN, 1.0), (1.0, f64::NAN), (f64::NAN, f64::NAN)] {
            let v = verdict(&[c], &[o], &[1.0]);
            assert_eq!(v.max_ratio, f64::INFINITY, "candidate {c}, oracle {o}");
            assert!(!v.passed());
        }
    }

    #[test]
    fn infinities_must_match_exactly() {
        assert_eq!(verdict(&[f64::NEG_INFINITY], &[f64::NEG_INFINITY], &[0.0]).max_ratio, 0.0, "a masked row's LSE");
        for (c, o) in [
            (f64::INFINITY, 1.0),
            (1.0, f64::NEG_INFINITY),
            (f64::INFINITY, f64::NEG_INFINITY),
            (f64::NEG_INFINITY, f64::INFINITY),
        ] {
            assert_eq!(verdict(&[c], &[o], &[1e300]).max_ratio, f64::INFINITY, "candidate {c}, oracle {o}");
            // Even under an infinite bound (an output the model cannot bound), which `∞ / ∞` would turn into NaN.
            assert_eq!(verdict(&[c], &[o], &[f64::INFINITY]).max_ratio, f64::INFINITY, "candidate {c}, oracle {o}");
        }
    }

    #[test]
    fn a_zero_bound_allows_only_an_exact_match() {
        assert_eq!(verdict(&[0.5], &[0.5], &[0.0]).max_ratio, 0.0);
        assert_eq!(verdict(&[0.5], &[0.5f64.next_up()], &[0.0]).max_ratio, f64::INFINITY);
    }

    #[test]
    fn the_worst_element_is_where_the_largest_ratio_is() {
        let candidate = arr2(&[[1.0, 1.0, 1.0], [1.0, 1.0, 1.5]]).into_dyn();
        let oracle = arr2(&[[1.0, 1.25, 1.0], [1.0, 1.0, 1.0]]).into_dyn();
        // Errors 0.25 at [0, 1] and 0.5 at [1, 2]; bounds make the first ratio 2.5 and the second 2.
        let bound = arr2(&[[1.0, 0.1, 1.0], [1.0, 1.0, 0.25]]).into_dyn();
        let v = compare("dK", candidate.view(), oracle.view(), bound.view());
        assert_eq!(v.worst_index, [0, 1]);
        assert_eq!(v.worst_values, (1.0, 1.25));
        assert_eq!(v.worst_bound, 0.1);
        assert!((v.max_ratio - 2.5).abs() < 1e-12);
        assert_eq!(v.output, "dK");
    }

    #[test]
    fn ties_keep_the_first_element_and_a_clean_output_reports_its_first() {
        let v = verdict(&[2.0, 1.0, 2.0], &[1.0, 1.0, 1.0], &[0.5, 0.5, 0.5]);
        assert_eq!(v.worst_index, [0], "equal ratios: the first in row-major order");
        let clean = verdict(&[3.0, 4.0], &[3.0, 4.0], &[0.5, 0.5]);
        assert_eq!((clean.max_ratio, clean.worst_index.clone(), clean.worst_values), (0.0, vec![0], (3.0, 3.0)));
        assert_eq!(clean.worst_bound, 0.5);
    }

    #[test]
    #[should_panic(expected = "shapes differ")]
    fn shapes_must_agree() {
        let a = ArrayD::<f64>::zeros(IxDyn(&[2]));
        let b = ArrayD::<f64>::zeros(IxDyn(&[3]));
        compare("O", a.view(), b.view(), b.view());
    }

    #[test]
    fn display_names_the_verdict_and_the_worst_element() {
        let failed = verdict(&[1.5], &[1.0], &[0.25]).to_string();
        assert!(failed.starts_with("O    FAILED max error/bound 2.000e0 at [0]"), "{failed}");
        assert!(failed.contains("candidate 1.5e0, oracle 1e0, bound 2.5e-1"), "{failed}");
        assert!(verdict(&[1.0], &[1.0], &[0.25]).to_string().contains(" ok "));
    }

    #[test]
    fn a_verdict_passes_when_every_output_does_and_reports_the_largest_ratio() {
        let gate = GateReport {
            canned: vec![CannedResult { name: "zeros", applicable: true, rejected: true, max_ratio: 9.0 }],
        };
        let good = verdict(&[1.0], &[1.0], &[1.0]);
        let bad = verdict(&[3.0], &[1.0], &[1.0]);
        let both = Verdict { outputs: vec![good.clone(), bad], gate: gate.clone() };
        assert!(!both.passed());
        assert_eq!(both.max_ratio(), 2.0);
        assert!(both.valid());
        let one = Verdict { outputs: vec![good.clone()], gate };
        assert!(one.passed());
        assert_eq!(one.max_ratio(), 0.0);
        let passed_canned = CannedResult { name: "zeros", applicable: true, rejected: false, max_ratio: 0.5 };
        let invalid = Verdict { outputs: vec![good], gate: GateReport { canned: vec![passed_canned] } };
        assert!(invalid.passed() && !invalid.valid(), "a case whose canned wrong answer passes is invalid");
        let text = both.to_string();
        assert!(text.contains("FAILED") && text.ends_with("gate valid: zeros=rejected"), "{text}");
    }
}
