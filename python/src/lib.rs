//! The native half of the Python package `attnproof`: the harness's case checker (`attnproof_harness::case`) called
//! in-process on a case held in memory, with the GIL released while the oracle runs.
//!
//! The Python half (`python/attnproof/__init__.py`) turns arrays and keyword arguments into the bytes of a case file
//! (the format of docs/case-format.md), so a check from Python reads exactly what `cargo xtask check` reads from a
//! file and gives the same report: one code path, one set of verdicts.

use attnproof_harness::case::format::from_bytes;
use attnproof_harness::case::report::{self, CaseOutcome};
use attnproof_harness::case::{OracleChoice, check};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

create_exception!(
    _native,
    CaseError,
    PyValueError,
    "A case that cannot be checked: a missing or malformed tensor or option, named in the message."
);

/// The name a case from memory has in its reports (where a file would have its path).
const IN_MEMORY: &str = "<in memory>";

/// Checks the case file whose bytes are `case` (docs/case-format.md) against the f64 oracle, or the 256-bit MPFR
/// oracle when `mpfr` is true, and returns the report as JSON and as text, the two forms `cargo xtask check` prints.
/// Raises `CaseError` when the bytes are not a consistent case.
#[pyfunction]
#[pyo3(signature = (case, mpfr = false))]
fn check_case(py: Python<'_>, case: &[u8], mpfr: bool) -> PyResult<(String, String)> {
    let oracle = if mpfr { OracleChoice::Mpfr } else { OracleChoice::F64 };
    let outcome: CaseOutcome = py.detach(|| from_bytes(case).map(|file| check(&file, oracle)));
    match &outcome {
        Err(e) => Err(CaseError::new_err(e.to_string())),
        Ok(_) => Ok((report::json(IN_MEMORY, &outcome), report::text(IN_MEMORY, &outcome))),
    }
}

/// The native module: `check_case` and `CaseError`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(check_case, m)?)?;
    m.add("CaseError", m.py().get_type::<CaseError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
