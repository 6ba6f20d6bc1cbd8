//! Pure parsing helpers for the text that cargo, libtest and `nvidia-smi` print, kept apart so they can be unit-tested.

use std::ops::AddAssign;

/// Numbers of tests that passed and failed, summed over libtest summary lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TestCounts {
    /// Tests reported as passed.
    pub passed: u64,
    /// Tests reported as failed.
    pub failed: u64,
}

impl AddAssign for TestCounts {
    fn add_assign(&mut self, rhs: Self) {
        self.passed += rhs.passed;
        self.failed += rhs.failed;
    }
}

/// Reads a libtest summary line such as `test result: ok. 3 passed; 0 failed; 1 ignored; ...` or
/// `test result: FAILED. 2 passed; 1 failed; ...`, returning `None` for any other line.
///
/// Leading whitespace is tolerated because doc-test and nested harness output is sometimes indented; anything that
/// does not carry both a `passed` and a `failed` count is rejected rather than guessed at.
pub fn parse_test_result(line: &str) -> Option<TestCounts> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let (verdict, counts) = rest.split_once(". ")?;
    if verdict != "ok" && verdict != "FAILED" {
        return None;
    }
    let mut passed = None;
    let mut failed = None;
    for field in counts.split(';') {
        let mut words = field.split_whitespace();
        let (Some(number), Some(label)) = (words.next(), words.next()) else { continue };
        let Ok(number) = number.parse::<u64>() else { continue };
        match label {
            "passed" => passed = Some(number),
            "failed" => failed = Some(number),
            _ => {}
        }
    }
    Some(TestCounts { passed: passed?, failed: failed? })
}

/// Extracts the snapshot name from an insta file name: `<prefix>__<name>.snap` gives `<name>`.
///
/// insta builds the prefix from the crate or module path, joined with `__`, so the name is what follows the last
/// `__`. A file without `__` has no prefix and its whole stem is the name. Anything not ending in `.snap` gives `None`.
pub fn snapshot_name(file_name: &str) -> Option<&str> {
    let stem = file_name.strip_suffix(".snap")?;
    let name = match stem.rfind("__") {
        Some(at) => &stem[at + 2..],
        None => stem,
    };
    (!name.is_empty()).then_some(name)
}

/// Whether the output of `nvidia-smi -L` lists at least one GPU (lines look like `GPU 0: NVIDIA H200 (UUID: ...)`).
pub fn lists_gpu(nvidia_smi_output: &str) -> bool {
    nvidia_smi_output.lines().any(|line| line.trim_start().starts_with("GPU"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ok_summary() {
        let line = "test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.03s";
        assert_eq!(parse_test_result(line), Some(TestCounts { passed: 12, failed: 0 }));
    }

    #[test]
    fn parses_failed_summary() {
        let line = "test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.20s";
        assert_eq!(parse_test_result(line), Some(TestCounts { passed: 3, failed: 2 }));
    }

    #[test]
    fn parses_indented_summary_with_crlf() {
        let line = "   test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\r";
        assert_eq!(parse_test_result(line), Some(TestCounts { passed: 0, failed: 0 }));
    }

    #[test]
    fn rejects_other_lines() {
        assert_eq!(parse_test_result("test oracle::dense::softmax ... ok"), None);
        assert_eq!(parse_test_result("running 12 tests"), None);
        assert_eq!(parse_test_result("test result: maybe. 1 passed; 0 failed"), None);
        assert_eq!(parse_test_result("test result: ok. 1 passed"), None);
        assert_eq!(parse_test_result(""), None);
    }

    #[test]
    fn counts_add_up() {
        let mut total = TestCounts::default();
        total += TestCounts { passed: 2, failed: 1 };
        total += TestCounts { passed: 5, failed: 0 };
        assert_eq!(total, TestCounts { passed: 7, failed: 1 });
    }

    #[test]
    fn snapshot_name_takes_part_after_last_double_underscore() {
        assert_eq!(snapshot_name("attnproof_fixtures__softmax_row.snap"), Some("softmax_row"));
        assert_eq!(snapshot_name("worked__examples__causal_4x4.snap"), Some("causal_4x4"));
        assert_eq!(snapshot_name("plain.snap"), Some("plain"));
    }

    #[test]
    fn snapshot_name_rejects_non_snapshots() {
        assert_eq!(snapshot_name("fixtures__x.snap.new"), None);
        assert_eq!(snapshot_name("fixtures__x.pending-snap"), None);
        assert_eq!(snapshot_name("fixtures__.snap"), None);
        assert_eq!(snapshot_name("lib.rs"), None);
    }

    #[test]
    fn detects_gpu_listing() {
        assert!(lists_gpu("GPU 0: NVIDIA H200 (UUID: GPU-0123)\n"));
        assert!(!lists_gpu(""));
        assert!(!lists_gpu("No devices were found\n"));
        assert!(!lists_gpu("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"));
    }
}
