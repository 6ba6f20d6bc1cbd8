//! `cargo xtask teach [--out DIR]`: builds the teaching book by running the fixtures crate's
//! `teach` binary, which renders `fixtures/book/*.md` with the values of `fixtures/snapshots/`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};

use crate::process::{cargo, ensure_m4, failure_code, run_status};

/// Where the book goes unless `--out` says otherwise, relative to the workspace root.
pub const DEFAULT_OUT: &str = "target/book";

/// Parses `[--out DIR]` (also `--out=DIR`); a relative `DIR` is taken from the caller's directory.
fn parse_out(args: &[OsString], root: &Path) -> Result<PathBuf> {
    let mut out = None;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let text = arg.to_str().with_context(|| format!("argument {arg:?} is not valid UTF-8"))?;
        if text == "--out" {
            out = Some(PathBuf::from(iter.next().context("`--out` needs a directory")?));
        } else if let Some(dir) = text.strip_prefix("--out=") {
            out = Some(PathBuf::from(dir));
        } else {
            bail!("`teach` takes only `--out DIR`, got `{text}`");
        }
    }
    let out = out.unwrap_or_else(|| root.join(DEFAULT_OUT));
    // The binary runs with the workspace as its directory, so a relative path is resolved here.
    Ok(if out.is_relative() {
        std::env::current_dir().context("reading the current directory")?.join(out)
    } else {
        out
    })
}

/// `cargo xtask teach`: builds the book (debug profile, which the test build has already
/// compiled, so CI pays only for the fixtures crate's binary).
pub fn teach(root: &Path, args: &[OsString]) -> Result<ExitCode> {
    let out = parse_out(args, root)?;
    ensure_m4()?;
    let mut cmd = cargo(root);
    cmd.args(["run", "-q", "-p", "attnproof-fixtures", "--bin", "teach", "--", "--out"]).arg(&out);
    let status = run_status(&mut cmd)?;
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::from(failure_code(status)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_defaults_to_target_book_and_accepts_both_spellings() {
        let root = Path::new("/repo");
        assert_eq!(parse_out(&[], root).unwrap(), root.join("target/book"));
        let os = |args: &[&str]| args.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(parse_out(&os(&["--out", "/tmp/b"]), root).unwrap(), PathBuf::from("/tmp/b"));
        assert_eq!(parse_out(&os(&["--out=/tmp/c"]), root).unwrap(), PathBuf::from("/tmp/c"));
        assert!(parse_out(&os(&["--out"]), root).is_err());
        assert!(parse_out(&os(&["--bogus"]), root).is_err());
    }
}
