//! Running child processes: cargo (with its output streamed and tallied), and installing `m4` when GMP needs it.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use anyhow::{Context, Result, bail};

use crate::parse::{TestCounts, parse_test_result};

/// The command a user should run when `m4` is missing and xtask cannot install it itself.
pub const M4_INSTALL_HINT: &str = "sudo apt-get install -y m4";

/// A `cargo` command rooted at the repository, using the same cargo binary that launched xtask when there is one.
///
/// `cargo xtask` runs through `cargo run`, which sets `CARGO` to the cargo in use; reusing it keeps the toolchain
/// consistent (a `rust-toolchain` override or `cargo +nightly xtask` would otherwise be lost).
pub fn cargo(root: &Path) -> Command {
    let program = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut cmd = Command::new(program);
    cmd.current_dir(root);
    cmd
}

/// Describes a command for the terminal, e.g. `cargo test --workspace`, so the user can rerun it by hand.
pub fn describe(cmd: &Command) -> String {
    let program = Path::new(cmd.get_program()).file_name().unwrap_or(cmd.get_program()).to_string_lossy().into_owned();
    std::iter::once(program)
        .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs a command with inherited stdio and returns its exit status.
pub fn run_status(cmd: &mut Command) -> Result<ExitStatus> {
    println!("$ {}", describe(cmd));
    cmd.status().with_context(|| format!("could not start `{}`", describe(cmd)))
}

/// Runs a test command, echoing its stdout line by line while summing every libtest `test result:` line in it.
///
/// Only stdout is captured: libtest writes its summaries there, while cargo's own progress goes to stderr, which stays
/// attached to the terminal so that colours and progress lines are untouched.
pub fn run_counting_tests(cmd: &mut Command) -> Result<(ExitStatus, TestCounts)> {
    println!("$ {}", describe(cmd));
    let mut child =
        cmd.stdout(Stdio::piped()).spawn().with_context(|| format!("could not start `{}`", describe(cmd)))?;
    let stdout = child.stdout.take().context("child stdout was not captured")?;
    let mut reader = BufReader::new(stdout);
    let mut counts = TestCounts::default();
    let mut line = Vec::new();
    let mut out = std::io::stdout().lock();
    loop {
        line.clear();
        // Bytes rather than `String` lines, because test output is not guaranteed to be UTF-8 and a stray byte must
        // not abort the run.
        if reader.read_until(b'\n', &mut line).context("reading the test output")? == 0 {
            break;
        }
        out.write_all(&line)?;
        out.flush()?;
        if let Some(found) = parse_test_result(&String::from_utf8_lossy(&line)) {
            counts += found;
        }
    }
    drop(out);
    let status = child.wait().context("waiting for the test run")?;
    Ok((status, counts))
}

/// Finds an executable by name on `PATH`.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| is_executable(candidate))
}

#[cfg(unix)]
fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(path: &Path) -> bool {
    path.is_file()
}

/// Makes sure `m4` is available, installing it with apt-get when running as root; GMP's build (under `rug`) needs it.
///
/// When it cannot be installed here, the error names the exact command to run, [`M4_INSTALL_HINT`].
pub fn ensure_m4() -> Result<()> {
    if find_on_path("m4").is_some() {
        return Ok(());
    }
    let why_not = match try_install_m4() {
        Ok(()) if find_on_path("m4").is_some() => {
            println!("m4: installed");
            return Ok(());
        }
        Ok(()) => "apt-get reported success but m4 is still not on PATH".to_owned(),
        Err(err) => format!("{err:#}"),
    };
    bail!(
        "m4 is not installed and could not be installed automatically ({why_not}).\nGMP's build needs m4; run:\n    {M4_INSTALL_HINT}"
    )
}

/// Installs m4 through apt-get, which only works as root on a Debian-like system.
fn try_install_m4() -> Result<()> {
    if !running_as_root() {
        bail!("not running as root");
    }
    if find_on_path("apt-get").is_none() {
        bail!("apt-get is not available");
    }
    println!(
        "m4: not found; installing it with `apt-get update -qq && apt-get install -y -qq m4` (GMP's build needs it)"
    );
    for args in [&["update", "-qq"][..], &["install", "-y", "-qq", "m4"][..]] {
        let mut cmd = Command::new("apt-get");
        // Without this, a package that asks a question would hang a CI run waiting on a terminal that is not there.
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        let status = run_status(&mut cmd)?;
        if !status.success() {
            bail!("`{}` failed ({status})", describe(&cmd));
        }
    }
    Ok(())
}

/// Whether the current user is root, asked of `id -u` so that xtask needs no libc binding.
fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|out| out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// The exit code to hand back for a failed child: its own when it has one, else 1 (for example after a signal).
pub fn failure_code(status: ExitStatus) -> u8 {
    match status.code() {
        Some(code) if (1..=255).contains(&code) => code as u8,
        _ => 1,
    }
}
