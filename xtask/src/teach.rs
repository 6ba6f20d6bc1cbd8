//! `cargo xtask teach [--out DIR]`: builds the teaching book by running the fixtures crate's
//! `teach` binary, which renders `fixtures/book/*.md` with the values of `fixtures/snapshots/`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::flags::Parsed;
use crate::process::{cargo, ensure_m4, failure_code, run_status};

/// Where the book goes unless `--out` says otherwise, relative to the workspace root.
pub const DEFAULT_OUT: &str = "target/book";

/// The book's directory: `--out DIR` (a relative `DIR` taken from the caller's directory) or [`DEFAULT_OUT`] under
/// the workspace root.
fn out_dir(flags: &Parsed, root: &Path) -> Result<PathBuf> {
    let out = flags.path("--out").unwrap_or_else(|| root.join(DEFAULT_OUT));
    // The binary runs with the workspace as its directory, so a relative path is resolved here.
    Ok(if out.is_relative() {
        std::env::current_dir().context("reading the current directory")?.join(out)
    } else {
        out
    })
}

/// `cargo xtask teach`: builds the book (debug profile, which the test build has already
/// compiled, so CI pays only for the fixtures crate's binary).
pub fn teach(root: &Path, flags: &Parsed) -> Result<ExitCode> {
    let out = out_dir(flags, root)?;
    ensure_m4()?;
    let mut cmd = cargo(root);
    cmd.args(["run", "-q", "-p", "attnproof-fixtures", "--bin", "teach", "--", "--out"]).arg(&out);
    let status = run_status(&mut cmd)?;
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::from(failure_code(status)) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::parse_for_test;

    #[test]
    fn out_defaults_to_target_book_and_accepts_both_spellings() {
        let root = Path::new("/repo");
        let out = |args: &[&str]| out_dir(&parse_for_test(args).unwrap(), root).unwrap();
        assert_eq!(out(&["teach"]), root.join("target/book"));
        assert_eq!(out(&["teach", "--out", "/srv/book-b"]), PathBuf::from("/srv/book-b"));
        assert_eq!(out(&["teach", "--out=/srv/book-c"]), PathBuf::from("/srv/book-c"));
        assert_eq!(out(&["teach", "--out", "rel"]), std::env::current_dir().unwrap().join("rel"));
        assert!(parse_for_test(&["teach", "--out"]).is_err());
        assert!(parse_for_test(&["teach", "--bogus"]).is_err());
    }
}
