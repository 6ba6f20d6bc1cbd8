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
