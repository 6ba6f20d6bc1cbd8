//! Verdicts: a candidate's outputs compared with the oracle's, element by element, against a
//! bound per element; the worst `error / bound` and where it sits.

use std::fmt;

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
/// masked row's `LSE = −∞`); NaN anywhere, or an infinity on one side only, fails.
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
        let ratio = if c.is_nan() || o.is_nan() {
            f64::INFINITY
        } else if c.is_infinite() || o.is_infinite() {
            if c == o { 0.0 } else { f64::INFINITY }
        } else {
            let err = (c - o).abs();
            if err == 0.0 { 0.0 } else { err / b }
        };
        if v.elements == 1 || ratio > v.max_ratio {
            v.max_ratio = ratio;
            v.worst_index = idx.slice().to_vec();
            v.worst_values = (c, o);
            v.worst_bound = b;
        }
    }
    v
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
