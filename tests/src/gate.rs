//! The discriminability gate (docs/design.md, verdicts): every case also scores canned wrong
//! answers — zeros, `mean(V)`, the last KV tile dropped, scale `1/d`, LSE in base 2, a dropped
//! selected block — and the case is invalid unless each applicable one fails the verdict.
//!
//! A canned answer is applicable when it differs from the oracle's answer by more than
//! [`VISIBLE_ULPS`] units in the last place of the input dtype, relative to the output's scale:
//! a difference any kernel verifier for that dtype must be able to see. One that differs less
//! (a dropped tile holding no mass, scale `1/d` when `d = 1`) cannot be told apart by anyone and
//! is reported as not applicable.

use std::fmt;

use ndarray::ArrayViewD;

use crate::verdict::{OutputVerdict, compare};

/// How many input-dtype ulps a canned answer must deviate by to be applicable.
pub const VISIBLE_ULPS: f64 = 4.0;

/// One canned wrong answer's fate.
#[derive(Clone, Debug, PartialEq)]
pub struct CannedResult {
    /// Its name (`zeros`, `mean(V)`, ...).
    pub name: &'static str,
    /// Whether it deviates visibly from the truth.
    pub applicable: bool,
    /// Whether the verdict rejected it.
    pub rejected: bool,
    /// The verdict's worst ratio for it.
    pub max_ratio: f64,
}

/// The gate over all canned answers of a case.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GateReport {
    /// One entry per canned answer.
    pub canned: Vec<CannedResult>,
}

impl GateReport {
    /// Valid unless an applicable canned answer passed.
    pub fn valid(&self) -> bool {
        self.canned.iter().all(|c| !c.applicable || c.rejected)
    }

    /// Scores one canned answer for one output: applicable if it deviates from `oracle` by more
    /// than `VISIBLE_ULPS · u_T · scale` somewhere, rejected if the verdict fails it.
    pub fn score(
        &mut self,
        name: &'static str,
        output: &'static str,
        canned: ArrayViewD<'_, f64>,
        oracle: ArrayViewD<'_, f64>,
        bound: ArrayViewD<'_, f64>,
        unit_roundoff: f64,
        scale: f64,
    ) {
        let threshold = VISIBLE_ULPS * unit_roundoff * scale;
        let deviates = canned
            .iter()
            .zip(oracle.iter())
            .any(|(c, o)| if c.is_finite() && o.is_finite() { (c - o).abs() > threshold } else { c != o });
        let v: OutputVerdict = compare(output, canned, oracle, bound);
        self.canned.push(CannedResult { name, applicable: deviates, rejected: !v.passed(), max_ratio: v.max_ratio });
    }
}

impl fmt::Display for GateReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gate {}:", if self.valid() { "valid" } else { "INVALID" })?;
        for c in &self.canned {
            let state = match (c.applicable, c.rejected) {
                (false, _) => "n/a",
                (true, true) => "rejected",
                (true, false) => "PASSED",
            };
            write!(f, " {}={state}", c.name)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The gate's rules: when a canned answer counts, when it is rejected, and when a case is valid.

    use super::*;
    use ndarray::arr1;

    /// Scores one canned answer with `u = 2^-8` (so the visibility threshold is `4 · 2^-8 = 1/64` at scale 1).
    fn score(canned: &[f64], oracle: &[f64], bound: &[f64], scale: f64) -> CannedResult {
        let mut gate = GateReport::default();
        let view = |x: &[f64]| arr1(x).into_dyn();
        gate.score("zeros", "O", view(canned).view(), view(oracle).view(), view(bound).view(), 1.0 / 256.0, scale);
        gate.canned.pop().unwrap()
    }

    #[test]
    fn applicable_only_above_the_visibility_threshold() {
        assert!(!score(&[1.0 + 1.0 / 64.0], &[1.0], &[1.0], 1.0).applicable, "exactly VISIBLE_ULPS ulps is not enough");
        assert!(score(&[1.0 + 1.0 / 32.0], &[1.0], &[1.0], 1.0).applicable);
        assert!(!score(&[1.0 + 1.0 / 32.0], &[1.0], &[1.0], 4.0).applicable, "the threshold scales with the output");
        assert!(score(&[1.0, 2.0], &[1.0, 1.0], &[1.0, 1.0], 1.0).applicable, "one visible element is enough");
    }

    #[test]
    fn non_finite_values_are_applicable_unless_identical() {
        assert!(score(&[f64::INFINITY], &[1.0], &[1.0], 1.0).applicable);
        assert!(score(&[f64::NAN], &[1.0], &[1.0], 1.0).applicable);
        assert!(!score(&[f64::NEG_INFINITY], &[f64::NEG_INFINITY], &[0.0], 1.0).applicable);
    }

    #[test]
    fn rejected_means_the_verdict_fails_it() {
        let far = score(&[3.0], &[1.0], &[1.0], 1.0);
        assert!(far.rejected);
        assert_eq!(far.max_ratio, 2.0);
        let within = score(&[1.5], &[1.0], &[1.0], 1.0);
        assert!(within.applicable && !within.rejected, "visible, yet inside a loose bound");
    }

    #[test]
    fn a_case_is_valid_unless_an_applicable_canned_answer_passes() {
        let result = |applicable, rejected| CannedResult { name: "x", applicable, rejected, max_ratio: 0.0 };
        assert!(GateReport::default().valid(), "no canned answer, nothing passed");
        assert!(GateReport { canned: vec![result(true, true), result(false, false)] }.valid());
        assert!(!GateReport { canned: vec![result(true, true), result(true, false)] }.valid());
        let text =
            GateReport { canned: vec![result(true, true), result(false, false), result(true, false)] }.to_string();
        assert_eq!(text, "gate INVALID: x=rejected x=n/a x=PASSED");
    }
}
