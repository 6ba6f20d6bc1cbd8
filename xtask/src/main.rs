//! `cargo xtask <command>`: project automation for attnproof (test, verify, mutants, gpu-bundle, ...), with no heavy
//! dependencies. The commands and their flags are declared once, in [`flags::COMMANDS`].

mod cargo_mutants;
mod check;
mod equations;
mod flags;
mod fuzz;
mod gpu_bundle;
mod mutants;
mod parse;
mod process;
mod snapshots;
mod teach;
mod tidy;
mod verify;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;

use crate::flags::{Command, Invocation, Parsed};
use crate::process::{cargo, ensure_m4, failure_code, nvrtc_env, run_counting_tests, run_status};

fn main() -> ExitCode {
    match run(std::env::args_os().skip(1).collect()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Parses the command line against [`flags::COMMANDS`] and dispatches the command.
fn run(args: Vec<OsString>) -> Result<ExitCode> {
    let flags = match flags::parse(args)? {
        Invocation::Help(None) => {
            println!("{}", flags::overview());
            return Ok(ExitCode::SUCCESS);
        }
        Invocation::Help(Some(spec)) => {
            println!("{}", flags::command_help(spec));
            return Ok(ExitCode::SUCCESS);
        }
        Invocation::Run(flags) => flags,
    };
    let root = repo_root();
    match flags.spec.command {
        Command::Test => test(&root, &flags.operands),
        Command::Verify => Ok(verify::verify(&root)),
        Command::BenchOracle => bench_oracle(&root, &flags),
        Command::Mutants => mutants::mutants(&root, &flags),
        Command::Fuzz => fuzz::fuzz(&root, &flags),
        Command::GpuBundle => gpu_bundle::gpu_bundle(&root),
        Command::Teach => teach::teach(&root, &flags),
        Command::Check => check::check(&root, &flags),
        // `flags::parse` answers `help` itself, with or without a command.
        Command::Help => {
            println!("{}", flags::overview());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The workspace root: the parent of xtask's own manifest directory.
fn repo_root() -> PathBuf {
    // `cargo run` sets CARGO_MANIFEST_DIR at run time; the compile-time value covers running the binary directly.
    let manifest =
        std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest.parent().map_or(manifest.clone(), Path::to_path_buf)
}

/// `cargo xtask test`: runs the workspace tests, forwarding every further argument to `cargo test`.
///
/// Arguments are forwarded verbatim, so `cargo xtask test -- --nocapture` reaches libtest and
/// `cargo xtask test -p attnproof-oracle` reaches cargo; in the latter case `--workspace` is left out, because cargo
/// would otherwise test the whole workspace and quietly ignore the package selection.
fn test(root: &Path, extra: &[OsString]) -> Result<ExitCode> {
    ensure_m4()?;
    let mut cmd = cargo(root);
    cmd.arg("test").envs(nvrtc_env());
    if !selects_packages(extra) {
        cmd.arg("--workspace");
    }
    cmd.args(extra);
    let (status, counts) = run_counting_tests(&mut cmd)?;
    println!("test: {} passed, {} failed", counts.passed, counts.failed);
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::from(failure_code(status)) })
}

/// Whether cargo arguments (those before a `--`) pick packages with `-p` / `--package`.
fn selects_packages(args: &[OsString]) -> bool {
    args.iter().map(|a| a.to_string_lossy()).take_while(|a| a != "--").any(|a| {
        a == "-p" || a == "--package" || a.starts_with("--package=") || (a.starts_with("-p") && !a.starts_with("--"))
    })
}

/// `cargo xtask bench-oracle`: runs the oracle's `bench_dense` example in release mode with `--len` and `--head-dim`
/// (their defaults in [`flags::COMMANDS`]) and every other argument forwarded.
fn bench_oracle(root: &Path, flags: &Parsed) -> Result<ExitCode> {
    let len = flags.int("--len").expect("--len has a default");
    let head_dim = flags.int("--head-dim").expect("--head-dim has a default");
    ensure_m4()?;
    let mut cmd = cargo(root);
    cmd.args(["run", "--release", "-p", "attnproof-oracle", "--example", "bench_dense", "--"])
        .args(["--len", &len.to_string(), "--head-dim", &head_dim.to_string()])
        .args(&flags.operands);
    let status = run_status(&mut cmd)?;
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::from(failure_code(status)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_selection_is_detected_before_double_dash_only() {
        let os = |args: &[&str]| args.iter().map(OsString::from).collect::<Vec<_>>();
        assert!(selects_packages(&os(&["-p", "xtask"])));
        assert!(selects_packages(&os(&["--package=xtask"])));
        assert!(selects_packages(&os(&["-pxtask", "--", "--nocapture"])));
        assert!(!selects_packages(&os(&[])));
        assert!(!selects_packages(&os(&["--", "-p"])));
        assert!(!selects_packages(&os(&["--no-fail-fast", "--", "--nocapture"])));
    }

    #[test]
    fn repo_root_is_workspace() {
        assert!(repo_root().join("xtask").join("Cargo.toml").is_file());
    }
}
