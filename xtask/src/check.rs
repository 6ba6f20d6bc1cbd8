//! `cargo xtask check CASE... [--json] [--mpfr] [--require-verified]`: checks case files (docs/case-format.md) by
//! running the harness's `check` binary in release mode, and hands back its exit status
//! (0 all pass, 1 a failure, 2 an unreadable or inconsistent case).

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::flags::Parsed;
use crate::process::{cargo, describe, ensure_m4, failure_code};

/// The checker's arguments: the case paths, absolute from `cwd`, then the switches as given.
fn checker_args(flags: &Parsed, cwd: &Path) -> Vec<OsString> {
    let cases = flags.operands.iter().map(|case| cwd.join(case).into_os_string());
    cases.chain(flags.switches().into_iter().map(OsString::from)).collect()
}

/// Runs the checker on the case paths and switches of `flags`.
pub fn check(root: &Path, flags: &Parsed) -> Result<ExitCode> {
    // Cargo runs from the repository root, so relative case paths are made absolute from the
    // caller's directory first.
    let cwd = std::env::current_dir().context("no current directory")?;
    let args = checker_args(flags, &cwd);
    ensure_m4()?;
    let mut cmd = cargo(root);
    cmd.args(["run", "--release", "-q", "-p", "attnproof-harness", "--bin", "check", "--"]).args(&args);
    // The command goes to stderr: stdout carries the report, JSON with `--json`.
    eprintln!("$ {}", describe(&cmd));
    let status = cmd.status().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::from(failure_code(status)) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::parse_for_test;

    #[test]
    fn cases_become_absolute_and_switches_follow() {
        let flags = parse_for_test(&["check", "--json", "a.safetensors", "/abs/b.safetensors", "--mpfr"]).unwrap();
        let args = checker_args(&flags, Path::new("/here"));
        assert_eq!(args, ["/here/a.safetensors", "/abs/b.safetensors", "--json", "--mpfr"].map(OsString::from));
        assert!(parse_for_test(&["check", "--verbose", "a.safetensors"]).is_err());
    }
}
