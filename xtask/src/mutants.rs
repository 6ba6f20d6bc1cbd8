//! `cargo xtask mutants`: applies every mutant of the catalog to a scratch copy of the repository and checks that the
//! tests kill it; also the captured, time-limited child runs and libtest parsing that `fuzz` shares.
//!
//! Mutant runs use `PROPTEST_CASES=64` and a fixed `PROPTEST_RNG_SEED` (the defaults of `--cases` and `--seed` in
//! [`crate::flags`]), so the table is the
//! same from one run to the next and a mutant that survives can be rerun with a larger budget (`--cases`) to tell a
//! weak test from an equivalent mutant.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::cargo_mutants::{self, Fate, MutantOutcome, Scope, Selection, Shard, Tally};
use crate::flags::Parsed;
use crate::parse::{TestCounts, parse_test_result};
use crate::process::{cargo, describe, ensure_m4, nvrtc_env};
use attnproof_catalog::{Mutant, Runner, Stale};

/// Upper bound on proptest's shrinking after a failure, in milliseconds: a mutant only needs to fail, and an
/// unbounded shrink of a large case could otherwise eat the whole timeout.
const MAX_SHRINK_TIME_MS: u32 = 20_000;

/// What `cargo xtask mutants` is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// Run the catalog's CPU mutants (all, or those named with `--only`).
    Catalog,
    /// `--list`: print the catalog.
    List,
    /// `--scope NAME...`: cargo-mutants over whole scopes (a crate, or part of one), or over one slice of each
    /// (`--shard K/N`); with `--resume`, on from each scope's (or slice's) last record.
    Scopes(Vec<String>, ScopeRun),
    /// `--diff [REV]`: cargo-mutants and the catalog over the code changed since `REV` (default: the merge base).
    Diff(Option<String>),
}

/// Options of `cargo xtask mutants`, from the flags declared in [`crate::flags::COMMANDS`] (defaults there too).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Options {
    mode: Mode,
    only: Vec<String>,
    cases: u64,
    seed: u64,
    timeout: Duration,
}

impl Options {
    /// The options, or an error for flags that do not go together (`--diff` picks its own mutants, so it takes
    /// neither `--only` nor `--scope`; a revision means nothing without `--diff`).
    fn from_flags(flags: &Parsed) -> Result<Options> {
        let int = |name| flags.int(name).unwrap_or_else(|| panic!("{name} has a default"));
        let only = flags.texts("--only");
        let scopes = flags.texts("--scope");
        let list = flags.switch("--list");
        let diff = flags.switch("--diff");
        let resume = flags.switch("--resume");
        let shard = flags.text("--shard").map(|s| Shard::parse(&s)).transpose()?;
        let rev = flags.operands.first().map(|r| r.to_string_lossy().into_owned());
        let picked = [list, diff, !scopes.is_empty()].into_iter().filter(|&b| b).count();
        if picked > 1 {
            bail!("--list, --diff and --scope each pick the mutants to run; give one of them");
        }
        if (diff || !scopes.is_empty()) && !only.is_empty() {
            bail!("--only names catalog mutants; it does not combine with --diff or --scope");
        }
        if resume && scopes.is_empty() {
            bail!("--resume goes on from a scope's last record; give the scope (`--scope NAME --resume`)");
        }
        if shard.is_some() && scopes.is_empty() {
            bail!("--shard takes one slice of a scope's mutants; give the scope (`--scope NAME --shard K/N`)");
        }
        if let (false, Some(rev)) = (diff, &rev) {
            bail!("`{rev}`: a revision is only taken with --diff (`cargo xtask mutants --diff {rev}`)");
        }
        let mode = match (list, diff, scopes.is_empty()) {
            (true, _, _) => Mode::List,
            (_, true, _) => Mode::Diff(rev),
            (_, _, false) => Mode::Scopes(scopes, ScopeRun { resume, shard }),
            _ => Mode::Catalog,
        };
        Ok(Options {
            mode,
            only,
            cases: int("--cases"),
            seed: int("--seed"),
            timeout: Duration::from_secs(int("--timeout")),
        })
    }
}

/// How a `--scope` run takes each scope's mutants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ScopeRun {
    resume: bool,
    shard: Option<Shard>,
}

impl ScopeRun {
    fn selection(self) -> Selection<'static> {
        match (self.shard, self.resume) {
            (Some(shard), resume) => Selection::Shard { shard, resume },
            (None, true) => Selection::Resume,
            (None, false) => Selection::Whole,
        }
    }
}

/// What became of one mutant.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// At least one test failed; the names of the failing tests (or of the crashed binaries).
    Killed(Vec<String>),
    /// The mutated source did not compile: counted as killed, flagged because such a mutant tests nothing.
    CompileError,
    /// The tests ran past the timeout: counted as killed (a hang is a detected change).
    Timeout,
    /// Every test passed on the mutated source.
    Survived,
    /// The mutant's find text no longer occurs exactly once.
    Stale(String),
}

impl Outcome {
    /// Whether the run counts the mutant as detected.
    fn is_killed(&self) -> bool {
        matches!(self, Outcome::Killed(_) | Outcome::CompileError | Outcome::Timeout)
    }

    fn status(&self) -> &'static str {
        match self {
            Outcome::Killed(_) => "killed",
            Outcome::CompileError => "compile-error",
            Outcome::Timeout => "timeout",
            Outcome::Survived => "SURVIVED",
            Outcome::Stale(_) => "STALE",
        }
    }

    fn detail(&self) -> String {
        match self {
            Outcome::Killed(tests) => tests.join(", "),
            Outcome::CompileError => "(does not compile: a weak mutant, see its log)".to_owned(),
            Outcome::Timeout => "(test run hung past the timeout)".to_owned(),
            Outcome::Survived => "(no test failed)".to_owned(),
            Outcome::Stale(why) => why.clone(),
        }
    }
}

/// `cargo xtask mutants`.
pub fn mutants(root: &Path, flags: &Parsed) -> Result<ExitCode> {
    let options = Options::from_flags(flags)?;
    match &options.mode {
        Mode::List => {
            print_catalog(root, &select(&options.only)?);
            Ok(ExitCode::SUCCESS)
        }
        Mode::Catalog => catalog(root, &options),
        Mode::Scopes(names, run) => scopes(root, &options, names, *run),
        Mode::Diff(rev) => diff(root, &options, rev.as_deref()),
    }
}

/// The catalog's CPU mutants (all, or `--only`), one table, success only when every one is killed.
fn catalog(root: &Path, options: &Options) -> Result<ExitCode> {
    let selected = select(&options.only)?;
    let (cpu, gpu) = split_by_machine(&selected);
    if !options.only.is_empty()
        && let Some(m) = gpu.first()
    {
        bail!("{}", gpu_elsewhere(m));
    }
    if !gpu.is_empty() {
        println!(
            "mutants: {} GPU mutants are not run here (`cargo xtask mutants --list` says where each runs)",
            gpu.len()
        );
    }
    ensure_m4()?;
    let tree = ScratchTree::create(root)?;
    let results = run_catalog(root, &tree, &cpu, options)?;
    print_table(&results);
    let count = |f: fn(&Outcome) -> bool| results.iter().filter(|(_, o, _)| f(o)).count();
    let killed = count(Outcome::is_killed);
    let compile_errors = count(|o| matches!(o, Outcome::CompileError));
    let timeouts = count(|o| matches!(o, Outcome::Timeout));
    let survived = count(|o| matches!(o, Outcome::Survived));
    let stale = count(|o| matches!(o, Outcome::Stale(_)));
    println!("logs: {}", logs_dir(root).display());
    if compile_errors > 0 {
        println!(
            "note: {compile_errors} mutant(s) did not compile; they count as killed but test nothing: make them compile"
        );
    }
    println!(
        "mutants: {killed} killed ({compile_errors} compile errors, {timeouts} timeouts), {survived} survived, {stale} \
         stale, of {}",
        results.len()
    );
    Ok(if killed == results.len() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Where the catalog runner writes its logs.
fn logs_dir(root: &Path) -> PathBuf {
    root.join("target").join("mutants").join("logs")
}

/// Runs catalog CPU mutants in `tree`: first the unmutated baseline of every package they test (which must pass, or
/// a failure would say nothing about a mutant), then each mutant, logging every run.
fn run_catalog(
    root: &Path,
    tree: &ScratchTree,
    cpu: &[CpuMutant],
    options: &Options,
) -> Result<Vec<(&'static Mutant, Outcome, Duration)>> {
    let logs = logs_dir(root);
    recreate_dir(&logs)?;
    let env = TestEnv { target_dir: tree.target_dir.clone(), cases: options.cases, seed: options.seed };

    // The baseline's output streams to the terminal, because the first run compiles everything.
    let packages: BTreeSet<&str> = cpu.iter().map(|(_, package, _)| *package).collect();
    for package in &packages {
        let args = ["test", "-p", package, "--no-fail-fast"].map(str::to_owned);
        println!("mutants: baseline `cargo {}` (PROPTEST_CASES={})", args.join(" "), options.cases);
        let mut cmd = env.command(&tree.dir, &args);
        let run = run_captured(&mut cmd, None, |line| eprintln!("{line}"), || {})?;
        let log = logs.join(format!("baseline-{package}.log"));
        write_log(&log, &cmd, &run)?;
        let counts = test_counts(&run.lines);
        if !run.succeeded() || counts.passed == 0 {
            bail!(
                "baseline failed: `{}` does not pass on the unmutated copy in {} ({} passed, {} failed); fix the tree \
                 before running mutants (log: {})",
                describe(&cmd),
                tree.dir.display(),
                counts.passed,
                counts.failed,
                log.display()
            );
        }
        println!("mutants: baseline ok ({} tests passed)", counts.passed);
    }

    let mut results: Vec<(&'static Mutant, Outcome, Duration)> = Vec::new();
    for (index, &(m, _, ref test_args)) in cpu.iter().enumerate() {
        print!("[{}/{}] {} ... ", index + 1, cpu.len(), m.name);
        flush_stdout();
        let started = Instant::now();
        let mut cmd = env.command(&tree.dir, test_args);
        // A stale mutant is reported without running anything, so one that cannot apply never hides behind the
        // baseline.
        let outcome = match tree.with_mutant(m, || run_captured(&mut cmd, Some(options.timeout), |_| {}, || {}))? {
            Err(stale) => Outcome::Stale(format!("{}: {stale}", m.file)),
            Ok(run) => {
                let run = run?;
                write_log(&logs.join(format!("{}.log", m.name)), &cmd, &run)?;
                classify(&run)
            }
        };
        let elapsed = started.elapsed();
        println!("{} ({:.1}s)", outcome.status(), elapsed.as_secs_f64());
        results.push((m, outcome, elapsed));
    }
    Ok(results)
}

/// `--scope NAME...`: cargo-mutants over each whole scope, its survivors checked against
/// [`cargo_mutants::EQUIVALENT_LIST`]; success only when no scope has an unexplained survivor or a stale entry.
fn scopes(root: &Path, options: &Options, names: &[String], run: ScopeRun) -> Result<ExitCode> {
    let scopes: Vec<&Scope> = if names.iter().any(|n| n == "all") {
        cargo_mutants::SCOPES.iter().collect()
    } else {
        names.iter().map(|n| cargo_mutants::find_scope(n)).collect::<Result<_>>()?
    };
    cargo_mutants::ensure_installed(root)?;
    ensure_m4()?;
    let globs = cargo_mutants::examine_globs(&read(root, cargo_mutants::CONFIG)?)?;
    let equivalent = equivalent_list(root)?;
    let tracked = tracked_files(root)?;
    let tree = ScratchTree::create(root)?;
    let env = TestEnv { target_dir: tree.target_dir.clone(), cases: options.cases, seed: options.seed };
    let mut summary = Vec::new();
    let mut clean = true;
    for scope in scopes {
        let files: BTreeSet<String> = tracked.iter().filter(|f| scope.owns(&globs, f)).cloned().collect();
        let started = Instant::now();
        let mut outcomes = run_cargo_mutants(root, &tree, scope, run.selection(), &env)?;
        let stale = if run.shard.is_some() {
            // A slice generates a part of each file's mutants: an entry is stale only when the whole scope's list
            // (`cargo mutants --list`, seconds) no longer names it.
            cargo_mutants::apply_equivalents(&mut outcomes, &equivalent, &BTreeSet::new());
            let out = cargo_mutants::output_dir(root, scope, run.selection());
            let listed = list_mutants(&tree, scope, Selection::Whole, &out, &env)?;
            cargo_mutants::stale_entries(&equivalent, &files, &listed.iter().map(String::as_str).collect())
        } else {
            cargo_mutants::apply_equivalents(&mut outcomes, &equivalent, &files)
        };
        let tally = Tally::of(&outcomes);
        let minutes = started.elapsed().as_secs_f64() / 60.0;
        for o in outcomes.iter().filter(|o| o.fate != Fate::Caught) {
            println!("{:<10} {}", o.fate.word(), o.name);
        }
        for name in &stale {
            println!("STALE      {name}: listed in {} but no longer generated", cargo_mutants::EQUIVALENT_LIST);
        }
        // A slice tests only part of each file, so only a whole run marks the files tested; a slice without an
        // unexplained survivor or a stale entry still succeeds.
        let explained = tally.missed == 0 && stale.is_empty();
        if explained && run.shard.is_none() {
            cargo_mutants::record_tested(root, &files)?;
        }
        clean &= explained;
        summary.push(format!("{:<10} {tally}, {} stale entries, {minutes:.1} min", scope.name, stale.len()));
    }
    println!();
    for line in &summary {
        println!("{line}");
    }
    Ok(if clean { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `--diff [REV]`: cargo-mutants on the lines changed since `rev` in every crate they touch, then the catalog's
/// mutants anchored in changed files; one table, success only when nothing survives unexplained.
fn diff(root: &Path, options: &Options, rev: Option<&str>) -> Result<ExitCode> {
    let base = cargo_mutants::base_revision(root, rev)?;
    let (patch, changed) = cargo_mutants::diff_since(root, &base)?;
    let globs = cargo_mutants::examine_globs(&read(root, cargo_mutants::CONFIG)?)?;
    let scopes = cargo_mutants::scopes_touched(&globs, &changed);
    let anchored: Vec<&'static Mutant> = attnproof_catalog::all().filter(|m| changed.contains(m.file)).collect();
    let (cpu, gpu) = split_by_machine(&anchored);
    let in_scope: BTreeSet<String> = changed.iter().filter(|f| cargo_mutants::in_scope(&globs, f)).cloned().collect();
    println!(
        "mutants --diff: {} changed file(s) since {}; {} in cargo-mutants' scope ({}); {} catalog mutant(s) anchored \
         in them ({} run here)",
        changed.len(),
        &base[..base.len().min(12)],
        in_scope.len(),
        scopes.iter().map(|s| s.name).collect::<Vec<_>>().join(", "),
        anchored.len(),
        cpu.len()
    );
    if scopes.is_empty() && anchored.is_empty() {
        println!("mutants --diff: nothing to mutate");
        return Ok(ExitCode::SUCCESS);
    }
    if !scopes.is_empty() {
        cargo_mutants::ensure_installed(root)?;
    }
    ensure_m4()?;
    let equivalent = equivalent_list(root)?;
    let tree = ScratchTree::create(root)?;
    let patch_path = root.join("target").join("mutants").join("diff.patch");
    std::fs::write(&patch_path, &patch).with_context(|| format!("writing {}", patch_path.display()))?;
    let env = TestEnv { target_dir: tree.target_dir.clone(), cases: options.cases, seed: options.seed };

    let mut rows: Vec<[String; 3]> = Vec::new();
    let mut explained = true;
    for scope in &scopes {
        let mut outcomes = run_cargo_mutants(root, &tree, scope, Selection::Diff(&patch_path), &env)?;
        // Stale entries are only judged by full scope runs: a diff run generates the changed lines' mutants only.
        cargo_mutants::apply_equivalents(&mut outcomes, &equivalent, &BTreeSet::new());
        explained &= outcomes.iter().all(|o| o.fate.is_explained());
        rows.extend(outcomes.into_iter().map(|o| ["cargo-mutants".to_owned(), o.name, o.fate.word().to_owned()]));
    }
    let results = if cpu.is_empty() { Vec::new() } else { run_catalog(root, &tree, &cpu, options)? };
    explained &= results.iter().all(|(_, o, _)| o.is_killed());
    rows.extend(results.iter().map(|(m, o, _)| ["catalog".to_owned(), m.name.to_owned(), o.status().to_owned()]));
    rows.extend(gpu.iter().map(|m| ["catalog".to_owned(), m.name.to_owned(), "not run here (GPU host)".to_owned()]));

    println!();
    let width = rows.iter().map(|r| r[0].len()).max().unwrap_or(0);
    let status_width = rows.iter().map(|r| r[2].len()).max().unwrap_or(0);
    for [source, name, status] in &rows {
        println!("{source:<width$} | {status:<status_width$} | {name}");
    }
    let missed = rows.iter().filter(|r| r[2] == Fate::Missed.word() || r[2] == "SURVIVED" || r[2] == "STALE").count();
    println!("mutants --diff: {} mutants, {missed} survived unexplained", rows.len());
    if explained {
        cargo_mutants::record_tested(root, &in_scope)?;
    }
    Ok(if explained { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Runs cargo-mutants over `scope` in the scratch copy (its progress streams to the terminal) and reads its outcomes.
fn run_cargo_mutants(
    root: &Path,
    tree: &ScratchTree,
    scope: &Scope,
    selection: Selection<'_>,
    env: &TestEnv,
) -> Result<Vec<MutantOutcome>> {
    let out = cargo_mutants::output_dir(root, scope, selection);
    // A run that finds no mutant writes no outcome files, so those of an earlier run must not be there to be read. A
    // resumed run reads them (cargo-mutants carries the caught and unviable ones into `previously_caught.txt`).
    if !matches!(selection, Selection::Resume | Selection::Shard { resume: true, .. }) {
        recreate_dir(&out)?;
    }
    // A slice is resumed by name: the names of the whole slice first, then its rest.
    let slice = match selection {
        Selection::Shard { shard, resume: true } => Some((shard, list_slice(tree, scope, shard, &out, env)?)),
        _ => None,
    };
    let selection = match &slice {
        Some((shard, names)) => Selection::SliceRest { shard: *shard, names },
        None => selection,
    };
    let timeout = baseline(root, tree, scope, env)?;
    let mut cmd = env.command(&tree.dir, &cargo_mutants::cargo_mutants_args(scope, &out, selection, timeout));
    println!("$ {}", describe(&cmd));
    let status = cmd.status().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
    cargo_mutants::check_exit(status.code(), &cmd)?;
    let mut outcomes = cargo_mutants::read_outcomes(&out.join("mutants.out"))?;
    // The record may carry mutants of other slices (an earlier run that sliced after `--iterate`): count the slice's.
    if let Some((_, names)) = &slice {
        let names: BTreeSet<&str> = names.iter().map(String::as_str).collect();
        outcomes.retain(|o| names.contains(o.name.as_str()));
    }
    Ok(outcomes)
}

/// The names of the mutants of `scope`'s slice `shard`, as `cargo mutants --list` gives them with the slice's own
/// arguments.
fn list_slice(tree: &ScratchTree, scope: &Scope, shard: Shard, out: &Path, env: &TestEnv) -> Result<Vec<String>> {
    list_mutants(tree, scope, Selection::Shard { shard, resume: false }, out, env)
}

/// The names of the mutants `selection` takes of `scope`, as `cargo mutants --list` gives them (nothing is built).
fn list_mutants(
    tree: &ScratchTree,
    scope: &Scope,
    selection: Selection<'_>,
    out: &Path,
    env: &TestEnv,
) -> Result<Vec<String>> {
    let mut args = cargo_mutants::cargo_mutants_args(scope, out, selection, Duration::from_secs(60));
    args.insert(1, "--list".to_owned());
    let mut cmd = env.command(&tree.dir, &args);
    println!("$ {}", describe(&cmd));
    let output = cmd.output().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
    if !output.status.success() {
        bail!("`{}` failed: {}", describe(&cmd), String::from_utf8_lossy(&output.stderr));
    }
    let names = cargo_mutants::listed_names(&String::from_utf8_lossy(&output.stdout));
    if names.is_empty() {
        bail!("`{}` listed no mutant", describe(&cmd));
    }
    Ok(names)
}

/// Runs `scope`'s judging tests on the unmutated scratch copy (built first, then timed) and returns how long one
/// mutant's tests may take; fails, as cargo-mutants' own baseline would, when the unmutated tests fail.
fn baseline(root: &Path, tree: &ScratchTree, scope: &Scope, env: &TestEnv) -> Result<Duration> {
    let config = read(root, cargo_mutants::CONFIG)?;
    let profile = cargo_mutants::config_value(&config, "profile")?;
    let mut build = env.command(&tree.dir, &cargo_mutants::baseline_args(scope, profile, true));
    println!("$ {}", describe(&build));
    let status = build.status().with_context(|| format!("could not start `{}`", describe(&build)))?;
    if !status.success() {
        bail!("`{}`: the unmutated copy does not build; fix it before mutating", describe(&build));
    }
    let mut run = env.command(&tree.dir, &cargo_mutants::baseline_args(scope, profile, false));
    println!("$ {}", describe(&run));
    let started = Instant::now();
    let status = run.status().with_context(|| format!("could not start `{}`", describe(&run)))?;
    let elapsed = started.elapsed();
    if !status.success() {
        bail!("`{}`: the tests fail on the unmutated copy (the baseline); fix them before mutating", describe(&run));
    }
    let timeout = cargo_mutants::test_timeout(&config, elapsed)?;
    println!(
        "baseline: {} tests ran in {:.1}s; each mutant's tests stop after {}s",
        scope.name,
        elapsed.as_secs_f64(),
        timeout.as_secs()
    );
    Ok(timeout)
}

/// The entries of [`cargo_mutants::EQUIVALENT_LIST`] (none when the file does not exist yet).
fn equivalent_list(root: &Path) -> Result<BTreeMap<String, String>> {
    match std::fs::read_to_string(root.join(cargo_mutants::EQUIVALENT_LIST)) {
        Ok(text) => cargo_mutants::parse_equivalent_list(&text),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(err) => Err(err).context(format!("reading {}", cargo_mutants::EQUIVALENT_LIST)),
    }
}

/// A file of the repository, as text.
fn read(root: &Path, relative: &str) -> Result<String> {
    std::fs::read_to_string(root.join(relative)).with_context(|| format!("reading {relative}"))
}

/// The files git tracks, relative to `root`.
fn tracked_files(root: &Path) -> Result<BTreeSet<String>> {
    Ok(cargo_mutants::git(root, &["ls-files"])?.lines().map(str::to_owned).collect())
}

/// A CPU mutant with its package and the arguments of the `cargo` command that must fail once it is applied.
type CpuMutant = (&'static Mutant, &'static str, Vec<String>);

/// Splits mutants into those `cargo xtask mutants` runs here ([`Runner::Scratch`]) and those that run on a GPU host.
fn split_by_machine(selected: &[&'static Mutant]) -> (Vec<CpuMutant>, Vec<&'static Mutant>) {
    let mut cpu = Vec::new();
    let mut gpu = Vec::new();
    for &m in selected {
        match (m.runner, m.cargo_test_args()) {
            (Runner::Scratch { package, .. }, Some(args)) => cpu.push((m, package, args)),
            _ => gpu.push(m),
        }
    }
    (cpu, gpu)
}

/// The message for `--only` naming a GPU mutant: where it runs instead.
fn gpu_elsewhere(m: &Mutant) -> String {
    format!(
        "mutant `{}` runs on a GPU host, not here ({}): build the bundle with `cargo xtask gpu-bundle` and run `bash \
         gpu-bundle/run.sh mutants` there",
        m.name,
        m.runner.location()
    )
}

/// The mutants to run: all of them, or those named with `--only` (an unknown name is an error listing the names).
fn select(only: &[String]) -> Result<Vec<&'static Mutant>> {
    if only.is_empty() {
        return Ok(attnproof_catalog::all().collect());
    }
    only.iter()
        .map(|name| {
            attnproof_catalog::find(name).with_context(|| {
                let names: Vec<&str> = attnproof_catalog::all().map(|m| m.name).collect();
                format!("no mutant named `{name}`; the catalog holds: {}", names.join(", "))
            })
        })
        .collect()
}

/// `--list`: every mutant with its file, whether it applies to the working tree, where it runs, and what it models.
fn print_catalog(root: &Path, mutants: &[&Mutant]) {
    let width = mutants.iter().map(|m| m.name.len()).max().unwrap_or(0);
    for m in mutants {
        let state = match std::fs::read_to_string(root.join(m.file)) {
            Ok(source) => match m.apply(&source) {
                Ok(_) => "applies".to_owned(),
                Err(stale) => format!("STALE: {stale}"),
            },
            Err(err) => format!("STALE: cannot read the file ({err})"),
        };
        println!("{:<width$}  {}  [{}]  {}", m.name, m.file, state, m.runner.location());
        println!("{:<width$}  {}", "", m.description);
    }
    let on_cpu = mutants.iter().filter(|m| m.runner.runs_on_cpu()).count();
    println!("{} mutants ({on_cpu} run here, {} on a GPU host)", mutants.len(), mutants.len() - on_cpu);
}

/// Prints the final table: mutant | status | killing test(s).
fn print_table(results: &[(&Mutant, Outcome, Duration)]) {
    let rows: Vec<[String; 4]> = results
        .iter()
        .map(|(m, o, t)| [m.name.to_owned(), o.status().to_owned(), format!("{:.0}s", t.as_secs_f64()), o.detail()])
        .collect();
    let header = ["mutant", "status", "time", "killing test(s)"].map(str::to_owned);
    let widths: Vec<usize> =
        (0..3).map(|c| rows.iter().chain([&header]).map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    println!();
    for row in std::iter::once(&header).chain(&rows) {
        println!(
            "{:<w0$} | {:<w1$} | {:>w2$} | {}",
            row[0],
            row[1],
            row[2],
            row[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
    }
}

/// Environment and target directory shared by every cargo run on the scratch copy.
struct TestEnv {
    target_dir: PathBuf,
    cases: u64,
    seed: u64,
}

impl TestEnv {
    /// A cargo command run in the scratch copy, building into the shared mutants target directory so that only the
    /// mutated crate and its dependents are rebuilt per mutant.
    fn command(&self, scratch: &Path, args: &[String]) -> Command {
        let mut cmd = cargo(scratch);
        cmd.args(args)
            .env("CARGO_TARGET_DIR", &self.target_dir)
            .env("CARGO_TERM_COLOR", "never")
            .env("PROPTEST_CASES", self.cases.to_string())
            .env("PROPTEST_RNG_SEED", self.seed.to_string())
            .env("PROPTEST_MAX_SHRINK_TIME", MAX_SHRINK_TIME_MS.to_string())
            // NVRTC for the kernels' compile-only tests (the kernel-text mutants' killers).
            .envs(nvrtc_env())
            // Backtraces would be printed (and symbolized, slowly) for every panic proptest catches while shrinking.
            .env("RUST_BACKTRACE", "0");
        cmd
    }
}

/// A scratch copy of the repository under `target/mutants/src`, with the target directory every build of a mutant
/// shares (`target/mutants/target`), so that dependencies compile once and each mutant rebuilds only the crates it
/// touches. `cargo xtask mutants` and `cargo xtask gpu-bundle` both patch mutants into it.
pub struct ScratchTree {
    /// The repository the copy was made from.
    root: PathBuf,
    /// The copy.
    pub dir: PathBuf,
    /// The shared `CARGO_TARGET_DIR` of builds in the copy.
    pub target_dir: PathBuf,
    /// The copied files, relative to both roots.
    pristine: BTreeSet<PathBuf>,
}

impl ScratchTree {
    /// Copies the repository at `root` into a freshly emptied `target/mutants/src`.
    pub fn create(root: &Path) -> Result<ScratchTree> {
        let mutants_dir = root.join("target").join("mutants");
        let dir = mutants_dir.join("src");
        println!("mutants: copying the repository to {}", dir.display());
        let pristine = copy_repository(root, &dir)?;
        Ok(ScratchTree { root: root.to_path_buf(), dir, target_dir: mutants_dir.join("target"), pristine })
    }

    /// Applies `m` to the copy, runs `body`, and restores the copy (the mutated file and any proptest regression file
    /// the run wrote) before returning `body`'s result; `Err(Stale)` without running anything when `m` no longer
    /// applies.
    pub fn with_mutant<R>(&self, m: &Mutant, body: impl FnOnce() -> R) -> Result<Result<R, Stale>> {
        let path = self.dir.join(m.file);
        let original = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let mutated = match m.apply(&original) {
            Ok(mutated) => mutated,
            Err(stale) => return Ok(Err(stale)),
        };
        std::fs::write(&path, mutated).with_context(|| format!("writing {}", path.display()))?;
        let result = body();
        // Restore before the caller looks at the result, so that an error there cannot leave the next mutant (or a
        // rerun of this one) applied on top of a mutated file.
        std::fs::write(&path, original).with_context(|| format!("restoring {}", path.display()))?;
        restore_regressions(&self.root, &self.dir, &self.pristine)?;
        Ok(Ok(result))
    }
}

/// Copies the files git knows about (tracked, plus untracked ones that are not ignored) from `root` into a freshly
/// emptied `scratch`, returning their relative paths. Build outputs, being ignored, stay behind.
fn copy_repository(root: &Path, scratch: &Path) -> Result<BTreeSet<PathBuf>> {
    let mut files = BTreeSet::new();
    for extra in [&["ls-files", "-z"][..], &["ls-files", "-z", "--others", "--exclude-standard"][..]] {
        let out = Command::new("git")
            .args(extra)
            .current_dir(root)
            .stderr(Stdio::inherit())
            .output()
            .context("could not run `git ls-files` (is git installed?)")?;
        if !out.status.success() {
            bail!("`git {}` failed in {} (is it a git checkout?)", extra.join(" "), root.display());
        }
        files.extend(
            out.stdout
                .split(|b| *b == 0)
                .filter(|p| !p.is_empty())
                .map(|p| PathBuf::from(String::from_utf8_lossy(p).into_owned())),
        );
    }
    recreate_dir(scratch)?;
    let mut copied = BTreeSet::new();
    for file in files {
        let from = root.join(&file);
        // A tracked file deleted in the working tree is still listed by git; the copy mirrors the working tree.
        if !from.is_file() {
            continue;
        }
        let to = scratch.join(&file);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::copy(&from, &to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        copied.insert(file);
    }
    if copied.is_empty() {
        bail!("git lists no files in {}", root.display());
    }
    Ok(copied)
}

/// Deletes a directory if it exists and creates it empty.
pub fn recreate_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

/// Whether a path is a proptest failure-persistence file: `<test>.proptest-regressions` next to a test, or a file
/// under a `proptest-regressions/` directory.
pub fn is_regression_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "proptest-regressions")
        || path.components().any(|c| c.as_os_str() == "proptest-regressions")
}

/// The regression files under `dir`, skipping build output and hidden directories.
pub fn regression_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if path.is_dir() {
                if name != "target" && !name.to_string_lossy().starts_with('.') {
                    stack.push(path);
                }
            } else if is_regression_file(&path) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Puts the scratch copy's proptest regression files back as they were copied: a failing mutant makes proptest
/// record its seed, and without this every later mutant would replay the seeds that killed earlier ones, so a
/// mutant's verdict would depend on its place in the catalog.
fn restore_regressions(root: &Path, scratch: &Path, pristine: &BTreeSet<PathBuf>) -> Result<()> {
    for path in regression_files(scratch) {
        let relative = path.strip_prefix(scratch).unwrap_or(&path).to_path_buf();
        if pristine.contains(&relative) {
            std::fs::copy(root.join(&relative), &path).with_context(|| format!("restoring {}", path.display()))?;
        } else {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// The mutant's fate from its test run.
fn classify(run: &Captured) -> Outcome {
    if run.timed_out() {
        return Outcome::Timeout;
    }
    if run.succeeded() {
        return Outcome::Survived;
    }
    let failed = failed_tests(&run.stdout, &run.stderr);
    if !failed.is_empty() {
        return Outcome::Killed(failed);
    }
    if compile_failed(&run.lines) {
        return Outcome::CompileError;
    }
    // A test binary that died without libtest reporting a failure (abort, stack overflow, signal) still detected the
    // mutant; name the binary from cargo's own error line.
    let crashed: Vec<String> = run
        .lines
        .iter()
        .filter_map(|l| l.trim().strip_prefix("error: test failed, to rerun pass "))
        .map(|rest| format!("crash: {}", rest.trim_matches('`')))
        .collect();
    if crashed.is_empty() {
        Outcome::Killed(vec!["(cargo test failed; see log)".to_owned()])
    } else {
        Outcome::Killed(crashed)
    }
}

/// Writes a run's command, exit status and merged output to `path`.
pub fn write_log(path: &Path, cmd: &Command, run: &Captured) -> Result<()> {
    let envs: Vec<String> =
        cmd.get_envs().filter_map(|(k, v)| Some(format!("{}={}", k.to_string_lossy(), v?.to_string_lossy()))).collect();
    let status = match run.status {
        Some(s) => s.to_string(),
        None => "killed after the timeout".to_owned(),
    };
    let text = format!(
        "$ {} {}\n# exit: {status}; {:.1}s\n\n{}\n",
        envs.join(" "),
        describe(cmd),
        run.elapsed.as_secs_f64(),
        run.lines.join("\n")
    );
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn flush_stdout() {
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

// --- Captured child runs, shared with `fuzz` ---

/// The result of [`run_captured`].
#[derive(Debug)]
pub struct Captured {
    /// The exit status, or `None` when the run was killed at its timeout.
    pub status: Option<ExitStatus>,
    /// stdout and stderr lines, interleaved roughly in the order they arrived (for logs; the two streams are read
    /// by separate threads, so lines of different streams may trade places).
    pub lines: Vec<String>,
    /// stdout lines alone, in order.
    pub stdout: Vec<String>,
    /// stderr lines alone, in order.
    pub stderr: Vec<String>,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl Captured {
    /// Whether the run was killed at its timeout.
    pub fn timed_out(&self) -> bool {
        self.status.is_none()
    }
    /// Whether the run exited successfully.
    pub fn succeeded(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

/// How often the watcher wakes to call `on_tick` and check the timeout.
const TICK: Duration = Duration::from_millis(100);

/// Runs `cmd` with stdout and stderr captured line by line (each line also handed to `on_line` as it arrives), calling
/// `on_tick` at least every [`TICK`], and killing the command and every process it started once `timeout` has passed.
///
/// Killing the whole tree matters: cargo runs the test binary as its child, and a hung test binary would otherwise
/// outlive cargo and keep the pipes, and this function, waiting forever. The child stays in our process group, so
/// Ctrl-C still reaches it.
pub fn run_captured(
    cmd: &mut Command,
    timeout: Option<Duration>,
    mut on_line: impl FnMut(&str),
    mut on_tick: impl FnMut(),
) -> Result<Captured> {
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{}`", describe(cmd)))?;
    let (sender, receiver) = mpsc::channel::<(Stream, String)>();
    let stdout = child.stdout.take().context("child stdout was not captured")?;
    let stderr = child.stderr.take().context("child stderr was not captured")?;
    let readers = [forward_lines(stdout, Stream::Out, sender.clone()), forward_lines(stderr, Stream::Err, sender)];

    let (mut lines, mut out_lines, mut err_lines) = (Vec::new(), Vec::new(), Vec::new());
    let mut status = None;
    let mut timed_out = false;
    loop {
        match receiver.recv_timeout(TICK) {
            Ok((stream, line)) => {
                on_line(&line);
                match stream {
                    Stream::Out => out_lines.push(line.clone()),
                    Stream::Err => err_lines.push(line.clone()),
                }
                lines.push(line);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // Both pipes are closed: the child and everything it started are done writing.
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        on_tick();
        if status.is_none() {
            status = child.try_wait().context("waiting for the child")?;
        }
        if !timed_out && status.is_none() && timeout.is_some_and(|t| started.elapsed() > t) {
            timed_out = true;
            kill_tree(&mut child);
        }
    }
    for reader in readers {
        let _ = reader.join();
    }
    let status = match status {
        Some(s) => s,
        None => child.wait().context("waiting for the child")?,
    };
    Ok(Captured {
        status: (!timed_out).then_some(status),
        lines,
        stdout: out_lines,
        stderr: err_lines,
        elapsed: started.elapsed(),
    })
}

/// Which output stream a captured line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    Out,
    Err,
}

/// Reads `source` line by line on a thread, sending each line (lossily decoded, newline removed) to `sender`.
fn forward_lines(
    source: impl Read + Send + 'static,
    stream: Stream,
    sender: mpsc::Sender<(Stream, String)>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(source);
        let mut buf = Vec::new();
        // Bytes rather than `lines()`, because test output need not be UTF-8 and a stray byte must not end the capture.
        while reader.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
            let line = String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']).to_owned();
            if sender.send((stream, line)).is_err() {
                break;
            }
            buf.clear();
        }
    })
}

/// Kills `child` and all its descendants (found through `/proc` on Linux), deepest first, each by its id.
fn kill_tree(child: &mut std::process::Child) {
    let descendants = descendants(child.id());
    if !descendants.is_empty() {
        let _ = Command::new("kill")
            .arg("-KILL")
            .args(descendants.iter().rev().map(u32::to_string))
            .stderr(Stdio::null())
            .status();
    }
    let _ = child.kill();
}

/// Every process descended from `pid`, parents before children, read from `/proc/<pid>/stat` (empty elsewhere).
fn descendants(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let parents: Vec<(u32, u32)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| Some((p, parent_of(&std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?)?)))
        .collect();
    let mut found = vec![pid];
    let mut next = 0;
    while next < found.len() {
        let parent = found[next];
        found.extend(parents.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        next += 1;
    }
    found.remove(0);
    found
}

/// The parent pid in a `/proc/<pid>/stat` line, `pid (comm) state ppid ...`; `comm` may hold spaces and parentheses,
/// so the fields are read after the last `)`.
fn parent_of(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

// --- libtest and cargo output ---

/// The sum of every libtest summary line.
pub fn test_counts(lines: &[String]) -> TestCounts {
    let mut counts = TestCounts::default();
    for line in lines {
        if let Some(found) = parse_test_result(line) {
            counts += found;
        }
    }
    counts
}

/// A short name for the test binary cargo announces in `Running tests/x.rs (...)`, `Running tests/it/main.rs (...)`
/// (a binary of several modules, named by its directory), `Running unittests src/lib.rs (...)` or `Doc-tests crate`:
/// `x`, `it`, `unittests`, `doctests`.
fn binary_label(line: &str) -> Option<String> {
    let line = line.trim();
    if line.starts_with("Doc-tests ") {
        return Some("doctests".to_owned());
    }
    let source = line.strip_prefix("Running ")?.split(" (").next()?.trim();
    if source.starts_with("unittests ") {
        return Some("unittests".to_owned());
    }
    let path = Path::new(source);
    let named =
        if path.file_stem().is_some_and(|s| s == "main") { path.parent()?.file_name() } else { path.file_stem() };
    named.map(|s| s.to_string_lossy().into_owned())
}

/// The tests libtest reports as `test NAME ... FAILED` on stdout, each prefixed with its binary
/// (`flash_forward::NAME`).
///
/// cargo names each binary on stderr before running it, and each binary starts its stdout with `running N tests`;
/// the k-th such line therefore belongs to the k-th binary cargo announced. Pairing them by position, rather than by
/// arrival time, keeps the names right even though the two streams are read by different threads.
pub fn failed_tests(stdout: &[String], stderr: &[String]) -> Vec<String> {
    let binaries: Vec<String> = stderr.iter().filter_map(|l| binary_label(l)).collect();
    let mut block = 0usize;
    let mut failed = Vec::new();
    for line in stdout {
        let line = line.trim();
        if line.starts_with("running ") && (line.ends_with(" tests") || line.ends_with(" test")) {
            block += 1;
        } else if let Some(name) = line.strip_prefix("test ").and_then(|l| l.strip_suffix(" ... FAILED")) {
            let full = match block.checked_sub(1).and_then(|b| binaries.get(b)) {
                Some(b) => format!("{b}::{name}"),
                None => name.to_owned(),
            };
            if !failed.contains(&full) {
                failed.push(full);
            }
        }
    }
    failed
}

/// Whether cargo reported a compile error.
pub fn compile_failed(lines: &[String]) -> bool {
    lines.iter().any(|l| {
        let l = l.trim_start();
        l.starts_with("error[E") || l.starts_with("error: could not compile")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::parse_for_test;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_owned).collect()
    }

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn options_come_from_the_declared_flags() {
        let options = |args: &[&str]| Options::from_flags(&parse_for_test(args).unwrap());
        let o = options(&["mutants"]).unwrap();
        let expected = Options {
            mode: Mode::Catalog,
            only: vec![],
            cases: 64,
            seed: 0x6d75_7461_6e74,
            timeout: Duration::from_secs(300),
        };
        assert_eq!(o, expected);
        let o = options(&["mutants", "--only", "a", "--only=b", "--cases", "8", "--seed=3", "--timeout", "9"]).unwrap();
        assert_eq!(o.only, ["a", "b"]);
        assert_eq!((o.cases, o.seed, o.timeout.as_secs()), (8, 3, 9));
        assert_eq!(options(&["mutants", "--list"]).unwrap().mode, Mode::List);
        assert_eq!(options(&["mutants", "--diff"]).unwrap().mode, Mode::Diff(None));
        assert_eq!(options(&["mutants", "--diff", "v1"]).unwrap().mode, Mode::Diff(Some("v1".to_owned())));
        assert_eq!(
            options(&["mutants", "--scope", "oracle", "--scope=proofs"]).unwrap().mode,
            Mode::Scopes(strings(&["oracle", "proofs"]), ScopeRun { resume: false, shard: None })
        );
        assert_eq!(
            options(&["mutants", "--scope", "oracle", "--resume"]).unwrap().mode,
            Mode::Scopes(strings(&["oracle"]), ScopeRun { resume: true, shard: None })
        );
        let sliced = options(&["mutants", "--scope", "oracle", "--shard", "1/3", "--resume"]).unwrap().mode;
        let run = ScopeRun { resume: true, shard: Some(Shard { index: 1, count: 3 }) };
        assert_eq!(sliced, Mode::Scopes(strings(&["oracle"]), run));
        assert_eq!(run.selection(), Selection::Shard { shard: Shard { index: 1, count: 3 }, resume: true });
        assert_eq!(ScopeRun { resume: true, shard: None }.selection(), Selection::Resume);
        assert_eq!(ScopeRun { resume: false, shard: None }.selection(), Selection::Whole);
        for bad in [&["mutants", "--cases", "0"][..], &["mutants", "--timeout"], &["mutants", "--seed", "-1"]] {
            assert!(parse_for_test(bad).is_err(), "{bad:?}");
        }
        for clash in [
            &["mutants", "--diff", "--scope", "oracle"][..],
            &["mutants", "--diff", "--list"],
            &["mutants", "--diff", "--only", "x"],
            &["mutants", "--scope", "oracle", "--only", "x"],
            &["mutants", "HEAD~1"],
            &["mutants", "--resume"],
            &["mutants", "--diff", "--resume"],
            &["mutants", "--shard", "0/2"],
            &["mutants", "--scope", "oracle", "--shard", "2/2"],
        ] {
            assert!(options(clash).is_err(), "{clash:?} must be refused");
        }
        assert!(parse_for_test(&["mutants", "--diff", "a", "b"]).is_err(), "one revision at most");
    }

    #[test]
    fn gpu_mutants_are_sent_to_the_gpu_host() {
        let all: Vec<&'static Mutant> = attnproof_catalog::all().collect();
        let (cpu, gpu) = split_by_machine(&all);
        assert_eq!(cpu.len() + gpu.len(), all.len());
        assert!(cpu.iter().all(|(m, package, args)| m.runner.runs_on_cpu() && args[2] == *package));
        let kernel = gpu.iter().find(|m| matches!(m.runner, Runner::KernelText { .. })).expect("a kernel-text mutant");
        let message = gpu_elsewhere(kernel);
        assert!(message.contains(kernel.name) && message.contains("run.sh mutants"), "{message}");
    }

    #[test]
    fn select_rejects_unknown_names() {
        assert_eq!(select(&[]).unwrap().len(), attnproof_catalog::all().count());
        assert_eq!(select(&strings(&["lse-base-2"])).unwrap()[0].name, "lse-base-2");
        let err = select(&strings(&["nope"])).unwrap_err().to_string();
        assert!(err.contains("no mutant named `nope`") && err.contains("lse-base-2"), "{err}");
    }

    #[test]
    fn failed_tests_are_named_with_their_binary() {
        let err = lines(
            "   Compiling attnproof-harness v0.1.0\n\
             \x20    Running unittests src/lib.rs (target/debug/deps/attnproof_harness-1)\n\
             \x20    Running tests/flash_forward.rs (target/debug/deps/flash_forward-2)\n\
             \x20    Running tests/one.rs (target/debug/deps/one-3)\n\
             \x20    Running tests/it/main.rs (target/debug/deps/it-4)\n\
             \x20  Doc-tests attnproof_harness\n",
        );
        let out = lines(
            "\nrunning 0 tests\n\
             test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n\
             \nrunning 2 tests\n\
             test reference_forward_is_within_bound_bf16 ... FAILED\n\
             test reference_forward_is_within_bound_f16 ... ok\n\
             failures:\n    reference_forward_is_within_bound_bf16\n\
             test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.30s\n\
             \nrunning 1 test\n\
             test alone ... FAILED\n\
             \nrunning 1 test\n\
             test ring::drawn ... FAILED\n\
             \nrunning 1 test\n\
             test src/lib.rs - x (line 3) ... FAILED\n",
        );
        assert_eq!(
            failed_tests(&out, &err),
            [
                "flash_forward::reference_forward_is_within_bound_bf16",
                "one::alone",
                "it::ring::drawn",
                "doctests::src/lib.rs - x (line 3)"
            ]
        );
        assert_eq!(test_counts(&out), TestCounts { passed: 1, failed: 1 });
        // Without cargo's announcements the bare names are still reported.
        assert_eq!(failed_tests(&out[..6], &[]), ["reference_forward_is_within_bound_bf16"]);
    }

    #[test]
    fn compile_errors_are_recognized() {
        assert!(compile_failed(&lines("error[E0308]: mismatched types\n  --> reference/src/flash.rs:1:1")));
        assert!(compile_failed(&lines("error: could not compile `attnproof-reference` (lib) due to 1 previous error")));
        assert!(!compile_failed(&lines("error: test failed, to rerun pass `--test it`")));
    }

    #[cfg(unix)]
    fn status(code: i32) -> ExitStatus {
        use std::os::unix::process::ExitStatusExt;
        ExitStatus::from_raw(code << 8)
    }

    #[cfg(unix)]
    #[test]
    fn classification() {
        // Classification reads stdout for test lines and stderr for cargo's; here both get the whole text.
        let run = |status: Option<ExitStatus>, text: &str| Captured {
            status,
            lines: lines(text),
            stdout: lines(text),
            stderr: lines(text),
            elapsed: Duration::ZERO,
        };
        assert_eq!(classify(&run(Some(status(0)), "test result: ok. 2 passed; 0 failed;")), Outcome::Survived);
        assert_eq!(classify(&run(None, "")), Outcome::Timeout);
        assert_eq!(
            classify(&run(Some(status(101)), "error[E0425]: cannot find value\nerror: could not compile `x`")),
            Outcome::CompileError
        );
        assert_eq!(
            classify(&run(Some(status(101)), "     Running tests/a.rs (x)\nrunning 1 test\ntest t ... FAILED")),
            Outcome::Killed(vec!["a::t".to_owned()])
        );
        assert_eq!(
            classify(&run(Some(status(101)), "error: test failed, to rerun pass `--test a`")),
            Outcome::Killed(vec!["crash: --test a".to_owned()])
        );
        assert!(Outcome::CompileError.is_killed() && Outcome::Timeout.is_killed());
        assert!(!Outcome::Survived.is_killed() && !Outcome::Stale(String::new()).is_killed());
    }

    #[test]
    fn parent_pid_is_read_after_the_command_name() {
        assert_eq!(parent_of("4242 (cargo) S 17 4242 17 0"), Some(17));
        assert_eq!(parent_of("7 (a) b (c) R 3 7"), Some(3));
        assert_eq!(parent_of("garbage"), None);
    }

    #[test]
    fn regression_files_are_recognized() {
        assert!(is_regression_file(Path::new("tests/tests/flash_forward.proptest-regressions")));
        assert!(is_regression_file(Path::new("tests/proptest-regressions/flash.txt")));
        assert!(!is_regression_file(Path::new("tests/tests/it/flash_forward.rs")));
    }

    #[cfg(unix)]
    #[test]
    fn captured_run_interleaves_both_streams_and_times_out() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        let run = run_captured(&mut cmd, None, |_| {}, || {}).unwrap();
        assert_eq!(run.status.and_then(|s| s.code()), Some(3));
        let mut got = run.lines.clone();
        got.sort();
        assert_eq!(got, ["err", "out"]);

        // The shell's child `sleep` holds the pipes; only killing the whole tree ends the run.
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 30; echo never"]);
        let run = run_captured(&mut cmd, Some(Duration::from_millis(300)), |_| {}, || {}).unwrap();
        assert!(run.timed_out());
        assert!(run.elapsed < Duration::from_secs(10), "took {:?}", run.elapsed);
    }
}
