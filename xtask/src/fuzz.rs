//! `cargo xtask fuzz`: runs the harness's proptest suites in release mode, batch after batch with a fresh seed, for a
//! given number of minutes, showing progress and saving every failing batch's output.
//!
//! A target is a module of the harness's one integration-test binary `it` (a former test file, e.g. `flash_forward`).
//! A batch is one `cargo test --release -p attnproof-harness --test it -- T::` with `PROPTEST_CASES=K` and a fresh
//! `PROPTEST_RNG_SEED` (the variables proptest 1.12 reads in `test_runner::config::contextualize_config`); targets
//! take turns, one per batch. The reported case count is tests × K per batch: libtest says how many tests ran, not
//! how many cases each drew, and a failing property stops early.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

use crate::flags::Parsed;
use crate::mutants::{compile_failed, failed_tests, regression_files, run_captured, test_counts, write_log};
use crate::process::{cargo, describe, ensure_m4, run_status};

/// The package whose integration tests are fuzzed.
const PACKAGE: &str = "attnproof-harness";
/// Its one integration-test binary, whose modules are the fuzz targets.
const TEST_BINARY: &str = "it";
/// That binary's modules, relative to the repository root: every `*.rs` file here but the crate root is a target.
const TESTS_DIR: &str = "tests/tests/it";
/// The crate root of the test binary, which declares the modules and is no target itself.
const CRATE_ROOT: &str = "main";
/// How often the progress line is redrawn on a terminal.
const REDRAW: Duration = Duration::from_millis(250);
/// Width of the text progress bar, in characters.
const BAR_WIDTH: usize = 24;

/// Options of `cargo xtask fuzz`, from the flags declared in [`crate::flags::COMMANDS`] (defaults there too).
#[derive(Debug, Clone, PartialEq)]
struct Options {
    minutes: f64,
    target: Option<String>,
    cases_per_batch: u64,
}

impl Options {
    fn from_flags(flags: &Parsed) -> Options {
        Options {
            minutes: flags.number("--minutes").expect("--minutes has a default"),
            target: flags.text("--target"),
            cases_per_batch: flags.int("--cases-per-batch").expect("--cases-per-batch has a default"),
        }
    }
}

/// The fuzz targets: the stems of `tests/tests/it/*.rs` but `main.rs`, sorted.
fn list_targets(root: &Path) -> Result<Vec<String>> {
    let dir = root.join(TESTS_DIR);
    let mut targets: Vec<String> = std::fs::read_dir(&dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "rs"))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .filter(|stem| stem != CRATE_ROOT)
        .collect();
    targets.sort();
    Ok(targets)
}

/// The targets to fuzz: all of them, or the one `--target` names (which must exist).
fn choose_targets(all: Vec<String>, only: Option<&str>) -> Result<Vec<String>> {
    match only {
        None if all.is_empty() => bail!("no test targets in {TESTS_DIR}/"),
        None => Ok(all),
        Some(t) if all.iter().any(|a| a == t) => Ok(vec![t.to_owned()]),
        Some(t) => bail!("no test target `{t}` in {TESTS_DIR}/; the targets are: {}", all.join(", ")),
    }
}

/// The arguments of `cargo test` after `test --release` that run one target's tests: the module's path prefix is a
/// libtest name filter (`flash_forward::` selects exactly the tests of `tests/tests/it/flash_forward.rs`).
fn batch_args(target: &str) -> [String; 6] {
    ["-p", PACKAGE, "--test", TEST_BINARY, "--", &format!("{target}::")].map(str::to_owned)
}

/// A 64-bit mixer (splitmix64) so that consecutive batch seeds are unrelated without a random-number dependency.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `YYYYMMDDTHHMMSSZ` for a time since the epoch, in UTC (civil-from-days, so no date crate is needed).
fn utc_stamp(since_epoch: Duration) -> String {
    let secs = since_epoch.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// `m:ss`.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}:{:02}", s / 60, s % 60)
}

/// Running totals of a fuzz session.
#[derive(Debug, Default, Clone, PartialEq)]
struct Totals {
    batches: u64,
    cases: u64,
    failures: u64,
}

/// The single progress line: bar, elapsed / budget, batches, cases, cases/s, failures.
fn progress_line(elapsed: Duration, budget: Duration, totals: &Totals, current: &str) -> String {
    let fraction = (elapsed.as_secs_f64() / budget.as_secs_f64()).clamp(0.0, 1.0);
    let filled = (fraction * BAR_WIDTH as f64).round() as usize;
    let rate = if elapsed.as_secs_f64() > 0.0 { totals.cases as f64 / elapsed.as_secs_f64() } else { 0.0 };
    format!(
        "[{}{}] {}/{}  batches {}  cases {}  {:.1} cases/s  failures {}  ({current})",
        "#".repeat(filled),
        "-".repeat(BAR_WIDTH - filled),
        clock(elapsed),
        clock(budget),
        totals.batches,
        totals.cases,
        rate,
        totals.failures
    )
}

/// Modification times of the regression files under the harness, to tell which ones a failing batch wrote.
fn regression_snapshot(root: &Path) -> Vec<(PathBuf, Option<SystemTime>)> {
    regression_files(&root.join("tests"))
        .into_iter()
        .map(|p| {
            let modified = p.metadata().and_then(|m| m.modified()).ok();
            (p, modified)
        })
        .collect()
}

/// `cargo xtask fuzz`.
pub fn fuzz(root: &Path, flags: &Parsed) -> Result<ExitCode> {
    let options = Options::from_flags(flags);
    let targets = choose_targets(list_targets(root)?, options.target.as_deref())?;
    ensure_m4()?;

    // Build first, in the open, so that the clock measures fuzzing rather than compiling.
    let mut build = cargo(root);
    build.args(["test", "--release", "-p", PACKAGE, "--no-run", "--test", TEST_BINARY]);
    if !run_status(&mut build)?.success() {
        bail!("the release build of the fuzz targets failed (`{}`)", describe(&build));
    }

    let budget = Duration::from_secs_f64(options.minutes * 60.0);
    let failures_dir = root.join("target").join("fuzz-failures");
    let interactive = std::io::stdout().is_terminal();
    let k = options.cases_per_batch;
    println!(
        "fuzz: {} for {} with PROPTEST_CASES={k} per batch, a fresh PROPTEST_RNG_SEED each batch",
        targets.join(", "),
        clock(budget)
    );
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut seed_state = since_epoch.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32);
    let started = Instant::now();
    let mut totals = Totals::default();
    let mut saved = Vec::new();
    let mut last_draw = Instant::now() - REDRAW;
    let mut out = std::io::stdout();
    let mut cut: Option<String> = None;

    while started.elapsed() < budget {
        let target = &targets[(totals.batches % targets.len() as u64) as usize];
        let seed = splitmix64(&mut seed_state);
        let mut cmd = cargo(root);
        cmd.args(["test", "--release"])
            .args(batch_args(target))
            .env("PROPTEST_CASES", k.to_string())
            .env("PROPTEST_RNG_SEED", seed.to_string())
            .env("CARGO_TERM_COLOR", "never")
            // One backtrace per panic that proptest catches while shrinking would drown the log and slow the run.
            .env("RUST_BACKTRACE", "0");
        let before = regression_snapshot(root);
        let batch_started = SystemTime::now();
        let current = format!("{target} seed {seed}");
        // The batch in flight is stopped at the deadline, so `--minutes` is kept even when one batch is long (a
        // release batch of the backward suite at K = 256 takes over a minute on 2 cores).
        let remaining = budget.saturating_sub(started.elapsed());
        let run = run_captured(
            &mut cmd,
            Some(remaining),
            |_| {},
            || {
                if interactive && last_draw.elapsed() >= REDRAW {
                    last_draw = Instant::now();
                    let _ = write!(out, "\r{}\x1b[K", progress_line(started.elapsed(), budget, &totals, &current));
                    let _ = out.flush();
                }
            },
        )?;
        let counts = test_counts(&run.lines);
        totals.batches += 1;
        if run.timed_out() {
            // Cut at the deadline: not a failure; the tests that finished (`test NAME ... ok`) still count.
            let finished = run.stdout.iter().filter(|l| l.trim_end().ends_with(" ... ok")).count() as u64;
            totals.cases += finished * k;
            cut = Some(current.clone());
        } else {
            totals.cases += (counts.passed + counts.failed) * k;
        }
        if !run.succeeded() && !run.timed_out() {
            if counts.passed + counts.failed == 0 && compile_failed(&run.lines) {
                let log = failures_dir.join(format!("{}-{target}-build.log", stamp_now()));
                write_log(&log, &cmd, &run)?;
                println!();
                bail!(
                    "the fuzz target `{target}` no longer builds (the tree changed during the run?); log: {}",
                    log.display()
                );
            }
            totals.failures += 1;
            let stamp = utc_stamp(batch_started.duration_since(UNIX_EPOCH).unwrap_or_default());
            let log = failures_dir.join(format!("{stamp}-{target}-{seed}.log"));
            write_log(&log, &cmd, &run)?;
            let written: Vec<PathBuf> = regression_snapshot(root)
                .into_iter()
                .filter(|(p, modified)| !before.contains(&(p.clone(), *modified)))
                .map(|(p, _)| p)
                .collect();
            if interactive {
                println!();
            }
            report_failure(root, &log, target, seed, k, &failed_tests(&run.stdout, &run.stderr), &written);
            saved.push(log);
        }
        if interactive {
            last_draw = Instant::now();
            let _ = write!(out, "\r{}\x1b[K", progress_line(started.elapsed(), budget, &totals, "between batches"));
            let _ = out.flush();
        } else {
            println!("{}", progress_line(started.elapsed(), budget, &totals, &current));
        }
    }
    if interactive {
        println!();
    }

    let elapsed = started.elapsed();
    println!(
        "fuzz: {} batches, {} cases in {} ({:.1} cases/s), {} failed batches",
        totals.batches,
        totals.cases,
        clock(elapsed),
        totals.cases as f64 / elapsed.as_secs_f64().max(1e-9),
        totals.failures
    );
    if let Some(batch) = cut {
        println!("  the last batch ({batch}) was stopped at the deadline; its finished tests are counted");
    }
    for log in &saved {
        println!("  failure log: {}", log.display());
    }
    Ok(if totals.failures == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The current UTC time as a file-name stamp.
fn stamp_now() -> String {
    utc_stamp(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default())
}

/// Tells the user where a failing batch's output went, how to reproduce it, and what the house rule asks next.
fn report_failure(
    root: &Path,
    log: &Path,
    target: &str,
    seed: u64,
    cases: u64,
    failed: &[String],
    written: &[PathBuf],
) {
    let relative = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
    println!(
        "FAILED batch: {target}, seed {seed}: {}",
        if failed.is_empty() { "(see log)".to_owned() } else { failed.join(", ") }
    );
    println!("  log: {}", relative(log));
    println!(
        "  reproduce: PROPTEST_RNG_SEED={seed} PROPTEST_CASES={cases} cargo test --release {}",
        batch_args(target).join(" ")
    );
    if written.is_empty() {
        println!("  proptest records failing seeds in `tests/proptest-regressions/<suite>.txt`; commit that file.");
    } else {
        for p in written {
            println!("  proptest recorded the failing case in {} — commit it", relative(p));
        }
    }
    println!("  house rule: turn each regression into a named test (a #[test] with the shrunk input from the log).");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::parse_for_test;

    #[test]
    fn options_come_from_the_declared_flags() {
        let options = |args: &[&str]| Options::from_flags(&parse_for_test(args).unwrap());
        assert_eq!(options(&["fuzz"]), Options { minutes: 10.0, target: None, cases_per_batch: 256 });
        assert_eq!(
            options(&["fuzz", "--minutes", "0.5", "--target=flash_forward", "--cases-per-batch", "32"]),
            Options { minutes: 0.5, target: Some("flash_forward".to_owned()), cases_per_batch: 32 }
        );
        for bad in [&["--minutes", "0"][..], &["--minutes", "inf"], &["--cases-per-batch", "0"], &["--target"], &["-x"]]
        {
            let args: Vec<&str> = std::iter::once("fuzz").chain(bad.iter().copied()).collect();
            assert!(parse_for_test(&args).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn targets_come_from_the_tests_directory() {
        let all = list_targets(&crate::repo_root()).unwrap();
        assert!(all.iter().any(|t| t == "flash_forward"), "{all:?}");
        assert!(!all.iter().any(|t| t == CRATE_ROOT), "{all:?}");
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(choose_targets(all.clone(), Some("flash_forward")).unwrap(), ["flash_forward"]);
        assert!(choose_targets(all.clone(), Some("nope")).is_err());
        assert_eq!(choose_targets(all.clone(), None).unwrap(), all);
        assert!(choose_targets(vec![], None).is_err());
    }

    #[test]
    fn a_batch_runs_one_module_of_the_test_binary() {
        assert_eq!(batch_args("flash_forward").join(" "), "-p attnproof-harness --test it -- flash_forward::");
    }

    #[test]
    fn seeds_differ() {
        let mut state = 1;
        let (a, b) = (splitmix64(&mut state), splitmix64(&mut state));
        assert_ne!(a, b);
        // The first output of splitmix64 from state 0, as published with the algorithm.
        assert_eq!(splitmix64(&mut 0), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn utc_stamps() {
        assert_eq!(utc_stamp(Duration::ZERO), "19700101T000000Z");
        // 2000-03-01 is day 11017; 2024-02-29 is day 19782 (leap days on both sides of the century rule).
        assert_eq!(utc_stamp(Duration::from_secs(11_017 * 86_400 + 3_661)), "20000301T010101Z");
        assert_eq!(utc_stamp(Duration::from_secs(19_782 * 86_400 + 86_399)), "20240229T235959Z");
    }

    #[test]
    fn progress_line_shows_rate_and_bar() {
        let totals = Totals { batches: 3, cases: 1536, failures: 1 };
        let line = progress_line(Duration::from_secs(30), Duration::from_secs(60), &totals, "x");
        assert!(line.starts_with(&format!("[{}{}]", "#".repeat(12), "-".repeat(12))), "{line}");
        assert!(line.contains("0:30/1:00") && line.contains("51.2 cases/s") && line.contains("failures 1"), "{line}");
    }
}
