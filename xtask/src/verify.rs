//! `cargo xtask verify`: every check a kernel change must pass before merging, each counted, none stopping the others.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};

use crate::parse::{TestCounts, lists_gpu};
use crate::process::{cargo, ensure_m4, nvrtc_env, run_counting_tests, run_status};
use crate::snapshots;

/// The variable that makes GPU tests fail instead of skip (`attnproof_gpu::REQUIRE_GPU_ENV`), spelled out here because
/// xtask must stay light and cannot depend on the gpu crate.
const REQUIRE_GPU_ENV: &str = "ATTNPROOF_REQUIRE_GPU";

/// Passed and failed checks so far, plus the status line of each step for the recap at the end.
#[derive(Debug, Default)]
struct Tally {
    counts: TestCounts,
    statuses: Vec<String>,
}

impl Tally {
    /// Records a step that is one check: it passed or it failed.
    fn step(&mut self, name: &str, ok: bool) {
        if ok {
            self.counts.passed += 1;
        } else {
            self.counts.failed += 1;
        }
        self.status(format!("{name}: {}", if ok { "ok" } else { "FAILED" }));
    }

    /// Prints a step's status line now and keeps it for the recap.
    fn status(&mut self, line: String) {
        println!("{line}");
        self.statuses.push(line);
    }

    /// Prints the recap and the final summary line, and turns the tally into the process's exit code.
    fn finish(self) -> ExitCode {
        println!();
        println!("--- verify summary ---");
        for line in &self.statuses {
            println!("{line}");
        }
        // This must stay the very last line: CI scripts and people read the verdict from it.
        println!("verify: {} passed, {} failed", self.counts.passed, self.counts.failed);
        if self.counts.failed > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS }
    }
}

/// Runs all verification steps in order and returns the exit code (failure when anything failed).
pub fn verify(root: &Path) -> ExitCode {
    let mut tally = Tally::default();
    if let Err(err) = ensure_m4() {
        // Without m4 nothing that links GMP can build, so the remaining steps would only repeat this failure.
        eprintln!("error: {err:#}");
        tally.step("m4", false);
        return tally.finish();
    }

    let mut fmt = cargo(root);
    fmt.args(["fmt", "--all", "--", "--check"]);
    command_step(&mut tally, "fmt", &mut fmt);

    let mut clippy = cargo(root);
    clippy.args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    command_step(&mut tally, "clippy", &mut clippy);

    // `--no-fail-fast` so that one failing test binary does not hide the results of the others: every test counts.
    // INSTA_UPDATE=no and CI=true make insta compare only, never write `.snap.new` files, and fail on a mismatch.
    let mut tests = cargo(root);
    // NVRTC (NVIDIA's wheel where no toolkit is installed) lets the kernels' compile-only tests run without a device.
    tests.args(["test", "--workspace", "--no-fail-fast"]).env("INSTA_UPDATE", "no").env("CI", "true").envs(nvrtc_env());
    test_step(&mut tally, "test", &mut tests);

    snapshot_step(&mut tally, root);
    mutation_reminder(&mut tally, root);

    if gpu_present() {
        let mut gpu = cargo(root);
        gpu.args(["test", "-p", "attnproof-gpu", "--", "--nocapture"]).env(REQUIRE_GPU_ENV, "1");
        test_step(&mut tally, "gpu", &mut gpu);
    } else {
        tally.status("gpu: skipped (no CUDA device)".to_owned());
    }

    tally.finish()
}

/// Runs a command that is one check, passing when it exits successfully.
fn command_step(tally: &mut Tally, name: &str, cmd: &mut Command) {
    let ok = match run_status(cmd) {
        Ok(status) => status.success(),
        Err(err) => {
            eprintln!("error: {err:#}");
            false
        }
    };
    tally.step(name, ok);
}

/// Runs a test command and counts each test it reports.
///
/// A run that fails without any test reporting a failure (a compile error, a test binary killed by a signal) still
/// counts as one failure, so that a suite that never ran can never make verify pass.
fn test_step(tally: &mut Tally, name: &str, cmd: &mut Command) {
    let (success, counts) = match run_counting_tests(cmd) {
        Ok((status, counts)) => (status.success(), counts),
        Err(err) => {
            eprintln!("error: {err:#}");
            (false, TestCounts::default())
        }
    };
    tally.counts += counts;
    let line = if success && counts.failed == 0 {
        format!("{name}: ok ({} passed, 0 failed)", counts.passed)
    } else if counts.failed == 0 {
        tally.counts.failed += 1;
        format!(
            "{name}: FAILED ({} passed; the run failed without a test failing, counted as 1 failure)",
            counts.passed
        )
    } else {
        format!("{name}: FAILED ({} passed, {} failed)", counts.passed, counts.failed)
    };
    tally.status(line);
}

/// Checks snapshot hygiene (see [`snapshots::check`]) as one step, listing every offending file.
fn snapshot_step(tally: &mut Tally, root: &Path) {
    let ok = match snapshots::check(root) {
        Ok(found) => {
            for path in &found.pending {
                eprintln!(
                    "snapshots: pending snapshot not reviewed: {} (review with `cargo insta review`)",
                    path.display()
                );
            }
            for path in &found.unreferenced {
                eprintln!("snapshots: no fixture source refers to {} (delete it or use it)", path.display());
            }
            found.is_clean()
        }
        Err(err) => {
            eprintln!("error: snapshot check: {err:#}");
            false
        }
    };
    tally.step("snapshots", ok);
}

/// Reminds the author, in one status line that is not a check, of changed files in cargo-mutants' scope whose current
/// content no mutants run has covered: a full run does not fit CI's time, so it is the author's to start.
fn mutation_reminder(tally: &mut Tally, root: &Path) {
    if let Some(files) = crate::cargo_mutants::untested_changes(root).filter(|f| !f.is_empty()) {
        let shown: Vec<&str> = files.iter().take(3).map(String::as_str).collect();
        let more =
            if files.len() > shown.len() { format!(" and {} more", files.len() - shown.len()) } else { String::new() };
        tally.status(format!(
            "mutants: reminder, not a check: {} changed file(s) not mutation-tested since their last change ({}{more}); \
             run `cargo xtask mutants --diff`",
            files.len(),
            shown.join(", ")
        ));
    }
}

/// Whether a CUDA device is present, asked of `nvidia-smi -L` so that detection builds and links nothing.
fn gpu_present() -> bool {
    Command::new("nvidia-smi")
        .arg("-L")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|out| out.status.success() && lists_gpu(&String::from_utf8_lossy(&out.stdout)))
}
