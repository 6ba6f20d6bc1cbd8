//! Running child processes: cargo (with its output streamed and tallied), installing `m4` when GMP needs it, and
//! NVIDIA's NVRTC wheels for the kernels' compile-only tests.

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

/// NVIDIA's wheels that give the kernels' compile-only tests NVRTC on a machine without CUDA: the compiler of the
/// CUDA 13.0 toolkit the H200 hosts run (so the same front end judges the kernels), and the headers they include
/// (`cuda_bf16.h`, `cuda_fp16.h` and what those include).
const NVRTC_WHEELS: [&str; 3] =
    ["nvidia-cuda-nvrtc==13.0.88", "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-crt==13.0.88"];
/// The variable that makes the compile-only tests fail instead of skip (`attnproof_gpu::REQUIRE_NVRTC_ENV`).
const REQUIRE_NVRTC_ENV: &str = "ATTNPROOF_REQUIRE_NVRTC";

/// Environment for a test run that gives the kernels' compile-only tests NVRTC, installing NVIDIA's wheels into
/// `~/.cache/attnproof-nvrtc-13.0.88` with pip when they are not there yet (once per machine, about 60 MB).
///
/// Nothing is changed where a CUDA toolkit is installed (`$CUDA_HOME` or `/usr/local/cuda`: its own NVRTC and headers
/// serve), nor off Linux x86-64 (no such wheels). When the wheels cannot be had, the tests print `skipped: no NVRTC`
/// and this says why; when they can, `ATTNPROOF_REQUIRE_NVRTC=1` makes sure the tests really ran.
pub fn nvrtc_env() -> Vec<(&'static str, OsString)> {
    if !(cfg!(target_os = "linux") && cfg!(target_arch = "x86_64")) {
        return vec![];
    }
    if std::env::var_os("CUDA_HOME").is_some() || Path::new("/usr/local/cuda/include/cuda_bf16.h").exists() {
        return vec![];
    }
    let Some(cache) = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
    else {
        println!("nvrtc: no HOME or XDG_CACHE_HOME to keep NVIDIA's wheels in; the compile-only tests will skip");
        return vec![];
    };
    let target = cache.join("attnproof-nvrtc-13.0.88");
    let root = target.join("nvidia").join("cu13");
    let library = root.join("lib").join("libnvrtc.so.13");
    if !library.exists() {
        if let Err(err) = install_nvrtc_wheels(&target) {
            println!("nvrtc: could not install NVIDIA's NVRTC wheels ({err:#}); the compile-only tests will skip");
            return vec![];
        }
        if !library.exists() {
            println!(
                "nvrtc: pip installed the wheels but {} is missing; the compile-only tests will skip",
                library.display()
            );
            return vec![];
        }
    }
    let mut paths = vec![root.join("lib")];
    paths.extend(std::env::var_os("LD_LIBRARY_PATH").iter().flat_map(std::env::split_paths));
    let library_path = std::env::join_paths(paths).unwrap_or_default();
    vec![
        ("LD_LIBRARY_PATH", library_path),
        // The kernels' include path is $CUDA_HOME/include (attnproof_gpu::compile::include_dir).
        ("CUDA_HOME", root.into_os_string()),
        (REQUIRE_NVRTC_ENV, OsString::from("1")),
    ]
}

/// `python3 -m pip install --target <target>` of [`NVRTC_WHEELS`] (no dependencies: the three are self-contained).
fn install_nvrtc_wheels(target: &Path) -> Result<()> {
    if find_on_path("python3").is_none() {
        bail!("python3 is not on PATH");
    }
    println!("nvrtc: installing {} into {} (once)", NVRTC_WHEELS.join(" "), target.display());
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(target)
        .args(NVRTC_WHEELS);
    let status = run_status(&mut cmd)?;
    if !status.success() {
        bail!("`{}` failed ({status})", describe(&cmd));
    }
    Ok(())
}
