//! The one mutation catalog: every curated mutant, CPU and GPU, with the runner that applies it.
//!
//! A mutant is a literal find/replace in one file of the repository, never a hook in production code. The `find`
//! text must occur exactly once in its file when a runner applies it; otherwise the mutant is stale, so that an edit
//! of the mutated code can never make a mutant stop applying without anyone noticing (the unit tests of this crate
//! check every entry against the current sources).
//!
//! Every mutant names a [`Runner`], the mechanism that applies it and the tests that must kill it:
//! - [`Runner::Scratch`]: `cargo xtask mutants` patches a scratch copy of the tree under `target/mutants/` and runs
//!   `cargo test` there (CPU code: the reference schedules, the bound model, kernel texts that must not compile);
//! - [`Runner::KernelText`]: the GPU crate's `tests/mutants.rs` patches the kernel text the crate embeds and launches
//!   it on a device in-process (run by the GPU bundle's `run.sh all`, or by the GPU tests on a GPU machine);
//! - [`Runner::ScratchGpu`]: `cargo xtask gpu-bundle` builds the killing test binary in release from a patched
//!   scratch copy, and the bundle's `run.sh` runs it on the GPU host, expecting it to fail.
//!
//! The entries are split by area into modules ([`cpu`], [`kernels`], [`ring`]); [`all`] concatenates them in that
//! order, the order in which the runners apply them. This crate has no dependencies, so that `xtask` stays light and
//! the GPU crate can read the kernel-text mutants as a dev-dependency.

pub mod cpu;
pub mod kernels;
pub mod ring;

use std::fmt;

/// The helpers prepended to every attention kernel's text (`gpu/src/compile.rs`): a kernel-text mutant of this file
/// names the kernel whose launch must kill it.
pub const COMMON_HEADER: &str = "gpu/kernels/common.cuh";

/// The Hopper helpers placed after `common.cuh` in the text of every `wgmma` kernel (`*_sm90`): a kernel-text mutant of
/// this file names the `_sm90` kernel whose launch must kill it.
pub const SM90_HEADER: &str = "gpu/kernels/sm90.cuh";

/// One mutant: a single textual change to one file, and the runner that applies it and must see it killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mutant {
    /// Kebab-case name, unique in the catalog; `cargo xtask mutants --only NAME` selects it.
    pub name: &'static str,
    /// The bug it models, in words, for the `--list` output.
    pub description: &'static str,
    /// The mutated file, relative to the repository root.
    pub file: &'static str,
    /// The exact text to replace; must occur exactly once in `file`.
    pub find: &'static str,
    /// Its replacement.
    pub replace: &'static str,
    /// How the mutant is applied and which tests must kill it.
    pub runner: Runner,
}

/// How a mutant is applied, and where the tests that must kill it run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runner {
    /// CPU: `cargo xtask mutants` patches a scratch copy of the tree (`target/mutants/src`) and runs
    /// `cargo test -p <package> [--test <target>] [-- <filter>]` there, which must fail.
    Scratch {
        /// The package whose tests must kill the mutant.
        package: &'static str,
        /// One integration test target, or `None` for every target of the package.
        target: Option<&'static str>,
        /// A libtest name filter, or `None` for every test.
        filter: Option<&'static str>,
    },
    /// GPU, in-process: `gpu/tests/it/mutants.rs` patches the text of the kernel `kernel` (the name of its
    /// `attnproof_gpu::compile::KernelSource`, e.g. `flash_fwd`, whose file is the mutant's `file`) and launches it on
    /// a device in the mode `mode`; some killing case of that mode must fail its oracle verdict.
    KernelText {
        /// The kernel source's name, as `KernelSource::name` spells it.
        kernel: &'static str,
        /// The define of the kernel's mode whose killing cases must kill the mutant (`BLOCK_SPARSE` for the
        /// block-sparse modes of `flash_fwd` and `flash_bwd`), or `None` for the kernel's plain mode. Each mode has its
        /// own killing cases.
        mode: Option<&'static str>,
    },
    /// GPU, scratch build: `cargo xtask gpu-bundle` builds `cargo test --release -p <package> --test <target>` from a
    /// patched scratch copy into `gpu-bundle/mutants/<name>/`, and the bundle's `run.sh` runs that binary (with the
    /// filter) on the GPU host, counting the mutant killed when it fails.
    ScratchGpu {
        /// The package of the killing test binary.
        package: &'static str,
        /// The integration test target built into the bundle.
        target: &'static str,
        /// A libtest name filter passed to the binary, or `None` for every test.
        filter: Option<&'static str>,
    },
}

impl Runner {
    /// Where the mutant runs, in words, for `cargo xtask mutants --list` and for errors.
    pub fn location(&self) -> String {
        match *self {
            Runner::Scratch { package, target, filter } => {
                format!("cpu: scratch, cargo {}", cargo_test_args(package, target, filter).join(" "))
            }
            Runner::KernelText { kernel, mode: None } => {
                format!("gpu: kernel text of {kernel} (run.sh all / gpu tests)")
            }
            Runner::KernelText { kernel, mode: Some(mode) } => {
                format!("gpu: kernel text of {kernel}, {mode} mode (run.sh all / gpu tests)")
            }
            Runner::ScratchGpu { package, target, filter } => {
                let filter = filter.map(|f| format!(" -- {f}")).unwrap_or_default();
                format!("gpu: scratch build (gpu-bundle), {package} --test {target}{filter}")
            }
        }
    }

    /// Whether `cargo xtask mutants` runs the mutant on this machine (only [`Runner::Scratch`] ones).
    pub fn runs_on_cpu(&self) -> bool {
        matches!(self, Runner::Scratch { .. })
    }
}

/// The arguments of `cargo test` for one package, optionally one target and one filter.
///
/// `--no-fail-fast` lets every test binary run, so a report names every test that kills a mutant rather than only
/// the first binary to fail.
pub fn cargo_test_args(package: &str, target: Option<&str>, filter: Option<&str>) -> Vec<String> {
    let mut args = vec!["test".to_owned(), "-p".to_owned(), package.to_owned(), "--no-fail-fast".to_owned()];
    if let Some(target) = target {
        args.extend(["--test".to_owned(), target.to_owned()]);
    }
    if let Some(filter) = filter {
        args.extend(["--".to_owned(), filter.to_owned()]);
    }
    args
}

/// Why a mutant cannot be applied to the current source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stale {
    /// The `find` text does not occur in the file.
    NotFound,
    /// The `find` text occurs more than once, so the change would be ambiguous.
    Ambiguous(usize),
}

impl fmt::Display for Stale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stale::NotFound => write!(f, "find text not found"),
            Stale::Ambiguous(n) => write!(f, "find text occurs {n} times"),
        }
    }
}

impl std::error::Error for Stale {}

impl Mutant {
    /// The mutated source, or why the mutant no longer applies to `source`.
    pub fn apply(&self, source: &str) -> Result<String, Stale> {
        match source.matches(self.find).count() {
            0 => Err(Stale::NotFound),
            1 => Ok(source.replacen(self.find, self.replace, 1)),
            n => Err(Stale::Ambiguous(n)),
        }
    }

    /// The arguments of the `cargo test` command that must fail once a [`Runner::Scratch`] mutant is applied; `None`
    /// for the GPU runners, whose tests do not run through cargo on this machine.
    pub fn cargo_test_args(&self) -> Option<Vec<String>> {
        match self.runner {
            Runner::Scratch { package, target, filter } => Some(cargo_test_args(package, target, filter)),
            Runner::KernelText { .. } | Runner::ScratchGpu { .. } => None,
        }
    }
}

/// Every area's list, in the order [`all`] concatenates them.
pub const AREAS: &[&[Mutant]] = &[cpu::MUTANTS, kernels::MUTANTS, ring::MUTANTS];

/// Every mutant of the catalog: the CPU entries, then the kernel texts, then the ring's GPU code.
pub fn all() -> impl Iterator<Item = &'static Mutant> {
    AREAS.iter().flat_map(|area| area.iter())
}

/// The catalog entry named `name`.
pub fn find(name: &str) -> Option<&'static Mutant> {
    all().find(|m| m.name == name)
}

/// The kernel-text mutants of the kernel named `kernel` in the mode `mode` (see [`Runner::KernelText`]).
pub fn kernel_text_mutants<'a>(kernel: &'a str, mode: Option<&'a str>) -> impl Iterator<Item = &'static Mutant> + 'a {
    all().filter(move |m| matches!(m.runner, Runner::KernelText { kernel: k, mode: md } if k == kernel && md == mode))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::path::{Path, PathBuf};

    use super::*;

    /// The repository root: two levels above this crate's manifest (`xtask/catalog/`).
    fn repo_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    #[test]
    fn names_are_unique_kebab_case_and_catalog_is_large_enough() {
        let mut seen = HashSet::new();
        for m in all() {
            assert!(seen.insert(m.name), "duplicate mutant name `{}`", m.name);
            assert!(
                !m.name.is_empty() && m.name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "mutant name `{}` is not kebab-case",
                m.name
            );
            assert!(!m.description.is_empty(), "mutant `{}` has no description", m.name);
        }
        let cpu = all().filter(|m| m.runner.runs_on_cpu()).count();
        assert!(cpu >= 20, "the catalog must hold at least 20 CPU mutants, has {cpu}");
        let kernel_text = all().filter(|m| matches!(m.runner, Runner::KernelText { .. })).count();
        assert!(kernel_text >= 10, "the catalog must hold at least 10 kernel-text mutants, has {kernel_text}");
    }

    #[test]
    fn every_entry_changes_something() {
        for m in all() {
            assert!(!m.find.is_empty(), "mutant `{}` has an empty find text", m.name);
            assert_ne!(m.find, m.replace, "mutant `{}` replaces its text with itself", m.name);
            match m.runner {
                Runner::Scratch { package, .. } => assert!(!package.is_empty(), "mutant `{}`: no package", m.name),
                Runner::ScratchGpu { package, target, .. } => {
                    assert!(!package.is_empty() && !target.is_empty(), "mutant `{}`: no test binary", m.name);
                }
                // `common.cuh` is prepended to every attention kernel's text (and `sm90.cuh` to every wgmma kernel's),
                // so their mutants name the kernel whose launch must kill them.
                Runner::KernelText { kernel, .. } => assert!(
                    Path::new(m.file).file_stem().is_some_and(|stem| stem == kernel)
                        || m.file == COMMON_HEADER
                        || (m.file == SM90_HEADER && kernel.ends_with("_sm90")),
                    "kernel-text mutant `{}` names kernel `{kernel}` but mutates {}",
                    m.name,
                    m.file
                ),
            }
        }
    }

    /// Keeps the catalog in step with the code: the tests fail as soon as an edit makes a mutant stale, not only when
    /// someone next runs the mutants.
    #[test]
    fn every_entry_applies_to_the_current_sources() {
        let root = repo_root();
        for m in all() {
            let path = root.join(m.file);
            let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if let Err(stale) = m.apply(&source) {
                panic!("mutant `{}` is stale in {}: {stale}", m.name, m.file);
            }
        }
    }

    #[test]
    fn apply_replaces_exactly_one_occurrence() {
        let m = Mutant { find: "b", replace: "X", ..cpu::MUTANTS[0] };
        assert_eq!(m.apply("abc"), Ok("aXc".to_owned()));
        assert_eq!(m.apply("acd"), Err(Stale::NotFound));
        assert_eq!(m.apply("abcb"), Err(Stale::Ambiguous(2)));
    }

    #[test]
    fn cargo_test_args_follow_the_runner() {
        let base = cpu::MUTANTS[0];
        let all_tests =
            Mutant { runner: Runner::Scratch { package: "attnproof-harness", target: None, filter: None }, ..base };
        assert_eq!(all_tests.cargo_test_args().unwrap(), ["test", "-p", "attnproof-harness", "--no-fail-fast"]);
        let one = Mutant {
            runner: Runner::Scratch {
                package: "attnproof-harness",
                target: Some("it"),
                filter: Some("flash_forward::"),
            },
            ..base
        };
        assert_eq!(
            one.cargo_test_args().unwrap(),
            ["test", "-p", "attnproof-harness", "--no-fail-fast", "--test", "it", "--", "flash_forward::"]
        );
        assert_eq!(
            one.runner.location(),
            "cpu: scratch, cargo test -p attnproof-harness --no-fail-fast --test it -- flash_forward::"
        );
        let gpu = Mutant { runner: Runner::KernelText { kernel: "flash_fwd", mode: None }, ..base };
        assert_eq!(gpu.cargo_test_args(), None);
        assert!(!gpu.runner.runs_on_cpu());
        assert!(gpu.runner.location().starts_with("gpu: kernel text"));
        let built = Runner::ScratchGpu { package: "attnproof-gpu", target: "it", filter: Some("ring_state::stale") };
        assert_eq!(built.location(), "gpu: scratch build (gpu-bundle), attnproof-gpu --test it -- ring_state::stale");
    }

    #[test]
    fn find_by_name_and_kernel() {
        assert_eq!(find("gqa-head-modulo").map(|m| m.file), Some("reference/src/mask.rs"));
        assert!(find("no-such-mutant").is_none());
        assert!(
            kernel_text_mutants("flash_fwd", None)
                .all(|m| [COMMON_HEADER, "gpu/kernels/flash_fwd.cu"].contains(&m.file))
        );
        assert!(kernel_text_mutants("flash_bwd", None).count() > 0);
        assert_eq!(kernel_text_mutants("no_such_kernel", None).count(), 0);
        // A mode's mutants are its own: none of them is among the plain mode's, and the block-sparse mode has some.
        let block_sparse: Vec<_> = kernel_text_mutants("flash_fwd", Some("BLOCK_SPARSE")).collect();
        assert!(block_sparse.len() >= 6 && block_sparse.iter().all(|m| m.name.starts_with("gpu-bsa-")));
        assert!(kernel_text_mutants("flash_fwd", None).all(|m| !block_sparse.contains(&m)));
        let backward: Vec<_> = kernel_text_mutants("flash_bwd", Some("BLOCK_SPARSE")).collect();
        assert!(backward.len() >= 10 && backward.iter().all(|m| m.name.starts_with("gpu-bsa-bwd-")));
    }
}
