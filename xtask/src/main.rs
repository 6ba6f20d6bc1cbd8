//! `cargo xtask <command>`: project automation for attnproof (test, verify, bench-oracle), with no heavy dependencies.

mod catalog;
mod check;
mod fuzz;
mod gpu_bundle;
mod mutants;
mod parse;
mod process;
mod snapshots;
mod teach;
mod verify;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};

use crate::process::{cargo, ensure_m4, failure_code, nvrtc_env, run_counting_tests, run_status};

/// One line per command, printed by `cargo xtask help`.
const HELP: &str = "\
usage: cargo xtask <command> [args]

commands:
  test [ARGS...]                         cargo test --workspace [ARGS...], then print `test: N passed, M failed`
  verify                                 fmt, clippy, tests (insta read-only), snapshot hygiene, GPU tests if present
  bench-oracle [--len L] [--head-dim D]  dense oracle benchmark in release (defaults: --len 16384 --head-dim 128)
  mutants [--list] [--only NAME]         apply each mutant of the catalog to a scratch copy; fail unless all are killed
  fuzz [--minutes N] [--target T]        run the proptest suites in release with fresh seeds for N minutes
  gpu-bundle                             build the GPU test binaries (release) into gpu-bundle/ with run.sh
  teach [--out DIR]                      build the teaching book (HTML, from the fixture snapshots) into DIR (default target/book)
  check CASE... [--json] [--mpfr]        check case files (docs/case-format.md): exit 0 pass, 1 a failure, 2 a bad file
  help                                   print this message";

/// Default sequence length for `bench-oracle`.
const DEFAULT_BENCH_LEN: u64 = 16384;
/// Default head dimension for `bench-oracle`.
const DEFAULT_BENCH_HEAD_DIM: u64 = 128;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let command = args.next();
    let rest: Vec<OsString> = args.collect();
    match run(command.as_ref().map(|c| c.to_string_lossy()).as_deref(), rest) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Dispatches one command.
fn run(command: Option<&str>, rest: Vec<OsString>) -> Result<ExitCode> {
    match command {
        None | Some("help" | "-h" | "--help") => {
            println!("{HELP}");
            Ok(ExitCode::SUCCESS)
        }
        Some("test") => test(&repo_root(), &rest),
        Some("verify") => {
            if !rest.is_empty() {
                bail!("`verify` takes no arguments\n\n{HELP}");
            }
            Ok(verify::verify(&repo_root()))
        }
        Some("bench-oracle") => bench_oracle(&repo_root(), &rest),
        Some("mutants") => mutants::mutants(&repo_root(), &rest),
        Some("fuzz") => fuzz::fuzz(&repo_root(), &rest),
        Some("gpu-bundle") => gpu_bundle::gpu_bundle(&repo_root(), &rest),
        Some("teach") => teach::teach(&repo_root(), &rest),
        Some("check") => check::check(&repo_root(), &rest),
        Some(other) => bail!("unknown command `{other}`\n\n{HELP}"),
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

/// Arguments of `bench-oracle`, after defaults are applied.
#[derive(Debug, PartialEq, Eq)]
struct BenchArgs {
    len: u64,
    head_dim: u64,
    /// Anything else, forwarded to the benchmark unchanged.
    rest: Vec<String>,
}

/// Parses `[--len L] [--head-dim D] [other...]`, accepting both `--len L` and `--len=L`.
fn parse_bench_args(args: &[String]) -> Result<BenchArgs> {
    let mut parsed = BenchArgs { len: DEFAULT_BENCH_LEN, head_dim: DEFAULT_BENCH_HEAD_DIM, rest: Vec::new() };
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag, Some(value.to_owned())),
            None => (arg.as_str(), None),
        };
        let slot = match flag {
            "--len" => &mut parsed.len,
            "--head-dim" => &mut parsed.head_dim,
            _ => {
                parsed.rest.push(arg.clone());
                continue;
            }
        };
        let value = match inline {
            Some(value) => value,
            None => iter.next().with_context(|| format!("`{flag}` needs a value"))?.clone(),
        };
        *slot = match value.parse::<u64>() {
            Ok(n) if n > 0 => n,
            _ => bail!("`{flag}` needs a positive integer, got `{value}`"),
        };
    }
    Ok(parsed)
}

/// `cargo xtask bench-oracle`: runs the oracle's `bench_dense` example in release mode.
fn bench_oracle(root: &Path, args: &[OsString]) -> Result<ExitCode> {
    let args = args
        .iter()
        .map(|a| a.to_str().map(str::to_owned).with_context(|| format!("argument {a:?} is not valid UTF-8")))
        .collect::<Result<Vec<_>>>()?;
    let bench = parse_bench_args(&args)?;
    ensure_m4()?;
    let mut cmd = cargo(root);
    cmd.args(["run", "--release", "-p", "attnproof-oracle", "--example", "bench_dense", "--"])
        .args(["--len", &bench.len.to_string(), "--head-dim", &bench.head_dim.to_string()])
        .args(&bench.rest);
    let status = run_status(&mut cmd)?;
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::from(failure_code(status)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn bench_args_default() {
        let parsed = parse_bench_args(&[]).unwrap();
        assert_eq!(parsed, BenchArgs { len: 16384, head_dim: 128, rest: vec![] });
    }

    #[test]
    fn bench_args_both_spellings_and_passthrough() {
        let parsed = parse_bench_args(&strings(&["--len", "4096", "--head-dim=64", "--causal"])).unwrap();
        assert_eq!(parsed, BenchArgs { len: 4096, head_dim: 64, rest: strings(&["--causal"]) });
    }

    #[test]
    fn bench_args_reject_bad_values() {
        assert!(parse_bench_args(&strings(&["--len"])).is_err());
        assert!(parse_bench_args(&strings(&["--len", "0"])).is_err());
        assert!(parse_bench_args(&strings(&["--head-dim", "abc"])).is_err());
    }

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
