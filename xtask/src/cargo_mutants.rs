//! cargo-mutants over the verifier's CPU crates (`cargo xtask mutants --scope NAME` and `--diff [REV]`): which tests
//! judge each scope's mutants, the run inside the catalog's scratch copy, the outcome files read back, the survivors
//! `mutants-equivalent.md` explains, and the record that lets `cargo xtask verify` remind an author of changed code
//! that no mutant has exercised since its last change.
//!
//! Which files are mutated is cargo-mutants' own configuration (`.cargo/mutants.toml`, `examine_globs`); this module
//! reads the same globs for the reminder, so the two can never disagree about the scope.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::process::describe;

/// The configuration file cargo-mutants reads, relative to the repository root.
pub const CONFIG: &str = ".cargo/mutants.toml";

/// The list of survivors no input can tell apart from the original, relative to the repository root.
pub const EQUIVALENT_LIST: &str = "mutants-equivalent.md";

/// The record of files whose mutants were last run to the end with no unexplained survivor, under `target/`.
const TESTED_RECORD: &str = "target/mutants/tested.txt";

/// One scope of cargo-mutants: a crate, or part of one, with the tests that judge its mutants. Every file of
/// `examine_globs` belongs to exactly one scope (a test checks it), so `--diff` knows which tests to run for a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope {
    /// The name typed after `--scope`.
    pub name: &'static str,
    /// The cargo package that owns its files.
    pub package: &'static str,
    /// The package's directory, relative to the repository root, with a trailing slash.
    pub dir: &'static str,
    /// Files of the package's scope left to other scopes (globs, as cargo-mutants' `--exclude`).
    pub exclude: &'static [&'static str],
    /// The packages whose tests run against each mutant: the crate's own, plus those whose tests are its real
    /// judges (the reference schedules are checked against the oracle by the harness, not by themselves).
    pub test_packages: &'static [&'static str],
    /// The test targets built and run for each mutant (cargo arguments, given to the build and the test run alike,
    /// so that nothing else is built per mutant).
    pub targets: &'static [&'static str],
    /// Name filters (a test runs when its name contains one); empty for every test of the targets.
    pub filters: &'static [&'static str],
}

/// Unit and integration tests: what [`Scope::targets`] holds unless a scope says otherwise. Examples and doc tests
/// are left out, because building them per mutant would cost more than they test.
const UNIT_AND_INTEGRATION: &[&str] = &["--lib", "--tests"];

/// The verdict's rules and the case checker, judged by the harness's unit tests and its case-file tests only: the
/// suites that run the flash and sparse families take most of a minute, which is too long per mutant, and none of
/// them tests a rule of the verdict that the unit tests leave open.
const VERDICT_FILES: &[&str] = &[
    "tests/src/verdict.rs",
    "tests/src/gate.rs",
    "tests/src/block_selection.rs",
    "tests/src/dsa_index.rs",
    "tests/src/dsa_loss.rs",
    "tests/src/pyramid_selection.rs",
    "tests/src/pyramid_diagnostics.rs",
    "tests/src/pisa_tail.rs",
    "tests/src/pisa_tail_backward.rs",
    "tests/src/pisa_covariance.rs",
    "tests/src/hils_routing.rs",
    "tests/src/hils_output.rs",
    "tests/src/case/*.rs",
];

/// The harness's family drivers (which build the bounds and canned answers of each family), judged by every suite.
const FAMILY_FILES: &[&str] = &["tests/src/flash.rs", "tests/src/backward.rs", "tests/src/sparse.rs"];

/// Every scope, in the order `--scope all` takes them. Within a package, the files are `examine_globs` of [`CONFIG`]
/// minus the scope's `exclude`.
pub const SCOPES: &[Scope] = &[
    Scope {
        name: "proofs",
        package: "attnproof-proofs",
        dir: "proofs/",
        exclude: &[],
        test_packages: &["attnproof-proofs"],
        targets: UNIT_AND_INTEGRATION,
        filters: &[],
    },
    Scope {
        name: "verdict",
        package: "attnproof-harness",
        dir: "tests/",
        exclude: FAMILY_FILES,
        test_packages: &["attnproof-harness"],
        targets: &["--lib", "--test=it"],
        filters: &[
            "verdict::",
            "gate::",
            "block_selection::",
            "dsa_index::",
            "dsa_loss::",
            "pyramid_selection::",
            "pyramid_diagnostics::",
            // The tail's (forward and backward), E24's and HiLS's verifiers: their unit tests and the CPU suites of their
            // schedules.
            "pisa_tail",
            "pisa_covariance::",
            "hils",
            "case::",
            "check_",
            "recipe::",
        ],
    },
    Scope {
        name: "harness",
        package: "attnproof-harness",
        dir: "tests/",
        exclude: VERDICT_FILES,
        test_packages: &["attnproof-harness"],
        targets: UNIT_AND_INTEGRATION,
        filters: &[],
    },
    Scope {
        name: "fixtures",
        package: "attnproof-fixtures",
        dir: "fixtures/",
        exclude: &[],
        test_packages: &["attnproof-fixtures"],
        targets: UNIT_AND_INTEGRATION,
        filters: &[],
    },
    Scope {
        name: "oracle",
        package: "attnproof-oracle",
        dir: "oracle/",
        exclude: &[],
        // The oracle's own tests check its inputs and semantics; its values are judged by the fixtures' independent
        // recomputations (closed forms, integer arithmetic from the seeds) and by the theorems.
        test_packages: &["attnproof-oracle", "attnproof-proofs", "attnproof-fixtures"],
        targets: UNIT_AND_INTEGRATION,
        filters: &[],
    },
    // The reference schedules have no tests of their own: the harness checks them against the oracle, each family in
    // its own test module, so each part of the crate is judged by its family's module only (the dense backward's
    // module alone takes most of a minute, which a ring mutant need not pay).
    Scope {
        name: "reference",
        package: "attnproof-reference",
        dir: "reference/src/",
        exclude: &[REFERENCE_RING, REFERENCE_SPARSE],
        test_packages: &["attnproof-reference", "attnproof-harness"],
        targets: &["--lib", "--test=it"],
        filters: &["flash_forward::", "flash_backward::"],
    },
    Scope {
        name: "reference-ring",
        package: "attnproof-reference",
        dir: "reference/src/ring/",
        exclude: &[REFERENCE_TOP, REFERENCE_SPARSE],
        test_packages: &["attnproof-reference", "attnproof-harness"],
        targets: &["--lib", "--test=it"],
        filters: &["ring::"],
    },
    Scope {
        name: "reference-sparse",
        package: "attnproof-reference",
        dir: "reference/src/sparse/",
        exclude: &[REFERENCE_TOP, REFERENCE_RING],
        test_packages: &["attnproof-reference", "attnproof-harness"],
        targets: &["--lib", "--test=it"],
        filters: &["sparse::"],
    },
];

/// The reference crate's files outside its folders (the dense schedules), left out of the ring and sparse scopes.
/// cargo-mutants picks a scope's files by package and `--exclude` alone (a `--file` would add to the configuration's
/// globs, not narrow them), so every scope that shares a package excludes the other scopes' files.
const REFERENCE_TOP: &str = "reference/src/*.rs";

/// The ring schedules, a scope of their own.
const REFERENCE_RING: &str = "reference/src/ring/**";

/// The sparse schedules, a scope of their own.
const REFERENCE_SPARSE: &str = "reference/src/sparse/**";

impl Scope {
    /// Whether `file` (relative to the repository root) is one of this scope's, given cargo-mutants' `globs`.
    pub fn owns(&self, globs: &[String], file: &str) -> bool {
        file.starts_with(self.dir)
            && globs.iter().any(|g| glob_matches(g, file))
            && !self.exclude.iter().any(|g| glob_matches(g, file))
    }
}

/// The scope named `name`.
pub fn find_scope(name: &str) -> Result<&'static Scope> {
    SCOPES.iter().find(|c| c.name == name).with_context(|| {
        let names: Vec<&str> = SCOPES.iter().map(|c| c.name).collect();
        format!("no cargo-mutants scope `{name}`; the scopes are: {} (or `all`)", names.join(", "))
    })
}

/// What cargo-mutants (and then [`EQUIVALENT_LIST`]) made of one mutant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fate {
    /// A test failed.
    Caught,
    /// Every test passed, and [`EQUIVALENT_LIST`] explains why no test can fail.
    Equivalent,
    /// Every test passed and nothing explains it: a missing test.
    Missed,
    /// The tests ran past cargo-mutants' timeout (counted as caught, reported apart).
    Timeout,
    /// The mutated source did not build: nothing was tested.
    Unviable,
    /// Caught or unviable in an earlier run of the same record, so not run again (`--resume`; cargo-mutants'
    /// `--iterate` keeps the two in one list).
    Earlier,
}

impl Fate {
    /// The outcome file cargo-mutants writes for this fate (`Equivalent` is ours: cargo-mutants calls it missed).
    const FILES: [(&'static str, Fate); 5] = [
        ("caught.txt", Fate::Caught),
        ("missed.txt", Fate::Missed),
        ("timeout.txt", Fate::Timeout),
        ("unviable.txt", Fate::Unviable),
        ("previously_caught.txt", Fate::Earlier),
    ];

    /// The word for the table.
    pub fn word(self) -> &'static str {
        match self {
            Fate::Caught => "caught",
            Fate::Equivalent => "equivalent",
            Fate::Missed => "MISSED",
            Fate::Timeout => "timeout",
            Fate::Unviable => "unviable",
            Fate::Earlier => "earlier",
        }
    }

    /// Whether the fate leaves the mutant explained: caught, timed out, unviable or argued equivalent.
    pub fn is_explained(self) -> bool {
        self != Fate::Missed
    }
}

/// One mutant's name as cargo-mutants prints it (`file:line:col: description`) and its fate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MutantOutcome {
    /// `proofs/src/flash_bound.rs:48:45: replace / with *`.
    pub name: String,
    /// What became of it.
    pub fate: Fate,
}

/// The tally of one run, per crate, for the summary and docs/mutation.md.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Mutants generated.
    pub generated: usize,
    /// Caught by a failing test.
    pub caught: usize,
    /// Missed and not explained.
    pub missed: usize,
    /// Missed but argued equivalent.
    pub equivalent: usize,
    /// Timed out.
    pub timeouts: usize,
    /// Did not build.
    pub unviable: usize,
    /// Caught or unviable in an earlier run of a resumed record.
    pub earlier: usize,
}

impl Tally {
    /// Counts `outcomes`.
    pub fn of(outcomes: &[MutantOutcome]) -> Tally {
        let count = |fate| outcomes.iter().filter(|o| o.fate == fate).count();
        Tally {
            generated: outcomes.len(),
            caught: count(Fate::Caught),
            missed: count(Fate::Missed),
            equivalent: count(Fate::Equivalent),
            timeouts: count(Fate::Timeout),
            unviable: count(Fate::Unviable),
            earlier: count(Fate::Earlier),
        }
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} generated: {} caught, {} missed, {} equivalent, {} timeouts, {} unviable",
            self.generated, self.caught, self.missed, self.equivalent, self.timeouts, self.unviable
        )?;
        if self.earlier > 0 {
            write!(f, ", {} caught or unviable in earlier runs", self.earlier)?;
        }
        Ok(())
    }
}

/// Reads the outcome files of a finished cargo-mutants run (`<out>/mutants.out/*.txt`).
///
/// A run that found no mutant (a diff touching only comments) writes no outcome files; that reads as no outcome.
pub fn read_outcomes(mutants_out: &Path) -> Result<Vec<MutantOutcome>> {
    let mut outcomes = Vec::new();
    for (file, fate) in Fate::FILES {
        let path = mutants_out.join(file);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
            Err(err) => return Err(err).with_context(|| format!("reading {}", path.display())),
        };
        outcomes.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(|name| MutantOutcome { name: name.to_owned(), fate }),
        );
    }
    outcomes.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(outcomes)
}

/// The mutant names [`EQUIVALENT_LIST`] explains: every list item of the form ``- `NAME`: why``.
pub fn parse_equivalent_list(text: &str) -> Result<BTreeMap<String, String>> {
    let mut entries = BTreeMap::new();
    for (number, line) in text.lines().enumerate() {
        let Some(rest) = line.strip_prefix("- `") else { continue };
        let Some((name, why)) = rest.split_once("`: ") else {
            bail!("{EQUIVALENT_LIST}:{}: an entry must read ``- `NAME`: why``, got: {line}", number + 1);
        };
        if why.trim().is_empty() {
            bail!("{EQUIVALENT_LIST}:{}: `{name}` has no argument for its equivalence", number + 1);
        }
        if entries.insert(name.to_owned(), why.trim().to_owned()).is_some() {
            bail!("{EQUIVALENT_LIST}:{}: `{name}` is listed twice", number + 1);
        }
    }
    Ok(entries)
}

/// Marks the missed mutants that `equivalent` explains. Returns the entries of `equivalent` for files of `crates` that
/// name no mutant of this run at all (stale: the code moved or changed, so the argument must be checked again).
pub fn apply_equivalents(
    outcomes: &mut [MutantOutcome],
    equivalent: &BTreeMap<String, String>,
    full_run_files: &BTreeSet<String>,
) -> Vec<String> {
    for outcome in outcomes.iter_mut() {
        if outcome.fate == Fate::Missed && equivalent.contains_key(&outcome.name) {
            outcome.fate = Fate::Equivalent;
        }
    }
    let generated: BTreeSet<&str> = outcomes.iter().map(|o| o.name.as_str()).collect();
    stale_entries(equivalent, full_run_files, &generated)
}

/// The entries of `equivalent` for files of `files` that `generated` (the names of every mutant cargo-mutants makes of
/// those files) does not hold: stale, their code moved or changed.
pub fn stale_entries(
    equivalent: &BTreeMap<String, String>,
    files: &BTreeSet<String>,
    generated: &BTreeSet<&str>,
) -> Vec<String> {
    equivalent
        .keys()
        .filter(|name| files.contains(name.split(':').next().unwrap_or(name)))
        .filter(|name| !generated.contains(name.as_str()))
        .cloned()
        .collect()
}

/// The `examine_globs` array of cargo-mutants' configuration: a TOML array of plain strings, over one or more lines.
pub fn examine_globs(config: &str) -> Result<Vec<String>> {
    // Comments go first, line by line, so that a bracket or quote inside one cannot confuse the scan; no glob holds a
    // `#`.
    let code: Vec<&str> = config.lines().map(|l| l.split('#').next().unwrap_or("")).collect();
    let code = code.join("\n");
    let start = code.find("examine_globs").with_context(|| format!("{CONFIG} has no `examine_globs` array"))?;
    let rest = &code[start..];
    let (open, close) = match (rest.find('['), rest.find(']')) {
        (Some(open), Some(close)) if open < close => (open, close),
        _ => bail!("{CONFIG}: `examine_globs` must be an array of strings closed with `]`"),
    };
    let globs = rest[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.strip_prefix('"')
                .and_then(|s| s.strip_suffix('"'))
                .map(str::to_owned)
                .with_context(|| format!("{CONFIG}: `examine_globs` holds {item}, not a plain string"))
        })
        .collect::<Result<Vec<_>>>()?;
    if globs.is_empty() {
        bail!("{CONFIG}: `examine_globs` is empty, which would mutate every file");
    }
    Ok(globs)
}

/// Whether `path` (relative, `/`-separated) matches `glob`: `*` stands for any characters within one path segment,
/// `**` for any number of whole segments, as in cargo-mutants' globs that contain a slash.
pub fn glob_matches(glob: &str, path: &str) -> bool {
    fn segments(glob: &[&str], path: &[&str]) -> bool {
        match (glob.first(), path.first()) {
            (None, None) => true,
            (Some(&"**"), _) => segments(&glob[1..], path) || (!path.is_empty() && segments(glob, &path[1..])),
            (Some(g), Some(p)) => segment(g.as_bytes(), p.as_bytes()) && segments(&glob[1..], &path[1..]),
            _ => false,
        }
    }
    fn segment(glob: &[u8], text: &[u8]) -> bool {
        match glob.first() {
            None => text.is_empty(),
            Some(b'*') => (0..=text.len()).any(|skip| segment(&glob[1..], &text[skip..])),
            Some(&c) => text.first() == Some(&c) && segment(&glob[1..], &text[1..]),
        }
    }
    let glob: Vec<&str> = glob.split('/').collect();
    let path: Vec<&str> = path.split('/').collect();
    segments(&glob, &path)
}

/// Whether `file` is in cargo-mutants' scope: some scope of [`SCOPES`] owns it.
pub fn in_scope(globs: &[String], file: &str) -> bool {
    SCOPES.iter().any(|s| s.owns(globs, file))
}

/// A stable 64-bit FNV-1a hash of a file's bytes, for the tested-files record (std's hasher may change between
/// toolchains, and the record outlives one).
pub fn content_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The tested-files record: file → hash of the content its mutants were last run on with no unexplained survivor.
pub fn read_tested(root: &Path) -> BTreeMap<String, u64> {
    let Ok(text) = std::fs::read_to_string(root.join(TESTED_RECORD)) else { return BTreeMap::new() };
    text.lines()
        .filter_map(|l| l.split_once('\t'))
        .filter_map(|(hash, file)| Some((file.to_owned(), u64::from_str_radix(hash, 16).ok()?)))
        .collect()
}

/// Adds `files` (as they are now in `root`) to the tested-files record.
pub fn record_tested(root: &Path, files: &BTreeSet<String>) -> Result<()> {
    let mut tested = read_tested(root);
    for file in files {
        if let Ok(bytes) = std::fs::read(root.join(file)) {
            tested.insert(file.clone(), content_hash(&bytes));
        }
    }
    let text: String = tested.iter().map(|(file, hash)| format!("{hash:016x}\t{file}\n")).collect();
    let path = root.join(TESTED_RECORD);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

/// Runs git in `root` and returns its stdout, or an error naming the command.
pub fn git(root: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .with_context(|| format!("could not run `git {}` (is git installed?)", args.join(" ")))?;
    if !out.status.success() {
        bail!("`git {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The revision `--diff` compares with: `rev` when given, else the merge base of `HEAD` and `main`.
pub fn base_revision(root: &Path, rev: Option<&str>) -> Result<String> {
    let rev = match rev {
        Some(rev) => rev.to_owned(),
        None => git(root, &["merge-base", "HEAD", "main"])
            .context("no merge base of HEAD and `main`; name the revision to compare with: --diff REV")?
            .trim()
            .to_owned(),
    };
    // Resolve it now, so that a typo is one clear error rather than an empty diff.
    Ok(git(root, &["rev-parse", "--verify", "--quiet", &format!("{rev}^{{commit}}")])
        .with_context(|| format!("`{rev}` is not a revision of this repository"))?
        .trim()
        .to_owned())
}

/// The working tree's changes since `base` as a unified diff, untracked files included (as additions), and the
/// changed files' paths.
pub fn diff_since(root: &Path, base: &str) -> Result<(String, BTreeSet<String>)> {
    let mut patch = git(root, &["diff", "--no-color", "--no-ext-diff", base, "--"])?;
    let mut files: BTreeSet<String> =
        git(root, &["diff", "--name-only", "--no-renames", base, "--"])?.lines().map(str::to_owned).collect();
    for untracked in git(root, &["ls-files", "--others", "--exclude-standard"])?.lines() {
        // `git diff --no-index` exits 1 when the files differ, which they always do here, so it is run directly.
        let out = Command::new("git")
            .args(["diff", "--no-color", "--no-index", "--", "/dev/null", untracked])
            .current_dir(root)
            .output()
            .context("could not run `git diff --no-index`")?;
        patch.push_str(&String::from_utf8_lossy(&out.stdout));
        files.insert(untracked.to_owned());
    }
    Ok((patch, files))
}

/// Changed files in cargo-mutants' scope whose current content no complete mutants run has covered: the reminder of
/// `cargo xtask verify`. `None` when it cannot tell (no git, no `main`, no configuration), because a reminder must
/// never fail verify.
pub fn untested_changes(root: &Path) -> Option<Vec<String>> {
    let globs = examine_globs(&std::fs::read_to_string(root.join(CONFIG)).ok()?).ok()?;
    let base = base_revision(root, None).ok()?;
    let (_, changed) = diff_since(root, &base).ok()?;
    let tested = read_tested(root);
    Some(
        changed
            .into_iter()
            .filter(|f| in_scope(&globs, f))
            .filter(|f| {
                let Ok(bytes) = std::fs::read(root.join(f)) else { return false };
                tested.get(f) != Some(&content_hash(&bytes))
            })
            .collect(),
    )
}

/// The scopes owning files of `changed`.
pub fn scopes_touched(globs: &[String], changed: &BTreeSet<String>) -> Vec<&'static Scope> {
    SCOPES.iter().filter(|s| changed.iter().any(|f| s.owns(globs, f))).collect()
}

/// Which of a scope's mutants one run takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection<'a> {
    /// Every mutant of the scope, into a fresh record.
    Whole,
    /// The scope's mutants that its record does not show caught or unviable (cargo-mutants' `--iterate`): a long
    /// scope run stopped part way goes on where it stopped, and its survivors meet the tests written since.
    Resume,
    /// The mutants on the changed lines of this patch, into a record of their own.
    Diff(&'a Path),
    /// One slice of the scope's mutants (cargo-mutants' `--shard`), into a record of its own: a scope too long for
    /// one sitting is run slice by slice, each slice to its end. `resume` goes on from the slice's last record: the
    /// runner lists the slice (`--list` with the slice's arguments) and runs its rest as [`Selection::SliceRest`].
    Shard { shard: Shard, resume: bool },
    /// The mutants of a slice, named as `--list` names them, that the slice's record does not show caught or
    /// unviable. cargo-mutants slices what is left after every filter, `--iterate` included, so `--shard` with
    /// `--iterate` would take a third of the scope's untested mutants, not the rest of this slice: the rest is
    /// picked by name instead, one anchored `--re` each, with `--iterate` and no `--shard`.
    SliceRest { shard: Shard, names: &'a [String] },
}

/// The `index`-th of `count` slices of a scope's mutants (0-based, as cargo-mutants counts them); each mutant falls
/// in exactly one slice (round-robin over cargo-mutants' list, so that every file is spread over the slices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: u32,
    pub count: u32,
}

impl Shard {
    /// Parses `K/N` with 0 <= K < N.
    pub fn parse(text: &str) -> Result<Shard> {
        let parsed = text.split_once('/').and_then(|(k, n)| Some((k.trim().parse().ok()?, n.trim().parse().ok()?)));
        match parsed {
            Some((index, count)) if index < count => Ok(Shard { index, count }),
            _ => bail!("--shard `{text}`: expected K/N with 0 <= K < N (the K-th of N slices, counted from 0)"),
        }
    }
}

/// The arguments of one cargo-mutants run over `scope`, in place in the scratch copy, writing `<out>/mutants.out`,
/// over the mutants `selection` takes, each mutant's tests stopped after `timeout`.
///
/// cargo-mutants' own baseline is skipped (`--baseline=skip`): cargo-mutants 27.1 runs it over the mutated package's
/// tests only, whatever `--test-package` says, so it would time the wrong tests and cannot even start for the
/// reference crate, which has no tests of its own. xtask runs the real baseline itself ([`baseline_args`]) and passes
/// the timeout it implies ([`test_timeout`]); the mutants themselves are judged by every package of
/// [`Scope::test_packages`].
pub fn cargo_mutants_args(scope: &Scope, out: &Path, selection: Selection<'_>, timeout: Duration) -> Vec<String> {
    let mut args: Vec<String> =
        ["mutants", "--in-place", "--no-shuffle", "--colors", "never", "--package", scope.package]
            .map(str::to_owned)
            .to_vec();
    for test_package in scope.test_packages {
        args.extend(["--test-package".to_owned(), (*test_package).to_owned()]);
    }
    args.extend(["--baseline=skip".to_owned(), format!("--timeout={}", timeout.as_secs().max(1))]);
    args.extend(["--output".to_owned(), out.display().to_string()]);
    for glob in scope.exclude {
        args.extend(["--exclude".to_owned(), (*glob).to_owned()]);
    }
    match selection {
        Selection::Whole => {}
        Selection::Resume => args.push("--iterate".to_owned()),
        Selection::Diff(patch) => args.extend(["--in-diff".to_owned(), patch.display().to_string()]),
        Selection::Shard { shard, resume } => {
            assert!(!resume, "a slice is resumed by name (Selection::SliceRest), never with --shard and --iterate");
            args.extend([format!("--shard={}/{}", shard.index, shard.count), "--sharding=round-robin".to_owned()]);
        }
        Selection::SliceRest { names, .. } => {
            args.push("--iterate".to_owned());
            args.extend(names.iter().map(|name| format!("--re=^{}$", regex_escape(name))));
        }
    }
    for target in scope.targets {
        args.push(format!("--cargo-arg={target}"));
    }
    if !scope.filters.is_empty() {
        // cargo-mutants passes what follows its own `--` to `cargo nextest run` (`test_tool` in .cargo/mutants.toml),
        // which reads them as name filters.
        args.push("--".to_owned());
        args.extend(scope.filters.iter().map(|a| (*a).to_owned()));
    }
    args
}

/// `text` as a regular expression that matches it literally (the metacharacters of Rust's `regex` crate escaped).
pub fn regex_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// The names `cargo mutants --list` printed: one per non-empty line.
pub fn listed_names(stdout: &str) -> Vec<String> {
    stdout.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned).collect()
}

/// The cargo arguments of the unmutated run of `scope`'s judging tests, the baseline: the command cargo-mutants runs
/// for each mutant (`cargo nextest run` in the `profile` of the configuration, every test package, the scope's targets
/// and filters), only building when `build_only`, so that the timed run holds no compilation.
pub fn baseline_args(scope: &Scope, profile: &str, build_only: bool) -> Vec<String> {
    let mut args: Vec<String> = vec!["nextest".to_owned(), "run".to_owned()];
    if build_only {
        args.push("--no-run".to_owned());
    }
    args.push(format!("--cargo-profile={profile}"));
    args.extend(scope.test_packages.iter().map(|p| format!("--package={p}")));
    args.extend(scope.targets.iter().map(|t| (*t).to_owned()));
    if !build_only {
        args.extend(scope.filters.iter().map(|f| (*f).to_owned()));
    }
    args
}

/// How long one mutant's tests may run: the configuration's `timeout_multiplier` times the baseline's test time, but
/// never less than its `minimum_test_timeout` (seconds), the rule cargo-mutants applies after its own baseline.
pub fn test_timeout(config: &str, baseline: Duration) -> Result<Duration> {
    let multiplier = config_number(config, "timeout_multiplier")?;
    let minimum = config_number(config, "minimum_test_timeout")?;
    Ok(Duration::from_secs_f64((baseline.as_secs_f64() * multiplier).max(minimum).ceil()))
}

/// A top-level scalar of the configuration (`key = value`, comments stripped), unquoted.
pub fn config_value<'a>(config: &'a str, key: &str) -> Result<&'a str> {
    config
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim().trim_matches('"'))
        .with_context(|| format!("{CONFIG} has no `{key} = ...` line"))
}

/// A top-level number of the configuration.
fn config_number(config: &str, key: &str) -> Result<f64> {
    let value = config_value(config, key)?;
    value.parse().with_context(|| format!("{CONFIG}: `{key}` is {value}, not a number"))
}

/// What cargo-mutants' exit code says about a run: `Ok` when its outcome files are to be read (0 all caught, 2 some
/// missed, 3 some timed out), an error otherwise (1 bad usage, 4 the unmutated baseline failed).
pub fn check_exit(code: Option<i32>, cmd: &Command) -> Result<()> {
    match code {
        Some(0 | 2 | 3) => Ok(()),
        Some(4) => bail!(
            "`{}`: the tests fail on the unmutated copy (cargo-mutants' baseline); fix them before mutating",
            describe(cmd)
        ),
        Some(code) => bail!("`{}` failed with exit code {code}", describe(cmd)),
        None => bail!("`{}` was killed by a signal", describe(cmd)),
    }
}

/// The cargo subcommands a run needs: cargo-mutants, and cargo-nextest, its test runner (`test_tool` in
/// .cargo/mutants.toml), which stops a mutant's tests at the first failure where `cargo test` would run them all.
const TOOLS: &[(&str, &str, &str)] = &[
    ("mutants", "cargo-mutants", "cargo install cargo-mutants --locked` (27.1 or later)"),
    ("nextest", "cargo-nextest", "cargo install cargo-nextest --locked` (0.9.100 or later)"),
];

/// Fails with the install command when cargo-mutants or cargo-nextest is missing.
pub fn ensure_installed(root: &Path) -> Result<()> {
    for (subcommand, name, install) in TOOLS {
        let ok = crate::process::cargo(root)
            .args([subcommand, "--version"])
            .output()
            .is_ok_and(|out| out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with(name));
        if !ok {
            bail!("{name} is not installed; install it with `{install}");
        }
    }
    Ok(())
}

/// The output directory of `scope`'s runs: `target/mutants/runs/<name>` for a whole scope, `runs/diff-<name>` for
/// `--diff` and `runs/<name>-shard-K-of-N` for a slice, so that a quick run on a change never wipes a long one's
/// record.
pub fn output_dir(root: &Path, scope: &Scope, selection: Selection<'_>) -> PathBuf {
    let name = match selection {
        Selection::Diff(_) => format!("diff-{}", scope.name),
        Selection::Whole | Selection::Resume => scope.name.to_owned(),
        Selection::Shard { shard, .. } | Selection::SliceRest { shard, .. } => {
            format!("{}-shard-{}-of-{}", scope.name, shard.index, shard.count)
        }
    };
    root.join("target").join("mutants").join("runs").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG_TEXT: &str = "# comment\nexamine_globs = [\n    \"tests/src/verdict.rs\", # the verdict\n    \
                               \"reference/src/**/*.rs\",\n    \"oracle/src/*.rs\",\n]\ntimeout_multiplier = 3.0\n";

    #[test]
    fn reads_examine_globs_across_lines_and_comments() {
        assert_eq!(
            examine_globs(CONFIG_TEXT).unwrap(),
            ["tests/src/verdict.rs", "reference/src/**/*.rs", "oracle/src/*.rs"]
        );
        assert_eq!(examine_globs("examine_globs = [\"a/*.rs\", \"b.rs\"]\n").unwrap(), ["a/*.rs", "b.rs"]);
        assert!(examine_globs("timeout_multiplier = 3.0\n").is_err());
        assert!(examine_globs("examine_globs = [\n\"a.rs\",\n").is_err(), "an unclosed array is an error");
        assert!(examine_globs("examine_globs = []\n").is_err(), "an empty scope is an error");
    }

    #[test]
    fn globs_match_segments_and_double_stars() {
        assert!(glob_matches("oracle/src/*.rs", "oracle/src/nsa.rs"));
        assert!(!glob_matches("oracle/src/*.rs", "oracle/src/sub/nsa.rs"), "`*` stays within one segment");
        assert!(!glob_matches("oracle/src/*.rs", "oracle/src/nsa.txt"));
        assert!(glob_matches("reference/src/**/*.rs", "reference/src/ring/forward.rs"));
        assert!(glob_matches("reference/src/**/*.rs", "reference/src/flash.rs"), "`**` may stand for no segment");
        assert!(glob_matches("reference/src/**/*.rs", "reference/src/a/b/c.rs"));
        assert!(!glob_matches("reference/src/**/*.rs", "reference/tests/it.rs"));
        assert!(glob_matches("tests/src/verdict.rs", "tests/src/verdict.rs"));
        assert!(!glob_matches("tests/src/verdict.rs", "tests/src/verdict.rs.orig"));
    }

    #[test]
    fn scope_needs_a_glob_and_an_owning_scope() {
        let globs = examine_globs(CONFIG_TEXT).unwrap();
        assert!(in_scope(&globs, "oracle/src/dense.rs"));
        assert!(in_scope(&globs, "reference/src/ring/backward.rs"));
        assert!(!in_scope(&globs, "tests/src/candidate.rs"), "no glob names it");
        assert!(!in_scope(&["xtask/src/*.rs".to_owned()], "xtask/src/main.rs"), "no scope owns xtask");
        let all = ["tests/src/*.rs".to_owned(), "tests/src/case/*.rs".to_owned()];
        let owners = |file: &str| SCOPES.iter().filter(|s| s.owns(&all, file)).map(|s| s.name).collect::<Vec<_>>();
        assert_eq!(owners("tests/src/gate.rs"), ["verdict"]);
        assert_eq!(owners("tests/src/case/check.rs"), ["verdict"]);
        assert_eq!(owners("tests/src/flash.rs"), ["harness"]);
        let all = ["reference/src/**/*.rs".to_owned()];
        let owners = |file: &str| SCOPES.iter().filter(|s| s.owns(&all, file)).map(|s| s.name).collect::<Vec<_>>();
        assert_eq!(owners("reference/src/flash.rs"), ["reference"]);
        assert_eq!(owners("reference/src/ring/forward.rs"), ["reference-ring"]);
        assert_eq!(owners("reference/src/sparse/nsa.rs"), ["reference-sparse"]);
    }

    #[test]
    fn cargo_mutants_mutates_exactly_the_files_each_scope_owns() {
        // cargo-mutants sees a scope as its package's files in `examine_globs` minus `--exclude`; `owns` (which the
        // reminder and `--diff` use) also asks for the scope's folder. The two must agree on every tracked file.
        let root = crate::repo_root();
        let globs = examine_globs(&std::fs::read_to_string(root.join(CONFIG)).unwrap()).unwrap();
        let tracked = git(&root, &["ls-files"]).unwrap();
        for scope in SCOPES {
            let package_dir = format!("{}/", scope.dir.split('/').next().unwrap());
            for file in tracked.lines().filter(|f| f.starts_with(&package_dir)) {
                let mutated =
                    globs.iter().any(|g| glob_matches(g, file)) && !scope.exclude.iter().any(|g| glob_matches(g, file));
                assert_eq!(mutated, scope.owns(&globs, file), "{}: {file}", scope.name);
            }
        }
    }

    #[test]
    fn every_scope_is_found_by_name_and_tested_by_its_own_package() {
        for scope in SCOPES {
            assert_eq!(find_scope(scope.name).unwrap(), scope);
            assert!(scope.test_packages.contains(&scope.package), "{}'s own tests judge its mutants", scope.name);
        }
        let err = find_scope("gpu").unwrap_err().to_string();
        assert!(err.contains("proofs, verdict, harness"), "{err}");
    }

    #[test]
    fn every_file_in_scope_has_exactly_one_scope_and_every_glob_names_files() {
        let root = crate::repo_root();
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
        for scope in SCOPES {
            let member = scope.dir.trim_end_matches('/').split("/src").next().unwrap();
            assert!(manifest.contains(&format!("\"{member}\"")), "{member} is not a workspace member");
        }
        let globs = examine_globs(&std::fs::read_to_string(root.join(CONFIG)).unwrap()).unwrap();
        let files = git(&root, &["ls-files"]).unwrap();
        for glob in &globs {
            let matched: Vec<&str> = files.lines().filter(|f| glob_matches(glob, f)).collect();
            assert!(!matched.is_empty(), "{CONFIG}: `{glob}` matches no tracked file");
            for file in matched {
                let owners: Vec<&str> = SCOPES.iter().filter(|s| s.owns(&globs, file)).map(|s| s.name).collect();
                assert_eq!(owners.len(), 1, "{file} belongs to {owners:?}");
            }
        }
        for glob in VERDICT_FILES.iter().chain(FAMILY_FILES) {
            assert!(globs.contains(&(*glob).to_owned()), "{glob} is split between scopes but not in {CONFIG}");
        }
    }

    #[test]
    fn outcome_files_are_read_and_equivalents_applied() {
        let dir = std::env::temp_dir().join(format!("attnproof-outcomes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("caught.txt"), "a.rs:1:1: replace + with -\n").unwrap();
        std::fs::write(dir.join("missed.txt"), "a.rs:2:1: replace * with /\na.rs:3:1: replace f with 0\n").unwrap();
        std::fs::write(dir.join("unviable.txt"), "a.rs:4:1: replace g with ()\n").unwrap();
        std::fs::write(dir.join("previously_caught.txt"), "a.rs:5:1: replace h with 1\n").unwrap();
        let mut outcomes = read_outcomes(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(outcomes.len(), 5);
        assert_eq!(outcomes[0].name, "a.rs:1:1: replace + with -", "sorted by name");

        let list = "# Equivalent\n\n- `a.rs:2:1: replace * with /`: x is 1 there\n- `a.rs:9:9: gone`: moved\n";
        let equivalent = parse_equivalent_list(list).unwrap();
        let stale = apply_equivalents(&mut outcomes, &equivalent, &BTreeSet::from(["a.rs".to_owned()]));
        assert_eq!(stale, ["a.rs:9:9: gone"]);
        let tally = Tally::of(&outcomes);
        assert_eq!(
            tally,
            Tally { generated: 5, caught: 1, missed: 1, equivalent: 1, timeouts: 0, unviable: 1, earlier: 1 },
            "{outcomes:?}"
        );
        let unlisted = apply_equivalents(&mut outcomes, &equivalent, &BTreeSet::new());
        assert!(unlisted.is_empty(), "entries of files not fully run are not called stale");
        // A slice judges staleness against the whole scope's list: an entry another slice generates is not stale.
        let files = BTreeSet::from(["a.rs".to_owned()]);
        let listed = BTreeSet::from(["a.rs:2:1: replace * with /", "a.rs:9:9: gone"]);
        assert!(stale_entries(&equivalent, &files, &listed).is_empty());
        let listed = BTreeSet::from(["a.rs:2:1: replace * with /"]);
        assert_eq!(stale_entries(&equivalent, &files, &listed), ["a.rs:9:9: gone"]);
    }

    #[test]
    fn malformed_equivalent_entries_are_errors() {
        assert!(parse_equivalent_list("- `a.rs:1:1: x`: \n").is_err(), "an entry needs its argument");
        assert!(parse_equivalent_list("- `a.rs:1:1: x` because\n").is_err());
        assert!(parse_equivalent_list("- `a: x`: one\n- `a: x`: two\n").is_err(), "a duplicate is an error");
        assert!(parse_equivalent_list("prose with - `code`: inside\n").unwrap().is_empty());
    }

    #[test]
    fn the_repository_equivalent_list_parses() {
        let text = std::fs::read_to_string(crate::repo_root().join(EQUIVALENT_LIST)).unwrap();
        let entries = parse_equivalent_list(&text).unwrap();
        let globs = examine_globs(&std::fs::read_to_string(crate::repo_root().join(CONFIG)).unwrap()).unwrap();
        for name in entries.keys() {
            let file = name.split(':').next().unwrap();
            assert!(in_scope(&globs, file), "{EQUIVALENT_LIST}: `{name}` is outside cargo-mutants' scope");
        }
    }

    /// A throwaway repository with `main` at one commit, a branch with one changed and one untracked file.
    fn planted_repo() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "attnproof-diff-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tests/src")).unwrap();
        let run = |args: &[&str]| git(&dir, args).unwrap();
        run(&["init", "-q", "-b", "main"]);
        run(&["config", "user.email", "t@t"]);
        run(&["config", "user.name", "t"]);
        std::fs::write(dir.join("tests/src/gate.rs"), "fn a() -> bool {\n    1 < 2\n}\n").unwrap();
        std::fs::write(dir.join("README.md"), "x\n").unwrap();
        run(&["add", "."]);
        run(&["commit", "-q", "-m", "base"]);
        run(&["checkout", "-q", "-b", "planted"]);
        std::fs::write(dir.join("tests/src/gate.rs"), "fn a() -> bool {\n    1 <= 2\n}\n").unwrap();
        run(&["commit", "-q", "-am", "a planted bug"]);
        std::fs::write(dir.join("tests/src/verdict.rs"), "fn b() {}\n").unwrap();
        dir
    }

    #[test]
    fn the_diff_covers_commits_since_the_merge_base_and_untracked_files() {
        let dir = planted_repo();
        let base = base_revision(&dir, None).unwrap();
        assert_eq!(base, git(&dir, &["rev-parse", "main"]).unwrap().trim(), "the default is the merge base with main");
        let (patch, files) = diff_since(&dir, &base).unwrap();
        assert_eq!(files, BTreeSet::from(["tests/src/gate.rs".to_owned(), "tests/src/verdict.rs".to_owned()]));
        assert!(patch.contains("+    1 <= 2") && patch.contains("-    1 < 2"), "{patch}");
        assert!(patch.contains("+fn b() {}"), "untracked files are additions: {patch}");
        let globs = vec!["tests/src/*.rs".to_owned()];
        let touched: Vec<&str> = scopes_touched(&globs, &files).iter().map(|s| s.name).collect();
        assert_eq!(touched, ["verdict"]);
        assert!(base_revision(&dir, Some("no-such-rev")).unwrap_err().to_string().contains("no-such-rev"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_reminder_names_changed_files_until_their_current_content_is_mutation_tested() {
        let dir = planted_repo();
        std::fs::create_dir_all(dir.join(".cargo")).unwrap();
        std::fs::write(dir.join(CONFIG), "examine_globs = [\"tests/src/*.rs\"]\n").unwrap();
        let both = vec!["tests/src/gate.rs".to_owned(), "tests/src/verdict.rs".to_owned()];
        assert_eq!(untested_changes(&dir).unwrap(), both, "the configuration file itself is outside the scope");
        record_tested(&dir, &BTreeSet::from(["tests/src/gate.rs".to_owned()])).unwrap();
        assert_eq!(untested_changes(&dir).unwrap(), ["tests/src/verdict.rs"]);
        std::fs::write(dir.join("tests/src/gate.rs"), "fn a() -> bool {\n    2 <= 2\n}\n").unwrap();
        assert_eq!(untested_changes(&dir).unwrap(), both, "a file changed after its run is untested again");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_shard_is_k_of_n_counted_from_zero() {
        assert_eq!(Shard::parse("0/3").unwrap(), Shard { index: 0, count: 3 });
        assert_eq!(Shard::parse("2/3").unwrap(), Shard { index: 2, count: 3 });
        for bad in ["3/3", "1", "a/2", "1/0", "-1/2", "1/2/3"] {
            assert!(Shard::parse(bad).unwrap_err().to_string().contains("K/N"), "{bad}");
        }
    }

    #[test]
    fn diff_runs_and_scope_runs_write_to_different_places() {
        let scope = find_scope("verdict").unwrap();
        let root = Path::new("/r");
        assert_eq!(output_dir(root, scope, Selection::Whole), Path::new("/r/target/mutants/runs/verdict"));
        assert_eq!(output_dir(root, scope, Selection::Resume), Path::new("/r/target/mutants/runs/verdict"));
        assert_eq!(
            output_dir(root, scope, Selection::Shard { shard: Shard { index: 1, count: 3 }, resume: true }),
            Path::new("/r/target/mutants/runs/verdict-shard-1-of-3")
        );
        assert_eq!(
            output_dir(root, scope, Selection::Diff(Path::new("/p"))),
            Path::new("/r/target/mutants/runs/diff-verdict")
        );
    }

    #[test]
    fn hashes_are_stable_and_tell_contents_apart() {
        // FNV-1a's published test vector for "a", so the record survives toolchain updates.
        assert_eq!(content_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(content_hash(b"x = 1;"), content_hash(b"x = 2;"));
    }

    #[test]
    fn exit_codes_separate_outcomes_from_failures() {
        let cmd = Command::new("cargo");
        for code in [0, 2, 3] {
            assert!(check_exit(Some(code), &cmd).is_ok(), "{code}");
        }
        assert!(check_exit(Some(4), &cmd).unwrap_err().to_string().contains("baseline"));
        assert!(check_exit(Some(1), &cmd).is_err());
        assert!(check_exit(None, &cmd).is_err());
    }

    #[test]
    fn arguments_name_the_package_its_judges_and_the_diff() {
        let scope = find_scope("reference").unwrap();
        let args = cargo_mutants_args(scope, Path::new("/o"), Selection::Diff(Path::new("/d.patch")), MINUTE);
        let joined = args.join(" ");
        assert!(joined.starts_with("mutants --in-place"), "{joined}");
        assert!(joined.contains("--package attnproof-reference"), "{joined}");
        assert!(joined.contains("--test-package attnproof-reference --test-package attnproof-harness"), "{joined}");
        assert!(joined.contains("--output /o --exclude"), "{joined}");
        assert!(joined.contains("--in-diff /d.patch --cargo-arg"), "{joined}");
        let whole = cargo_mutants_args(scope, Path::new("/o"), Selection::Whole, MINUTE);
        assert!(!whole.iter().any(|a| a == "--in-diff" || a == "--iterate"), "{whole:?}");
        let resumed = cargo_mutants_args(scope, Path::new("/o"), Selection::Resume, MINUTE).join(" ");
        assert!(resumed.contains("sparse/** --iterate --cargo-arg"), "{resumed}");
        let shard = Shard { index: 2, count: 5 };
        let sliced = cargo_mutants_args(scope, Path::new("/o"), Selection::Shard { shard, resume: false }, MINUTE);
        let sliced = sliced.join(" ");
        assert!(sliced.contains("sparse/** --shard=2/5 --sharding=round-robin --cargo-arg"), "{sliced}");
        // The rest of a slice: by name, anchored and escaped, with --iterate and without --shard.
        let names = ["a.rs:1:2: replace + with - in f".to_owned(), "b.rs:3:4: replace g -> u8 with 0".to_owned()];
        let rest = cargo_mutants_args(scope, Path::new("/o"), Selection::SliceRest { shard, names: &names }, MINUTE);
        let rest = rest.join(" ");
        let expected = r"sparse/** --iterate --re=^a\.rs:1:2: replace \+ with \- in f$ --re=^b\.rs:3:4: replace g \-> u8 with 0$ --cargo-arg";
        assert!(rest.contains(expected), "{rest}");
        assert_eq!(
            output_dir(Path::new("/r"), scope, Selection::SliceRest { shard, names: &names }),
            output_dir(Path::new("/r"), scope, Selection::Shard { shard, resume: true }),
            "the rest of a slice goes on in the slice's record"
        );
        assert!(!rest.contains("--shard"), "{rest}");
        let verdict =
            cargo_mutants_args(find_scope("verdict").unwrap(), Path::new("/o"), Selection::Whole, MINUTE).join(" ");
        assert!(verdict.contains("--exclude tests/src/flash.rs"), "{verdict}");
        assert!(
            verdict.ends_with(
                "--cargo-arg=--lib --cargo-arg=--test=it -- verdict:: gate:: block_selection:: dsa_index:: dsa_loss:: pyramid_selection:: pyramid_diagnostics:: pisa_tail pisa_covariance:: hils case:: check_ recipe::"
            ),
            "{verdict}"
        );
        assert!(joined.contains("--exclude reference/src/ring/** --exclude reference/src/sparse/**"), "{joined}");
        assert!(joined.ends_with("--test=it -- flash_forward:: flash_backward::"), "{joined}");
        let proofs =
            cargo_mutants_args(find_scope("proofs").unwrap(), Path::new("/o"), Selection::Whole, MINUTE).join(" ");
        assert!(proofs.ends_with("--cargo-arg=--lib --cargo-arg=--tests"), "{proofs}");
        // cargo-mutants' own baseline would run the mutated package's tests only; xtask's replaces it.
        assert!(joined.contains("--baseline=skip --timeout=60 --output"), "{joined}");
    }

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn the_baseline_runs_what_judges_a_mutant() {
        let scope = find_scope("reference-sparse").unwrap();
        let build = baseline_args(scope, "mutants", true).join(" ");
        assert_eq!(
            build,
            "nextest run --no-run --cargo-profile=mutants --package=attnproof-reference --package=attnproof-harness \
             --lib --test=it"
        );
        let run = baseline_args(scope, "mutants", false).join(" ");
        assert_eq!(
            run,
            "nextest run --cargo-profile=mutants --package=attnproof-reference --package=attnproof-harness --lib \
             --test=it sparse::"
        );
    }

    #[test]
    fn a_mutant_may_run_three_baselines_but_never_less_than_a_minute() {
        let config = std::fs::read_to_string(crate::repo_root().join(CONFIG)).unwrap();
        assert_eq!(config_value(&config, "profile").unwrap(), "mutants");
        assert_eq!(test_timeout(&config, Duration::from_secs(5)).unwrap(), MINUTE);
        assert_eq!(test_timeout(&config, Duration::from_millis(30_100)).unwrap(), Duration::from_secs(91));
        let broken = "timeout_multiplier = three\nminimum_test_timeout = 60";
        assert!(test_timeout(broken, MINUTE).unwrap_err().to_string().contains("not a number"));
        assert!(config_value("# timeout_multiplier = 3", "timeout_multiplier").is_err());
    }
}
