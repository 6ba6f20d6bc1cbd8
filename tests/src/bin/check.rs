//! `check CASE... [--json] [--mpfr] [--require-verified]`: checks case files (docs/case-format.md)
//! against the oracle under the bound of each case's stated recipe. Exit status: 0 every case
//! passed, 1 an output failed (or, with `--require-verified`, could not be verified), 2 a case file
//! was unreadable or inconsistent (the other cases are still checked).

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;

use attnproof_harness::case::report::{self, CaseOutcome};
use attnproof_harness::case::{OracleChoice, check, load};

const USAGE: &str = "usage: check CASE.safetensors... [--json] [--mpfr] [--require-verified]
  --json              one JSON object per case, in a JSON array
  --mpfr              recompute with the 256-bit MPFR oracle (cases up to 2^18 scores; larger ones use f64)
  --require-verified  an output the model cannot bound (not verified) counts as a failure
exit status: 0 all pass, 1 a failure, 2 an unreadable or inconsistent case";

fn main() -> ExitCode {
    let mut json = false;
    let mut require_verified = false;
    let mut oracle = OracleChoice::F64;
    let mut paths = Vec::new();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--json" => json = true,
            "--mpfr" => oracle = OracleChoice::Mpfr,
            "--require-verified" => require_verified = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            flag if flag.starts_with("--") => {
                eprintln!("check: unknown option {flag}\n{USAGE}");
                return ExitCode::from(2);
            }
            path => paths.push(path.to_string()),
        }
    }
    if paths.is_empty() {
        eprintln!("check: no case files given\n{USAGE}");
        return ExitCode::from(2);
    }
    let mut lines = Vec::new();
    let (mut failed, mut broken, mut not_verified) = (0, 0, 0);
    // A reader that closed the pipe (`check … | head`) has what it wanted: the checks go on to the exit status,
    // silently, instead of panicking on the first line it no longer takes.
    let mut stdout_open = true;
    let mut emit = |text: &str| {
        if stdout_open && writeln!(std::io::stdout().lock(), "{text}").is_err() {
            stdout_open = false;
        }
    };
    for path in &paths {
        let outcome: CaseOutcome = load(Path::new(path)).map(|case| check(&case, oracle));
        match &outcome {
            Err(_) => broken += 1,
            Ok(r) if r.failed() => failed += 1,
            Ok(r) => {
                not_verified += r
                    .outputs
                    .iter()
                    .filter(|o| matches!(o.status, attnproof_harness::case::Status::NotVerified(_)))
                    .count()
            }
        }
        if json {
            lines.push(report::json(path, &outcome));
        } else {
            emit(&report::text(path, &outcome));
        }
    }
    if json {
        emit(&format!("[{}]", lines.join(",\n")));
    } else {
        emit(&format!(
            "{} case(s): {} passed, {failed} failed, {broken} unreadable; {not_verified} output(s) of passing cases not verified",
            paths.len(),
            paths.len() - failed - broken
        ));
    }
    if broken > 0 {
        ExitCode::from(2)
    } else if failed > 0 || (require_verified && not_verified > 0) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
