//! `cargo xtask gpu-bundle`: builds the GPU test binaries and the benchmark binaries in release and copies them, with
//! `bench/peers.py` and a `run.sh` entry script, into `gpu-bundle/` (ignored by git), so that one call on a GPU machine
//! without Rust runs the whole GPU verification: `bash gpu-bundle/run.sh [tests|mutants|sanitize|bench|bsa-bench|peers|
//! python]`. The case checker (`check`) and the PyTorch case dumper (`python/`) ride along for the verdict on PyTorch's
//! kernels, and the Python package's wheel with its tests for the paths that need torch (`run.sh python`).
//!
//! The catalog's scratch-built GPU mutants (`Runner::ScratchGpu`) are built here too: each is patched into the scratch
//! copy that `cargo xtask mutants` uses (one shared target directory, so dependencies compile once), its killing test
//! binary is built in release into `gpu-bundle/mutants/<name>/test`, and `run.sh` runs it on the GPU host, counting
//! the mutant killed when it fails while the unpatched binary passes.
//!
//! The executables are found from cargo's own JSON messages (`--message-format=json`), not by guessing file names in
//! `target/`. The bundle must stay under the device tool's 64 MiB transfer limit, so every program travels stripped of
//! its line tables and compressed (`tests/NAME.gz`, `bin/NAME.gz`; `run.sh` unpacks them before anything else), and
//! the size is checked at the end.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{Context, Result, bail};
use attnproof_catalog::{Mutant, Runner};

use crate::mutants::{ScratchTree, recreate_dir};
use crate::process::{cargo, describe, ensure_m4, find_on_path};

/// Packages whose test binaries go into the bundle.
const PACKAGES: &[&str] = &["attnproof-gpu"];
/// (package, binary) of the programs that go into the bundle's `bin/`: the benchmarks and the case checker.
const BENCHES: &[(&str, &str)] = &[
    ("attnproof-gpu", "bench"),
    ("attnproof-gpu", "recall"),
    ("attnproof-harness", "ring_bench"),
    ("attnproof-harness", "check"),
];
/// Scripts copied into the bundle's root, relative to the repository root.
const SCRIPTS: &[&str] =
    &["bench/peers.py", "bench/block_sparse_peers.py", "bench/dsa_peers.py", "bench/dsa_sparse_peers.py"];
/// Scripts copied into the bundle at their own relative paths (they import each other by relative path).
const TREE_SCRIPTS: &[&str] = &[
    "python/attnproof_dump.py",
    "python/examples/dump_peers.py",
    "python/examples/peers_table.py",
    "python/tests/test_check.py",
    "python/examples/test_sdpa.py",
];
/// Where the Python package's wheel goes in the bundle (`run.sh python` installs it).
const WHEELS_DIR: &str = "python/wheels";
/// The bundle directory, relative to the repository root.
pub const BUNDLE_DIR: &str = "gpu-bundle";
/// Largest bundle the device tool carries: its 64 MiB hold the repository's working tree too (about 3 MiB).
const MAX_BUNDLE_BYTES: u64 = 60 * 1024 * 1024;

/// The entry script, `xtask/bundle/run.sh` (a real file, so that shellcheck can read it): requires a GPU, points
/// NVRTC at the toolkit, and runs one mode.
const RUN_SH: &str = include_str!("../bundle/run.sh");
/// Where [`RUN_SH`] lives, relative to xtask's manifest directory (for the shellcheck test).
#[cfg(test)]
const RUN_SH_PATH: &str = "bundle/run.sh";
/// The bundle's directory of scratch-built GPU mutants, one subdirectory per mutant (read by `run.sh`).
const MUTANTS_DIR: &str = "mutants";
/// The bundle's directories of test binaries and of other programs, each `NAME.gz` until `run.sh` unpacks it.
const TESTS_DIR: &str = "tests";
const BINS_DIR: &str = "bin";

/// `cargo xtask gpu-bundle`.
pub fn gpu_bundle(root: &Path) -> Result<ExitCode> {
    ensure_m4()?;
    let mut executables = vec![];
    for package in PACKAGES {
        executables.extend(build_test_binaries(root, package, None)?);
    }
    if executables.is_empty() {
        bail!("cargo reported no test executables for {PACKAGES:?}");
    }
    let mut benches = vec![];
    for (package, bin) in BENCHES {
        benches.push(build_bin(root, package, bin)?);
    }
    let scratch_mutants = build_scratch_mutants(root, &executables)?;
    let bundle = root.join(BUNDLE_DIR);
    if bundle.exists() {
        fs::remove_dir_all(&bundle).with_context(|| format!("could not clear {}", bundle.display()))?;
    }
    let mut total = 0u64;
    for (dir, programs) in [(TESTS_DIR, &executables), (BINS_DIR, &benches)] {
        let dir = bundle.join(dir);
        fs::create_dir_all(&dir).with_context(|| format!("could not create {}", dir.display()))?;
        for (name, path) in programs {
            total += pack_program(path, &dir, name)?;
        }
    }
    for built in &scratch_mutants {
        let dir = bundle.join(MUTANTS_DIR).join(built.name);
        fs::create_dir_all(&dir).with_context(|| format!("could not create {}", dir.display()))?;
        // Release test binaries keep their line tables; the staged copy was stripped already. It travels compressed
        // (`run.sh` unpacks it): four patched copies of the test binary would leave no room in the 64 MiB.
        let dest = dir.join("test.gz");
        gzip(&built.staged, &dest)?;
        fs::write(dir.join("filter"), built.filter).with_context(|| format!("could not write {}", dir.display()))?;
        fs::write(dir.join("baseline"), &built.baseline)
            .with_context(|| format!("could not write {}", dir.display()))?;
        total += fs::metadata(&dest)?.len();
        println!("gpu-bundle: {} ({} KiB)", dest.display(), fs::metadata(&dest)?.len() / 1024);
    }
    for script in SCRIPTS {
        let src = root.join(script);
        let dest = bundle.join(Path::new(script).file_name().expect("a file name"));
        fs::copy(&src, &dest).with_context(|| format!("could not copy {}", src.display()))?;
        total += fs::metadata(&dest)?.len();
    }
    for script in TREE_SCRIPTS {
        let src = root.join(script);
        let dest = bundle.join(script);
        fs::create_dir_all(dest.parent().expect("a parent"))
            .with_context(|| format!("could not create {}", dest.display()))?;
        fs::copy(&src, &dest).with_context(|| format!("could not copy {}", src.display()))?;
        total += fs::metadata(&dest)?.len();
    }
    total += build_wheel(root, &bundle.join(WHEELS_DIR))?;
    let script = bundle.join("run.sh");
    fs::write(&script, RUN_SH).with_context(|| format!("could not write {}", script.display()))?;
    make_executable(&script)?;
    total += RUN_SH.len() as u64;
    if total > MAX_BUNDLE_BYTES {
        bail!(
            "the bundle is {} MiB, over the 60 MiB the device tool carries beside the working tree",
            total / (1024 * 1024)
        );
    }
    println!(
        "gpu-bundle: {} test binaries, {} scratch-built mutants, {} MiB in {}; run `bash {BUNDLE_DIR}/run.sh`",
        executables.len(),
        scratch_mutants.len(),
        total / (1024 * 1024),
        bundle.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Copies the program `src` into `dir` as `name.gz`, without its line tables and compressed (`run.sh` unpacks it):
/// plain, the test binaries, the benchmarks and the scratch-built mutants' copies of the integration tests would not fit
/// the 60 MiB together. Returns the packed size.
fn pack_program(src: &Path, dir: &Path, name: &str) -> Result<u64> {
    let plain = dir.join(name);
    fs::copy(src, &plain).with_context(|| format!("could not copy {}", src.display()))?;
    strip_debug_info(&plain)?;
    let dest = dir.join(format!("{name}.gz"));
    gzip(&plain, &dest)?;
    fs::remove_file(&plain).with_context(|| format!("could not remove {}", plain.display()))?;
    let size = fs::metadata(&dest)?.len();
    println!("gpu-bundle: {} ({} KiB)", dest.display(), size / 1024);
    Ok(size)
}

/// Writes `src` compressed by `gzip -9` to `dest`.
fn gzip(src: &Path, dest: &Path) -> Result<()> {
    let out = fs::File::create(dest).with_context(|| format!("could not create {}", dest.display()))?;
    let status = Command::new("gzip")
        .args(["-9", "-n", "-c"])
        .arg(src)
        .stdout(out)
        .status()
        .context("could not run gzip (the bundle's mutant binaries travel compressed)")?;
    if !status.success() {
        bail!("gzip -9 {} failed ({status})", src.display());
    }
    Ok(())
}

/// Builds the Python package's wheel into `dir` (pip runs maturin in an isolated build environment, so maturin need
/// not be installed here) and returns its size.
fn build_wheel(root: &Path, dir: &Path) -> Result<u64> {
    let mut pip = Command::new("python3");
    pip.current_dir(root).args(["-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir"]).arg(dir).arg("./python");
    let status = pip.status().context("could not run `python3 -m pip wheel ./python` (the Python package's wheel)")?;
    if !status.success() {
        bail!("`python3 -m pip wheel ./python` failed ({status}): the bundle's Python tests need the wheel");
    }
    let mut total = 0;
    for entry in fs::read_dir(dir).with_context(|| format!("could not list {}", dir.display()))? {
        let path = entry?.path();
        total += fs::metadata(&path)?.len();
        println!("gpu-bundle: {} ({} KiB)", path.display(), fs::metadata(&path)?.len() / 1024);
    }
    Ok(total)
}

/// A scratch-built GPU mutant's killing test binary, staged outside the bundle until the bundle is rewritten.
struct ScratchMutant {
    /// The catalog name, the bundle's subdirectory.
    name: &'static str,
    /// The libtest filter `run.sh` passes (empty for every test).
    filter: &'static str,
    /// The bundle name of the unpatched binary under `tests/`, which must pass the same filter.
    baseline: String,
    /// The stripped copy of the patched build.
    staged: PathBuf,
}

/// Builds the killing test binary of every [`Runner::ScratchGpu`] mutant of the catalog from a patched scratch copy,
/// and stages a stripped copy of each under `target/mutants/gpu-bundle/`. `bundled` are the unpatched test binaries
/// of the bundle, one of which each mutant's baseline must be. With no such mutant nothing is copied or built.
fn build_scratch_mutants(root: &Path, bundled: &[(String, PathBuf)]) -> Result<Vec<ScratchMutant>> {
    let mutants: Vec<&'static Mutant> =
        attnproof_catalog::all().filter(|m| matches!(m.runner, Runner::ScratchGpu { .. })).collect();
    if mutants.is_empty() {
        return Ok(vec![]);
    }
    let tree = ScratchTree::create(root)?;
    let staging = root.join("target").join("mutants").join("gpu-bundle");
    recreate_dir(&staging)?;
    let mut built = vec![];
    for m in mutants {
        let Runner::ScratchGpu { package, target, filter } = m.runner else { unreachable!("filtered above") };
        let baseline = format!("{package}-{target}");
        if !bundled.iter().any(|(name, _)| *name == baseline) {
            bail!("mutant `{}`: its test binary {baseline} is not among the bundle's test binaries", m.name);
        }
        println!("gpu-bundle: mutant {} ({})", m.name, m.runner.location());
        let executables = tree
            .with_mutant(m, || build_test_binaries(&tree.dir, package, Some((target, &tree.target_dir))))?
            .map_err(|stale| anyhow::anyhow!("mutant `{}` is stale in {}: {stale}", m.name, m.file))??;
        let (_, executable) = executables
            .into_iter()
            .find(|(name, _)| *name == baseline)
            .with_context(|| format!("cargo reported no executable {baseline} for mutant `{}`", m.name))?;
        // The next mutant's build overwrites the same executable, so each is copied out at once.
        let staged = staging.join(m.name);
        fs::copy(&executable, &staged).with_context(|| format!("could not copy {}", executable.display()))?;
        strip_debug_info(&staged)?;
        built.push(ScratchMutant { name: m.name, filter: filter.unwrap_or(""), baseline, staged });
    }
    Ok(built)
}

/// Builds `package`'s test targets in release (only `target`, into its target directory, when given) in the tree at
/// `root` and returns (bundle name, executable path) for each.
fn build_test_binaries(root: &Path, package: &str, only: Option<(&str, &Path)>) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = cargo(root);
    cmd.args(["test", "--release", "-p", package, "--no-run", "--message-format=json"]);
    if let Some((target, target_dir)) = only {
        cmd.args(["--test", target]).env("CARGO_TARGET_DIR", target_dir);
    }
    println!("$ {}", describe(&cmd));
    let out = cmd.stderr(Stdio::inherit()).output().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
    if !out.status.success() {
        bail!("`{}` failed", describe(&cmd));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    Ok(stdout.lines().filter_map(|line| test_executable(line, package)).collect())
}

/// Builds `package`'s binary `bin` in release and returns (name, executable path).
fn build_bin(root: &Path, package: &str, bin: &str) -> Result<(String, PathBuf)> {
    let mut cmd = cargo(root);
    cmd.args(["build", "--release", "-p", package, "--bin", bin, "--message-format=json"]);
    println!("$ {}", describe(&cmd));
    let out = cmd.stderr(Stdio::inherit()).output().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
    if !out.status.success() {
        bail!("`{}` failed", describe(&cmd));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .filter(|line| line.contains(r#""reason":"compiler-artifact""#) && line.contains(r#""kind":["bin"]"#))
        .find_map(|line| json_string(line, "executable").map(|e| (bin.to_owned(), PathBuf::from(e))))
        .with_context(|| format!("cargo reported no executable for {package} --bin {bin}"))
}

/// From one JSON message of cargo: a test executable of `package`, named `<package>-<target>` for the bundle.
fn test_executable(line: &str, package: &str) -> Option<(String, PathBuf)> {
    // A binary's test harness (`"kind":["bin"]` built as a test) holds no tests of ours: the binary itself is bundled.
    if !line.contains(r#""reason":"compiler-artifact""#)
        || !line.contains(r#""test":true"#)
        || line.contains(r#""kind":["bin"]"#)
    {
        return None;
    }
    let executable = json_string(line, "executable")?;
    let target = json_string(line, "name")?;
    // The package id names the package (`path+file:///…/gpu#attnproof-gpu@0.1.0`); the target name alone is ambiguous.
    let id = json_string(line, "package_id")?;
    if !id.contains(&format!("#{package}@")) && !id.contains(&format!("/{package}#")) {
        return None;
    }
    Some((format!("{package}-{target}"), PathBuf::from(executable)))
}

/// The first string value of `"key":"…"` in a JSON line (cargo escapes nothing in paths and names we use).
fn json_string(line: &str, key: &str) -> Option<String> {
    let pattern = format!(r#""{key}":""#);
    let start = line.find(&pattern)? + pattern.len();
    let end = line[start..].find('"')? + start;
    Some(line[start..end].replace(r"\\", r"\"))
}

/// Drops the release profile's line tables from a copy (they are most of a test binary's size and the bundle has a
/// 64 MiB budget); panics on the device still name the test and message. Without `strip` the copy stays as is.
fn strip_debug_info(path: &Path) -> Result<()> {
    let Some(strip) = find_on_path("strip") else {
        println!("gpu-bundle: no `strip` on PATH; {} keeps its debug info", path.display());
        return Ok(());
    };
    let status = std::process::Command::new(strip)
        .arg("--strip-debug")
        .arg(path)
        .status()
        .with_context(|| format!("could not run strip on {}", path.display()))?;
    if !status.success() {
        bail!("strip --strip-debug {} failed", path.display());
    }
    Ok(())
}

#[cfg(unix)]
fn make_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).with_context(|| format!("chmod {}", path.display()))
}

#[cfg(not(unix))]
fn make_executable(_path: &Path) -> Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_test_executables_of_the_package() {
        let line = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/main/gpu#attnproof-gpu@0.1.0","target":{"kind":["test"],"name":"it"},"profile":{"opt_level":"3","test":true},"executable":"/w/main/target/release/deps/it-0123abcd"}"#;
        assert_eq!(
            test_executable(line, "attnproof-gpu"),
            Some(("attnproof-gpu-it".into(), PathBuf::from("/w/main/target/release/deps/it-0123abcd")))
        );
        assert_eq!(test_executable(line, "attnproof-harness"), None);
        let lib = line.replace(r#""test":true"#, r#""test":false"#);
        assert_eq!(test_executable(&lib, "attnproof-gpu"), None);
    }

    /// The script is a real file so that shellcheck can read it: any finding fails. Without shellcheck the test says
    /// so and passes, except under `CI=true`, where a missing shellcheck is a failure (`.ci/run` installs it).
    #[test]
    fn run_script_passes_shellcheck() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(RUN_SH_PATH);
        assert_eq!(fs::read_to_string(&script).unwrap(), RUN_SH, "{} is the embedded script", script.display());
        let Some(shellcheck) = find_on_path("shellcheck") else {
            assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "CI=true but shellcheck is not on PATH");
            println!("skipped: no shellcheck");
            return;
        };
        let out = std::process::Command::new(shellcheck).arg(&script).output().expect("run shellcheck");
        assert!(
            out.status.success(),
            "shellcheck {} found:\n{}{}",
            script.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `run.sh all` on a stand-in bundle, no GPU needed: one packed "test binary" whose module `alpha` passes, whose
    /// module `beta` and both mutant hunts hang in a child process. With `ALL_SECONDS` the call ends on time, the
    /// binary was unpacked, the hunts ran as units of their own (by exact name), the hung units are reported as cut
    /// with their last lines and counted as failed, the finished one is not, and no process of theirs is left.
    #[test]
    fn run_all_cuts_the_units_past_all_seconds_and_stops_their_processes() {
        for tool in ["bash", "gzip", "pgrep"] {
            if find_on_path(tool).is_none() {
                assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "CI=true but {tool} is not on PATH");
                println!("skipped: no {tool}");
                return;
            }
        }
        let dir = std::env::temp_dir().join(format!("xtask-run-all-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let tests = dir.join("bundle").join(TESTS_DIR);
        fs::create_dir_all(&tests).unwrap();
        fs::write(dir.join("bundle").join("run.sh"), RUN_SH).unwrap();
        let pids = dir.join("pids");
        let fake = tests.join("fake-it");
        fs::write(
            &fake,
            format!(
                "#!/usr/bin/env bash\n\
                 hunts='mutants::h1: test\\nmutants::h2: test\\n'\n\
                 if [ \"${{1:-}}\" = --list ]; then printf \"alpha::x: test\\nbeta::y: test\\n$hunts\"; exit 0; fi\n\
                 echo \"started $*\"\n\
                 case \"$*\" in *alpha*) echo 'test result: ok. 1 passed'; exit 0;; esac\n\
                 sleep 600 & echo $! >>{pids}; echo $$ >>{pids}; wait\n",
                pids = pids.display()
            ),
        )
        .unwrap();
        make_executable(&fake).unwrap();
        gzip(&fake, &tests.join("fake-it.gz")).unwrap();
        fs::remove_file(&fake).unwrap();
        let started = std::time::Instant::now();
        let out = Command::new("bash")
            .arg(dir.join("bundle").join("run.sh"))
            .arg("all")
            .env("ALL_SECONDS", "3")
            .env("ALL_BENCH", "0")
            .env("ATTNPROOF_LOGS", dir.join("logs"))
            .env("TMPDIR", &dir)
            .env_remove("OUT")
            .output()
            .expect("run bash run.sh all");
        let summary = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "cut units fail the call:\n{summary}");
        assert!(started.elapsed().as_secs() < 60, "run.sh all outlived ALL_SECONDS by far:\n{summary}");
        assert!(tests.join("fake-it").exists() && !tests.join("fake-it.gz").exists(), "the binary was not unpacked");
        assert!(summary.contains("test-fake-it-alpha: exit 0 (ok. 1 passed)"), "{summary}");
        for (unit, started_with) in [
            ("test-fake-it-beta", "started beta:: --nocapture"),
            ("test-fake-it-mutants-0", "started --exact mutants::h1 --nocapture"),
            ("test-fake-it-mutants-1", "started --exact mutants::h2 --nocapture"),
        ] {
            assert!(summary.contains(&format!("{unit}: CUT by ALL_SECONDS=3")), "{unit} not cut:\n{summary}");
            assert!(summary.contains(started_with), "{unit}'s last lines are missing:\n{summary}");
        }
        let written = fs::read_to_string(&pids).expect("the hung units wrote their process ids");
        let pids: Vec<&str> = written.split_whitespace().collect();
        assert_eq!(pids.len(), 6, "three hung units, each a binary and its child: {pids:?}");
        // A stopped process may linger as a zombie until its new parent reaps it; it must not still run.
        std::thread::sleep(std::time::Duration::from_millis(300));
        for pid in pids {
            let state = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let running = state.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'));
            assert!(!running, "process {pid} of a cut unit still runs: {state}");
        }
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn run_script_requires_a_gpu_and_runs_every_binary() {
        assert!(RUN_SH.contains("export ATTNPROOF_REQUIRE_GPU=1"));
        assert!(RUN_SH.contains("export CUDA_HOME=/usr/local/cuda"));
        assert!(RUN_SH.contains(r#"for bin in "$here"/tests/*"#));
        // The packed programs (`pack_program`) are unpacked before any mode runs.
        let unpack = format!(r#"for packed in "$here"/{TESTS_DIR}/*.gz "$here"/{BINS_DIR}/*.gz; do"#);
        assert!(RUN_SH.contains(&unpack), "run.sh does not unpack the programs");
        for mode in [
            "all)",
            "fuzz)",
            "tests)",
            "mutants)",
            "sanitize)",
            "bench)",
            "bsa-bench)",
            "recall)",
            "ring)",
            "peers)",
            "python)",
        ] {
            assert!(RUN_SH.contains(mode), "run.sh lacks mode {mode}");
        }
        assert!(RUN_SH.contains("--tool \"$tool\" --error-exitcode 99"));
        // The scratch-built mutants: the files `gpu_bundle` writes are the ones the script reads.
        let each_mutant = format!("for dir in \"$here\"/{MUTANTS_DIR}/*/; do");
        for file in ["\"$dir/test.gz\"", "\"$dir/filter\"", "\"$dir/baseline\"", each_mutant.as_str()] {
            assert!(RUN_SH.contains(file), "run.sh does not read {file}");
        }
        // `all` runs the tests and the sanitizer, then the benchmark with the backward, and fails on a skip.
        for step in [
            "bash \"$here/run.sh\" sanitize",
            "bash \"$here/run.sh\" bench --backward",
            "skipped: no CUDA device",
            "scratch_mutants >",
        ] {
            assert!(RUN_SH.contains(step), "run.sh all lacks {step}");
        }
    }
}
