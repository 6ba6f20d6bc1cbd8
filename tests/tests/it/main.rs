//! The harness's integration tests, gathered in one test binary so that the verifier, the reference schedules and
//! the GPU crate are linked once rather than once per test file; each module was a test file of its own before, and
//! keeps its name, so a test reads `flash_forward::…` and a module is selected by the libtest filter `ring::`.

mod check_bad_files;
mod check_cases;
mod check_causes;
mod check_recipes;
mod check_token_lists;
mod flash_backward;
mod flash_forward;
mod nsa_compress;
mod nsa_gates;
mod recipe;
mod ring;
mod sparse;
