//! `cargo xtask check CASE... [--json] [--mpfr] [--require-verified]`: checks case files (docs/case-format.md) by
//! running the harness's `check` binary in release mode, and hands back its exit status
//! (0 all pass, 1 a failure, 2 an unreadable or inconsistent case).

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::process::{cargo, describe, ensure_m4, failure_code};

/// Runs the checker on `args` (case paths and flags).
pub fn check(root: &Path, args: &[OsString]) -> Result<ExitCode> {
    // Cargo runs from the repository root, so relative case paths are made absolute from the
    // caller's directory first.
    let cwd = std::env::current_dir().context("no current directory")?;
    let args: Vec<OsString> = args
        .iter()
        .map(|a| if a.to_string_lossy().starts_with("--") { a.clone() } else { cwd.join(a).into_os_string() })
        .collect();
    ensure_m4()?;
    let mut cmd = cargo(root);
    cmd.args(["run", "--release", "-q", "-p", "attnproof-harness", "--bin", "check", "--"]).args(&args);
    // The command goes to stderr: stdout carries the report, JSON with `--json`.
    eprintln!("$ {}", describe(&cmd));
    let status = cmd.status().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::from(failure_code(status)) })
}
