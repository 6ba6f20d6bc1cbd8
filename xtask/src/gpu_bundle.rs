//! `cargo xtask gpu-bundle`: builds the GPU test binaries and the benchmark binaries in release and copies them, with
//! `bench/peers.py` and a `run.sh` entry script, into `gpu-bundle/` (ignored by git), so that one call on a GPU machine
//! without Rust runs the whole GPU verification: `bash gpu-bundle/run.sh [tests|mutants|sanitize|bench|peers]`. The
//! case checker (`check`) and the PyTorch case dumper (`python/`) ride along for the verdict on PyTorch's kernels.
//!
//! The executables are found from cargo's own JSON messages (`--message-format=json`), not by guessing file names in
//! `target/`. The bundle must stay under the device tool's 64 MiB transfer limit, so its size is checked at the end.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};

use anyhow::{Context, Result, bail};

use crate::process::{cargo, describe, ensure_m4, find_on_path};

/// Packages whose test binaries go into the bundle.
const PACKAGES: &[&str] = &["attnproof-gpu"];
/// (package, binary) of the programs that go into the bundle's `bin/`: the benchmarks and the case checker.
const BENCHES: &[(&str, &str)] =
    &[("attnproof-gpu", "bench"), ("attnproof-harness", "ring_bench"), ("attnproof-harness", "check")];
/// Scripts copied into the bundle's root, relative to the repository root.
const SCRIPTS: &[&str] = &["bench/peers.py"];
/// Scripts copied into the bundle at their own relative paths (they import each other by relative path).
const TREE_SCRIPTS: &[&str] =
    &["python/attnproof_dump.py", "python/examples/dump_peers.py", "python/examples/peers_table.py"];
/// The bundle directory, relative to the repository root.
pub const BUNDLE_DIR: &str = "gpu-bundle";
/// Largest bundle the device tool carries.
const MAX_BUNDLE_BYTES: u64 = 64 * 1024 * 1024;

/// The entry script: requires a GPU, points NVRTC at the toolkit, and runs one mode.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Entry script of the GPU bundle (made by `cargo xtask gpu-bundle`). Modes:
#   run.sh all [ARGS]       the whole GPU verification in one go: every test binary (the GPU mutants among them) and
#                           the sanitizer runs side by side, then, alone on the GPU, the benchmark with the backward
#                           and the SDPA peers (ARGS go to bin/bench; PEERS_ARGS=--backward adds FlexAttention). Logs in $ATTNPROOF_LOGS (default: $OUT if set, else
#                           a fresh directory), packed into all-logs.tgz; a summary last. Non-zero if anything failed.
#   run.sh fuzz [MINUTES] [PROCESSES]
#                           the GPU property tests of the forward and backward kernels with fresh seeds, PROCESSES
#                           (default 3) of each side by side, batch after batch until MINUTES (default 5) have passed;
#                           cases per process from $PROPTEST_CASES (default 48 forward, 16 backward). A failing case's
#                           regression file and log land in $ATTNPROOF_LOGS (default $OUT, else a fresh directory).
#   run.sh [tests] [ARGS]   every test binary (ARGS go to each: filters, --test-threads, ...); the default
#   run.sh mutants          the GPU mutants (patched kernel texts) and the table mutant -> killed by
#   run.sh sanitize         compute-sanitizer memcheck and racecheck over the small-shape tests in SANITIZE below
#   run.sh bench [ARGS]     bin/bench (ARGS: --all-tilings, --reps N, ...), then peers.py (PyTorch SDPA flash and
#                           cuDNN, FlexAttention) in the same call; extra peers.py arguments in $PEERS_ARGS
#   run.sh ring [ARGS]      bin/ring_bench (ring attention: time per step, overlap, efficiency against the dense
#                           kernel; ARGS: --backward, --nccl for one GPU per ring device, --devices 2,4,8, ...)
#   run.sh peers            dumps PyTorch's kernels' case files (python/examples/dump_peers.py), checks them with
#                           bin/check (check.txt, check.json, peers.md under $OUT) and packs the cases in
#                           cases.tgz.* parts of at most 15 MiB under $OUT for checking elsewhere
# Every mode exits non-zero on any failure.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
export ATTNPROOF_REQUIRE_GPU=1
export CUDA_HOME=/usr/local/cuda
# NVRTC (libnvrtc.so.13) is loaded at run time; the toolkit's lib64 is not always on the loader path.
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}"
export PATH="$CUDA_HOME/bin:$PATH"
# NVLink multicast stays off (on a shared host it can put the GPUs out of service), and NCCL comes from pip's
# nvidia-nccl wheel when the host has no system copy: cudarc looks for libnccl.so, the wheel ships libnccl.so.2.
export NCCL_NVLS_ENABLE=0
# The wheel's layout differs between CUDA majors (nvidia/nccl/lib, nvidia/cu13/lib): search the nvidia namespace.
nccl_so="$(python3 -c 'import glob, os, nvidia; print(next(iter(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "**", "libnccl.so*"), recursive=True))), ""))' 2>/dev/null)"
if [ -n "$nccl_so" ]; then
    mkdir -p /tmp/attnproof-nccl && ln -sf "$nccl_so" /tmp/attnproof-nccl/libnccl.so
    export LD_LIBRARY_PATH="/tmp/attnproof-nccl:$LD_LIBRARY_PATH"
fi
cd "$here"
# Small-shape tests that every kernel's sanitizer run covers: "test-binary filter...". A new kernel adds its line.
# The backward line is one test (all three strategies, both dtypes, fully masked and partial rows): under the
# sanitizer each backward test takes minutes, and a wider filter did not finish in a 7-minute device call.
SANITIZE=(
    "attnproof-gpu-flash_forward lengths_one_and_tile_edges fully_masked_rows lq_ne_lk_both_ways gqa_and_mqa varlen_with_empty_sequences"
    "attnproof-gpu-flash_backward fully_masked"
    "attnproof-gpu-ring_state one_chunk"
)
mode=tests
case "${1:-}" in
    all | fuzz | tests | mutants | sanitize | bench | ring | peers) mode="$1"; shift ;;
esac
case "$mode" in
all)
    logs="${ATTNPROOF_LOGS:-${OUT:-$(mktemp -d)}}"
    work="$(mktemp -d)"
    start=$(date +%s)
    # Phase 1: the test binaries and the sanitizer at once. Their kernels are small and none is timed; most of their
    # time is the f64 oracle on the CPU, so running them side by side takes the time of the longest.
    for bin in "$here"/tests/*; do
        name="$(basename "$bin")"
        ("$bin" --show-output >"$work/test-$name.log" 2>&1; echo $? >"$work/test-$name.rc") &
    done
    (bash "$here/run.sh" sanitize >"$work/sanitize.log" 2>&1; echo $? >"$work/sanitize.rc") &
    wait
    phase1=$(($(date +%s) - start))
    # Phase 2, alone on the GPU: ours, then PyTorch's SDPA kernels in the same call. FlexAttention is left out by
    # default (torch.compile takes minutes per shape, more than the rest together): PEERS_ARGS=--backward adds it.
    PEERS_ARGS="${PEERS_ARGS:---backward --no-flex}" bash "$here/run.sh" bench --backward "$@" >"$work/bench.log" 2>&1
    echo $? >"$work/bench.rc"
    failed=0
    {
        echo "gpu-bundle all: tests and sanitizer ${phase1} s, everything $(($(date +%s) - start)) s"
        for rc in "$work"/*.rc; do
            name="$(basename "$rc" .rc)"
            status="$(cat "$rc")"
            [ "$status" = "0" ] || failed=$((failed + 1))
            counts="$(grep -h "^test result" "$work/$name.log" 2>/dev/null | sed 's/^test result: //; s/; finished.*//' | paste -sd' ' -)"
            echo "$name: exit $status${counts:+ ($counts)}"
        done
        grep -h "^gpu mutants of\|^gpu-bundle sanitize" "$work"/*.log
        grep -h "skipped: no CUDA device" "$work"/test-*.log && failed=$((failed + 1))
        echo
        sed -n '/^shape /,$p' "$work/bench.log"
        echo
        echo "gpu-bundle all: $failed parts failed"
    } >"$work/summary.txt"
    cat "$work/summary.txt"
    mkdir -p "$logs"
    cp "$work/summary.txt" "$logs/summary.txt"
    (cd "$work" && tar czf "$logs/all-logs.tgz" ./*.log ./*.rc summary.txt)
    echo "gpu-bundle all: logs in $logs (all-logs.tgz)"
    exit $((failed > 0))
    ;;
fuzz)
    minutes="${1:-5}"
    processes="${2:-3}"
    logs="${ATTNPROOF_LOGS:-${OUT:-$(mktemp -d)}}"
    mkdir -p "$logs"
    deadline=$(($(date +%s) + 60 * minutes))
    batch=0
    failed=0
    total=0
    while [ "$(date +%s)" -lt "$deadline" ] && [ "$failed" -eq 0 ]; do
        batch=$((batch + 1))
        work="$(mktemp -d)"
        for i in $(seq "$processes"); do
            for side in forward backward; do
                cases="${PROPTEST_CASES:-$([ "$side" = forward ] && echo 48 || echo 16)}"
                # Each process in its own directory: proptest writes a failure's regression file relative to it.
                dir="$work/$side-$i"
                mkdir -p "$dir"
                (cd "$dir" && PROPTEST_CASES="$cases" "$here/tests/attnproof-gpu-flash_$side" \
                    "kernel_${side}_is_within_bound" --show-output >log 2>&1; echo $? >rc) &
            done
        done
        wait
        for dir in "$work"/*; do
            total=$((total + 1))
            if [ "$(cat "$dir/rc")" != "0" ]; then
                failed=$((failed + 1))
                name="fuzz-batch$batch-$(basename "$dir")"
                cp "$dir/log" "$logs/$name.log"
                for f in "$dir"/proptest-regressions/*.txt; do [ -f "$f" ] && cp "$f" "$logs/$name-$(basename "$f")"; done
                echo "gpu-bundle fuzz: $(basename "$dir") of batch $batch failed; log and regression file in $logs"
            fi
        done
        grep -h "worst error/bound" "$work"/*/log | sed "s/^/batch $batch: /"
        rm -rf "$work"
    done
    echo "gpu-bundle fuzz: $batch batches, $total processes, $failed failed"
    echo "(commit a regression file under tests/proptest-regressions/ of this repository and add a named test for it)"
    exit $((failed > 0))
    ;;
tests)
    failed=0
    for bin in "$here"/tests/*; do
        echo "=== $(basename "$bin")"
        "$bin" --show-output "$@" || failed=$((failed + 1))
    done
    echo "gpu-bundle: $failed test binaries failed"
    exit $((failed > 0))
    ;;
mutants)
    # Both catalogs: all_forward_mutants_are_killed and all_backward_mutants_are_killed.
    "$here"/tests/attnproof-gpu-mutants mutants_are_killed --nocapture
    status=$?
    echo "gpu-bundle mutants: exit $status"
    exit $status
    ;;
sanitize)
    failed=0
    for entry in "${SANITIZE[@]}"; do
        read -r -a words <<<"$entry"
        bin="${words[0]}"
        for tool in memcheck racecheck; do
            echo "=== compute-sanitizer --tool $tool $bin ${words[*]:1}"
            log="$(mktemp)"
            compute-sanitizer --tool "$tool" --error-exitcode 99 "$here/tests/$bin" --test-threads=1 "${words[@]:1}" >"$log" 2>&1
            status=$?
            grep -E "^test result|SUMMARY|^=========.*(ERROR|rror|azard)" "$log" | tail -n 20
            if [ "$status" -ne 0 ]; then
                failed=$((failed + 1))
                echo "--- $tool $bin failed (exit $status); last lines:"
                tail -n 40 "$log"
            fi
            rm -f "$log"
        done
    done
    echo "gpu-bundle sanitize: $failed runs failed"
    exit $((failed > 0))
    ;;
bench)
    csv="$(mktemp -d)/ours.csv"
    "$here"/bin/bench --csv "$csv" "$@" || exit 1
    python3 "$here"/peers.py --ours "$csv" ${PEERS_ARGS:-} || exit 1
    if [ -n "${OUT:-}" ]; then cp "$csv" "$OUT/ours.csv"; fi
    ;;
ring)
    csv="$(mktemp -d)/ring.csv"
    "$here"/bin/ring_bench --csv "$csv" "$@" || exit 1
    if [ -n "${OUT:-}" ]; then cp "$csv" "$OUT/ring.csv"; fi
    ;;
peers)
    out="${OUT:-$(mktemp -d)}"
    cases="$(mktemp -d)"
    PYTHONUNBUFFERED=1 python3 "$here"/python/examples/dump_peers.py --out "$cases" "$@" || exit 1
    "$here"/bin/check "$cases"/*.safetensors >"$out/check.txt"
    status=$?
    "$here"/bin/check "$cases"/*.safetensors --json >"$out/check.json"
    python3 "$here"/python/examples/peers_table.py "$out/check.json" >"$out/peers.md"
    (cd "$cases" && tar czf - ./*.safetensors) | split -b 15m - "$out/cases.tgz."
    tail -n 30 "$out/check.txt"
    echo "gpu-bundle peers: check exit $status, results in $out"
    exit $((status > 1))
    ;;
esac
"#;

/// `cargo xtask gpu-bundle`.
pub fn gpu_bundle(root: &Path, rest: &[std::ffi::OsString]) -> Result<ExitCode> {
    if !rest.is_empty() {
        bail!("`gpu-bundle` takes no arguments");
    }
    ensure_m4()?;
    let mut executables = vec![];
    for package in PACKAGES {
        executables.extend(build_test_binaries(root, package)?);
    }
    if executables.is_empty() {
        bail!("cargo reported no test executables for {PACKAGES:?}");
    }
    let mut benches = vec![];
    for (package, bin) in BENCHES {
        benches.push(build_bin(root, package, bin)?);
    }
    let bundle = root.join(BUNDLE_DIR);
    if bundle.exists() {
        fs::remove_dir_all(&bundle).with_context(|| format!("could not clear {}", bundle.display()))?;
    }
    let tests = bundle.join("tests");
    fs::create_dir_all(&tests).with_context(|| format!("could not create {}", tests.display()))?;
    let mut total = 0u64;
    for (name, path) in &executables {
        let dest = tests.join(name);
        fs::copy(path, &dest).with_context(|| format!("could not copy {}", path.display()))?;
        strip_debug_info(&dest)?;
        total += fs::metadata(&dest)?.len();
        println!("gpu-bundle: {} ({} KiB)", dest.display(), fs::metadata(&dest)?.len() / 1024);
    }
    let bins = bundle.join("bin");
    fs::create_dir_all(&bins).with_context(|| format!("could not create {}", bins.display()))?;
    for (name, path) in &benches {
        let dest = bins.join(name);
        fs::copy(path, &dest).with_context(|| format!("could not copy {}", path.display()))?;
        strip_debug_info(&dest)?;
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
    let script = bundle.join("run.sh");
    fs::write(&script, RUN_SH).with_context(|| format!("could not write {}", script.display()))?;
    make_executable(&script)?;
    total += RUN_SH.len() as u64;
    if total > MAX_BUNDLE_BYTES {
        bail!("the bundle is {} MiB, over the 64 MiB the device tool carries", total / (1024 * 1024));
    }
    println!(
        "gpu-bundle: {} test binaries, {} MiB in {}; run `bash {BUNDLE_DIR}/run.sh`",
        executables.len(),
        total / (1024 * 1024),
        bundle.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Builds `package`'s test targets in release and returns (bundle name, executable path) for each.
fn build_test_binaries(root: &Path, package: &str) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = cargo(root);
    cmd.args(["test", "--release", "-p", package, "--no-run", "--message-format=json"]);
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
        let line = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/main/gpu#attnproof-gpu@0.1.0","target":{"kind":["test"],"name":"flash_forward"},"profile":{"opt_level":"3","test":true},"executable":"/w/main/target/release/deps/flash_forward-0123abcd"}"#;
        assert_eq!(
            test_executable(line, "attnproof-gpu"),
            Some((
                "attnproof-gpu-flash_forward".into(),
                PathBuf::from("/w/main/target/release/deps/flash_forward-0123abcd")
            ))
        );
        assert_eq!(test_executable(line, "attnproof-harness"), None);
        let lib = line.replace(r#""test":true"#, r#""test":false"#);
        assert_eq!(test_executable(&lib, "attnproof-gpu"), None);
    }

    #[test]
    fn run_script_requires_a_gpu_and_runs_every_binary() {
        assert!(RUN_SH.contains("export ATTNPROOF_REQUIRE_GPU=1"));
        assert!(RUN_SH.contains("export CUDA_HOME=/usr/local/cuda"));
        assert!(RUN_SH.contains(r#"for bin in "$here"/tests/*"#));
        for mode in ["all)", "fuzz)", "tests)", "mutants)", "sanitize)", "bench)", "ring)", "peers)"] {
            assert!(RUN_SH.contains(mode), "run.sh lacks mode {mode}");
        }
        assert!(RUN_SH.contains("--tool \"$tool\" --error-exitcode 99"));
        // `all` runs the tests and the sanitizer, then the benchmark with the backward, and fails on a skip.
        for step in
            ["bash \"$here/run.sh\" sanitize", "bash \"$here/run.sh\" bench --backward", "skipped: no CUDA device"]
        {
            assert!(RUN_SH.contains(step), "run.sh all lacks {step}");
        }
    }
}
