//! The tidy test: repository-wide rules on source text, each a pure function unit-tested with a planted violation.
//!
//! The rules, each returning the [`Violation`]s it finds:
//! 1. [`check_header`]: every source file opens with a one-line purpose comment (the form depends on the language,
//!    see [`HeaderStyle`]).
//! 2. [`check_architecture_names`]: `ARCHITECTURE.md` names every Rust and CUDA source file, by its path or by a
//!    folder containing it, in backticks.
//! 3. [`check_outside_paths`]: no docs or code refer to a path outside the repository.
//! 4. [`check_dependency_rule`]: each workspace crate's normal dependencies on other workspace crates follow
//!    [`DEPENDENCY_RULE`].
//! 5. [`check_safety_comments`]: every `unsafe` in Rust code has a `// SAFETY:` comment right above it.
//! 6. [`check_unsafe_location`]: no file under `gpu/src/` except `gpu/src/launch.rs` uses `unsafe`.
//! 7. [`check_forbidden_macros`]: no ignored tests and no forgotten `dbg!`/`todo!` calls.
//!
//! The `#[test] fn tidy` at the bottom runs all of them over the repository (`cargo xtask test` runs it with the rest
//! of the workspace) and fails listing every violation as `path:line: rule: what`. The module is compiled for tests
//! only, so none of it ends up in the xtask binary.
#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Which rule a violation breaks; its [`Rule::name`] is the `rule` field of the printed `path:line: rule: what`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Rule {
    /// Rule 1: the one-line purpose comment at the top of a source file.
    Header,
    /// Rule 2: `ARCHITECTURE.md` names every Rust/CUDA source file.
    Architecture,
    /// Rule 3: no path outside the repository.
    OutsidePath,
    /// Rule 4: the dependency rule between workspace crates.
    Dependency,
    /// Rule 5: a `// SAFETY:` comment above every `unsafe`.
    SafetyComment,
    /// Rule 6: `unsafe` in the GPU crate only in `gpu/src/launch.rs`, in the oracle only in `oracle/src/real.rs`.
    UnsafeLocation,
    /// Rule 7: no `#[ignore]`, `dbg!(` or `todo!(`.
    ForbiddenMacro,
    /// Rule 8: no two modules of a layered crate import each other in a circle.
    ModuleCycle,
}

impl Rule {
    /// The short name printed in a violation line.
    fn name(self) -> &'static str {
        match self {
            Rule::Header => "header",
            Rule::Architecture => "architecture",
            Rule::OutsidePath => "outside-path",
            Rule::Dependency => "dependency",
            Rule::SafetyComment => "safety-comment",
            Rule::UnsafeLocation => "unsafe-location",
            Rule::ForbiddenMacro => "forbidden-macro",
            Rule::ModuleCycle => "module-cycle",
        }
    }
}

/// One broken rule at one place: printed as `path:line: rule: what`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Violation {
    /// The file, relative to the repository root, with `/` separators.
    path: String,
    /// The 1-based line the violation is on (line 1 for a file-level violation).
    line: usize,
    /// The rule broken.
    rule: Rule,
    /// What is wrong and how to fix it.
    message: String,
}

impl Violation {
    /// A violation of `rule` in `path` at 1-based `line`.
    fn new(path: &str, line: usize, rule: Rule, message: impl Into<String>) -> Self {
        Violation { path: path.to_owned(), line, rule, message: message.into() }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}: {}", self.path, self.line, self.rule.name(), self.message)
    }
}

/// The extension of a repository path (`"rs"` for `gpu/src/lib.rs`), or `""` when it has none (`.ci/run`).
fn extension(path: &str) -> &str {
    Path::new(path).extension().and_then(|e| e.to_str()).unwrap_or("")
}

/// Whether a file is a Rust source file.
fn is_rust(path: &str) -> bool {
    extension(path) == "rs"
}

// ---------------------------------------------------------------------------------------------------------------
// Rule 1: purpose headers.
// ---------------------------------------------------------------------------------------------------------------

/// The form of a file's purpose comment, chosen by its language.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeaderStyle {
    /// Rust (`*.rs`): line 1 is `//! <purpose>`, the crate or module documentation.
    RustDoc,
    /// CUDA and JavaScript (`*.cu`, `*.cuh`, `*.mjs`): line 1 is `// <purpose>`.
    SlashSlash,
    /// Shell (`*.sh`, and any other file starting with a `#!` shebang that is not Python): an optional shebang line,
    /// then `# <purpose>`.
    Hash,
    /// Python (`*.py`, or a `#!` shebang naming python): an optional shebang line, then a module docstring whose
    /// opening line carries the purpose, `"""<purpose>`.
    PythonDocstring,
}

/// The header form a file must have, or `None` when rule 1 does not apply to it.
fn header_style(path: &str, text: &str) -> Option<HeaderStyle> {
    match extension(path) {
        "rs" => Some(HeaderStyle::RustDoc),
        "cu" | "cuh" | "mjs" => Some(HeaderStyle::SlashSlash),
        "sh" => Some(HeaderStyle::Hash),
        "py" => Some(HeaderStyle::PythonDocstring),
        "" => {
            let shebang = text.lines().next().filter(|line| line.starts_with("#!"))?;
            Some(if shebang.contains("python") { HeaderStyle::PythonDocstring } else { HeaderStyle::Hash })
        }
        _ => None,
    }
}

/// Rule 1: the file starts with a one-line purpose comment in the form [`header_style`] picks.
///
/// "One line" is checked as "the first line of the comment carries text": whether it is a whole sentence is for the
/// reviewer.
fn check_header(path: &str, text: &str) -> Vec<Violation> {
    let Some(style) = header_style(path, text) else { return Vec::new() };
    let mut lines = text.lines().enumerate().peekable();
    if matches!(style, HeaderStyle::Hash | HeaderStyle::PythonDocstring) {
        lines.next_if(|(_, line)| line.starts_with("#!"));
    }
    let (index, first) = lines.next().unwrap_or((0, ""));
    let (prefix, expected) = match style {
        HeaderStyle::RustDoc => ("//!", "`//! <what this file is for>`"),
        HeaderStyle::SlashSlash => ("//", "`// <what this file is for>`"),
        HeaderStyle::Hash => ("#", "`# <what this file is for>` (after the shebang, if any)"),
        HeaderStyle::PythonDocstring => {
            ("\"\"\"", "a docstring `\"\"\"<what this file is for>` (after the shebang, if any)")
        }
    };
    let has_text = first.strip_prefix(prefix).is_some_and(|rest| {
        // A `///` item doc or a `#!` line is not a purpose comment of the right kind.
        let rest = rest.trim();
        !rest.is_empty() && !rest.starts_with('/') && !rest.starts_with('!')
    });
    if has_text {
        Vec::new()
    } else {
        vec![Violation::new(path, index + 1, Rule::Header, format!("the file must open with {expected}"))]
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Rule 2: ARCHITECTURE.md names every Rust/CUDA source file.
// ---------------------------------------------------------------------------------------------------------------

/// The path of the architecture document, relative to the repository root.
const ARCHITECTURE: &str = "ARCHITECTURE.md";

/// Whether rule 2 applies to a file: Rust and CUDA sources.
fn is_architecture_source(path: &str) -> bool {
    matches!(extension(path), "rs" | "cu" | "cuh")
}

/// The inline code spans of a Markdown text, trimmed.
///
/// A small reader, enough for path names: fenced code blocks (lines opening with three backticks or tildes) are
/// skipped; in every other paragraph (text between blank lines) the text between a backtick and the next one is a
/// span. Spans delimited by two or more backticks are not recognised, and an unmatched backtick only disturbs the
/// rest of its own paragraph.
fn code_spans(markdown: &str) -> Vec<&str> {
    let mut spans = Vec::new();
    let mut fenced = false;
    let mut paragraph: Vec<&str> = Vec::new();
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        let fence = trimmed.starts_with("```") || trimmed.starts_with("~~~");
        if fence || trimmed.is_empty() {
            paragraph_spans(&paragraph, &mut spans);
            paragraph.clear();
            fenced ^= fence;
        } else if !fenced {
            paragraph.push(line);
        }
    }
    paragraph_spans(&paragraph, &mut spans);
    spans
}

/// Appends the code spans of one paragraph's lines to `spans`.
///
/// Backticks pair up across the paragraph's lines, so that one stray backtick only disturbs its own paragraph; a span
/// that continues on the next line is appended as one piece per line (path names never wrap).
fn paragraph_spans<'a>(paragraph: &[&'a str], spans: &mut Vec<&'a str>) {
    let mut open = false;
    for line in paragraph {
        for (i, piece) in line.split('`').enumerate() {
            if i > 0 {
                open = !open;
            }
            if open {
                spans.push(piece.trim());
            }
        }
    }
}

/// Rule 2: `architecture` (the text of `ARCHITECTURE.md`) names every file of `sources` that is a Rust or CUDA file.
///
/// A file is named by an inline code span of the document (see [`code_spans`]) that is
/// - exactly its path relative to the repository root (`` `gpu/src/launch.rs` ``), or
/// - a folder path ending in `/` that contains the file at any depth (`` `gpu/src/ring/` `` names
///   `gpu/src/ring/state.rs`; `` `gpu/src/` `` names it too), except that
/// - a crate folder (one of `crate_folders`, the workspace members, e.g. `` `gpu/` ``) names only the crate's top: the
///   files directly in it or directly in its `src/`. The crate's other folders (`src/ring/`, `src/bin/`, `tests/`,
///   `examples/`) must be named themselves, so that naming a crate does not hide its structure.
///
/// Bare file names (`` `lib.rs` ``) and paths without the trailing `/` name nothing.
fn check_architecture_names(architecture: &str, crate_folders: &[&str], sources: &[&str]) -> Vec<Violation> {
    let spans = code_spans(architecture);
    let exact: BTreeSet<&str> = spans.iter().copied().collect();
    let folders: Vec<&str> = spans.iter().copied().filter(|span| span.ends_with('/')).collect();
    let names = |path: &str, folder: &str| {
        let Some(inside) = path.strip_prefix(folder) else { return false };
        let is_crate =
            crate_folders.iter().any(|member| folder.strip_suffix('/') == Some(member.trim_end_matches('/')));
        !is_crate || !inside.strip_prefix("src/").unwrap_or(inside).contains('/')
    };
    sources
        .iter()
        .copied()
        .filter(|path| is_architecture_source(path))
        .filter(|path| !exact.contains(path) && !folders.iter().any(|folder| names(path, folder)))
        .map(|path| {
            let folder = path.rsplit_once('/').map_or(String::new(), |(dir, _)| format!(" or `{dir}/`"));
            Violation::new(
                path,
                1,
                Rule::Architecture,
                format!(
                    "not named in {ARCHITECTURE}: mention `{path}`{folder} in backticks (see check_architecture_names)"
                ),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Rule 3: no path outside the repository.
// ---------------------------------------------------------------------------------------------------------------

/// Whether rule 3 applies to a file: docs, code, manifests and scripts.
fn is_outside_path_checked(path: &str, text: &str) -> bool {
    match extension(path) {
        "md" | "rs" | "toml" | "sh" | "py" | "cu" | "cuh" | "mjs" => true,
        "" => text.starts_with("#!"),
        _ => false,
    }
}

/// Top-level folders of one machine's file system that a repository file must never point into: home and work
/// directories and scratch space. System paths the code legitimately uses (the CUDA toolkit under `usr`, `dev/null`,
/// `proc`, the browser binary) are not in the list. Written without slashes so this file does not name them.
const PRIVATE_ROOTS: &[&str] = &["work", "root", "home", "Users", "mnt", "tmp"];

/// The one folder under `tmp` the project's own scripts may create: names starting with this prefix (the GPU bundle's
/// `run.sh` links NCCL there). A bare `tmp` path (the system's scratch folder itself) is allowed too.
const OWN_TMP_PREFIX: &str = "attnproof-";

/// Whether a byte can continue a path or word, so that a `/` or `..` after it does not start a path of its own.
fn continues_path(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'-' | b'/' | b'~' | b'$' | b'}' | b')')
}

/// Whether a byte belongs to one path component name.
fn is_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'-')
}

/// Rule 3: `text` (the file at `path`, relative to the repository root) refers to no path outside the repository.
///
/// Two patterns are reported, each only where a path starts (the character before it cannot continue a path, so
/// `a/../b` and `$HOME/x` are not starts):
/// - a relative path opening with `../` steps that climbs above the repository root from the file's own folder
///   (`../sibling/x.md` in a top-level file; `../../kernels/x.cu` in `gpu/src/ring/` stays inside). Relative paths are
///   resolved against the file's folder, as Markdown links, `include_str!` and insta's `snapshot_path` are; a shell
///   script's paths are relative to its working directory, which this approximates by the script's folder. Climbs
///   after a first named component (`a/../../x`) are not followed.
/// - an absolute path into one of the [`PRIVATE_ROOTS`], except the project's own scratch names under `tmp` (see
///   [`OWN_TMP_PREFIX`]).
fn check_outside_paths(path: &str, text: &str) -> Vec<Violation> {
    let depth = path.matches('/').count();
    let folder = path.rsplit_once('/').map_or("the root".to_owned(), |(dir, _)| format!("`{dir}/`"));
    let mut violations = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let bytes = line.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let at_start = i == 0 || !continues_path(bytes[i - 1]);
            if at_start && bytes[i..].starts_with(b"../") {
                let start = i;
                let mut climbs = 0;
                while bytes[i..].starts_with(b"../") {
                    climbs += 1;
                    i += 3;
                }
                if bytes[i..].starts_with(b"..") && bytes.get(i + 2).is_none_or(|&b| !is_name_byte(b)) {
                    climbs += 1;
                    i += 2;
                }
                while i < bytes.len() && (is_name_byte(bytes[i]) || bytes[i] == b'/') {
                    i += 1;
                }
                if climbs > depth {
                    let token = &line[start..i];
                    violations.push(Violation::new(
                        path,
                        index + 1,
                        Rule::OutsidePath,
                        format!(
                            "`{token}` climbs {climbs} up from {folder}, where only {depth} lead to the root, so it \
                             leaves the repository: refer to a file inside the repository instead"
                        ),
                    ));
                }
                continue;
            }
            if at_start && bytes[i] == b'/' {
                let name_start = i + 1;
                let mut end = name_start;
                while end < bytes.len() && is_name_byte(bytes[end]) {
                    end += 1;
                }
                let name = &line[name_start..end];
                let rest = &line[end..];
                let own_tmp = name == "tmp" && (!rest.starts_with('/') || rest[1..].starts_with(OWN_TMP_PREFIX));
                if PRIVATE_ROOTS.contains(&name) && !own_tmp {
                    let mut token_end = end;
                    while token_end < bytes.len() && (is_name_byte(bytes[token_end]) || bytes[token_end] == b'/') {
                        token_end += 1;
                    }
                    let token = &line[i..token_end];
                    violations.push(Violation::new(
                        path,
                        index + 1,
                        Rule::OutsidePath,
                        format!(
                            "`{token}` is a path on one machine, outside the repository: use a path inside the \
                             repository, a placeholder such as `CASES_DIR`, or (for scratch files) a folder \
                             in the system's `tmp` whose name starts with `{OWN_TMP_PREFIX}`"
                        ),
                    ));
                }
                i = end.max(i + 1);
                continue;
            }
            i += 1;
        }
    }
    violations
}

// ---------------------------------------------------------------------------------------------------------------
// Rule 4: the dependency rule.
// ---------------------------------------------------------------------------------------------------------------

/// Which workspace crates one workspace crate may have as normal dependencies.
#[derive(Debug, Clone, Copy)]
enum Allowed {
    /// Exactly these (possibly none).
    Only(&'static [&'static str]),
    /// Every workspace crate except these.
    AllBut(&'static [&'static str]),
}

impl Allowed {
    /// Whether a dependency on the workspace crate `dependency` is allowed.
    fn allows(self, dependency: &str) -> bool {
        match self {
            Allowed::Only(names) => names.contains(&dependency),
            Allowed::AllBut(names) => !names.contains(&dependency),
        }
    }

    /// The rule in words, for a violation message.
    fn describe(self) -> String {
        match self {
            Allowed::Only([]) => "no workspace crate".to_owned(),
            Allowed::Only(names) => names.join(", "),
            Allowed::AllBut(names) => format!("any workspace crate but {}", names.join(", ")),
        }
    }
}

/// The dependency rule (also drawn in `ARCHITECTURE.md`): for each workspace crate, by package name, the workspace
/// crates it may use as normal dependencies. Dev-dependencies are free (tests may use anything). A new crate must be
/// added here, with its place in the rule.
const DEPENDENCY_RULE: &[(&str, Allowed)] = &[
    ("attnproof-oracle", Allowed::Only(&[])),
    ("attnproof-ring-driver", Allowed::Only(&["attnproof-oracle"])),
    ("attnproof-proofs", Allowed::Only(&["attnproof-oracle"])),
    ("attnproof-fixtures", Allowed::Only(&["attnproof-oracle", "attnproof-proofs"])),
    ("attnproof-reference", Allowed::Only(&["attnproof-oracle", "attnproof-ring-driver"])),
    ("attnproof-gpu", Allowed::Only(&["attnproof-oracle", "attnproof-ring-driver"])),
    ("attnproof-harness", Allowed::AllBut(&["xtask"])),
    ("attnproof-python", Allowed::Only(&["attnproof-harness"])),
    ("attnproof-catalog", Allowed::Only(&[])),
    ("xtask", Allowed::Only(&["attnproof-catalog"])),
];

/// What rule 4 needs from one crate's `Cargo.toml`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Manifest {
    /// The manifest's path relative to the repository root (`gpu/Cargo.toml`).
    path: String,
    /// `[package] name`, with the 1-based line it is on; `None` when the manifest has none.
    package: Option<(String, usize)>,
    /// Every normal dependency by package name (after `package = "..."` renames), with its 1-based line.
    dependencies: Vec<(String, usize)>,
}

/// A TOML line without its trailing `#` comment (a `#` inside a double-quoted string is kept), trimmed.
fn without_comment(line: &str) -> &str {
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in line.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            '#' if !in_string => return line[..i].trim(),
            _ => {}
        }
    }
    line.trim()
}

/// The value of `key = "value"` inside `text` (a line or an inline table), if present.
fn quoted_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let mut search = text;
    while let Some(found) = search.find(key) {
        let before_ok =
            search[..found].chars().next_back().is_none_or(|c| !(c.is_alphanumeric() || c == '-' || c == '_'));
        let after = search[found + key.len()..].trim_start();
        if before_ok && let Some(value) = after.strip_prefix('=') {
            let value = value.trim_start().strip_prefix('"')?;
            return value.split_once('"').map(|(inside, _)| inside);
        }
        search = &search[found + key.len()..];
    }
    None
}

/// A TOML key with surrounding quotes removed (`"attnproof-oracle"` → `attnproof-oracle`).
fn unquote(key: &str) -> &str {
    key.trim().trim_matches('"').trim_matches('\'')
}

/// Reads the package name and the normal dependencies of a crate manifest.
///
/// A line-based reader, enough for Cargo manifests written the usual way; its limits:
/// - Normal dependencies are the entries of `[dependencies]` and `[target.<cfg>.dependencies]`, and the tables
///   `[dependencies.<name>]` / `[target.<cfg>.dependencies.<name>]`; `dev-dependencies` and `build-dependencies` are
///   not read.
/// - An entry is `name = ...`, `name.workspace = true` or `name.<key> = ...` on one line; a `package = "..."` in its
///   inline table (or in its `[dependencies.<name>]` table) renames it. Multi-line values and dotted keys with quoted
///   dots are not understood.
/// - A rename done in `[workspace.dependencies]` of the root manifest is not seen: the key is taken as the name.
fn parse_manifest(path: &str, text: &str) -> Manifest {
    /// The kind of table the reader is in.
    #[derive(PartialEq, Eq)]
    enum Table {
        Package,
        Dependencies,
        OneDependency,
        Other,
    }
    let mut manifest = Manifest { path: path.to_owned(), package: None, dependencies: Vec::new() };
    let mut table = Table::Other;
    for (index, raw) in text.lines().enumerate() {
        let line = without_comment(raw);
        if line.is_empty() {
            continue;
        }
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_start_matches('[').trim_end_matches(']').trim();
            let dependency_table = |h: &str| h == "dependencies" || h.ends_with(".dependencies");
            table = if header == "package" {
                Table::Package
            } else if dependency_table(header) {
                Table::Dependencies
            } else if let Some((owner, name)) = header.rsplit_once('.')
                && dependency_table(owner)
            {
                manifest.dependencies.push((unquote(name).to_owned(), index + 1));
                Table::OneDependency
            } else {
                Table::Other
            };
            continue;
        }
        match table {
            Table::Package if manifest.package.is_none() => {
                if let Some(name) = quoted_value(line, "name") {
                    manifest.package = Some((name.to_owned(), index + 1));
                }
            }
            Table::Dependencies => {
                let Some((key, value)) = line.split_once('=') else { continue };
                let key = unquote(key.split('.').next().unwrap_or(key));
                let name = quoted_value(value, "package").unwrap_or(key);
                manifest.dependencies.push((name.to_owned(), index + 1));
            }
            Table::OneDependency => {
                if let Some(renamed) = quoted_value(line, "package")
                    && let Some(last) = manifest.dependencies.last_mut()
                {
                    last.0 = renamed.to_owned();
                }
            }
            Table::Package | Table::Other => {}
        }
    }
    manifest
}

/// The `members` of the root manifest's `[workspace]` table (the array may span lines).
fn workspace_members(root_manifest: &str) -> Vec<String> {
    let mut in_workspace = false;
    let mut collecting = false;
    let mut members = Vec::new();
    for raw in root_manifest.lines() {
        let line = without_comment(raw);
        if !collecting && line.starts_with('[') {
            in_workspace = line == "[workspace]";
            continue;
        }
        let rest = if collecting {
            line
        } else if in_workspace
            && let Some((key, value)) = line.split_once('=')
            && key.trim() == "members"
        {
            collecting = true;
            value.trim_start().trim_start_matches('[')
        } else {
            continue;
        };
        let (items, closed) = match rest.split_once(']') {
            Some((items, _)) => (items, true),
            None => (rest, false),
        };
        members.extend(items.split(',').map(unquote).filter(|m| !m.is_empty()).map(str::to_owned));
        if closed {
            collecting = false;
        }
    }
    members
}

/// Rule 4: the workspace crates' normal dependencies on each other follow [`DEPENDENCY_RULE`].
///
/// `manifests` are the workspace members' manifests; `root_path` is where a rule entry naming no member is reported.
/// A member missing from the rule, a member without a package name, a dependency the rule does not allow, and a rule
/// entry naming no member are all violations.
fn check_dependency_rule(root_path: &str, manifests: &[Manifest]) -> Vec<Violation> {
    let workspace: BTreeSet<&str> =
        manifests.iter().filter_map(|m| m.package.as_ref()).map(|(name, _)| name.as_str()).collect();
    let mut violations = Vec::new();
    for manifest in manifests {
        let Some((package, package_line)) = &manifest.package else {
            violations.push(Violation::new(
                &manifest.path,
                1,
                Rule::Dependency,
                "no `[package] name` found: a workspace member needs one for the dependency rule",
            ));
            continue;
        };
        let Some(&(_, allowed)) = DEPENDENCY_RULE.iter().find(|(name, _)| name == package) else {
            violations.push(Violation::new(
                &manifest.path,
                *package_line,
                Rule::Dependency,
                format!(
                    "`{package}` has no place in the dependency rule: add it to DEPENDENCY_RULE in xtask/src/tidy.rs \
                     (and to ARCHITECTURE.md's diagram) with the workspace crates it may depend on"
                ),
            ));
            continue;
        };
        for (dependency, line) in &manifest.dependencies {
            if dependency != package && workspace.contains(dependency.as_str()) && !allowed.allows(dependency) {
                violations.push(Violation::new(
                    &manifest.path,
                    *line,
                    Rule::Dependency,
                    format!(
                        "`{package}` may depend only on {} (normal dependencies), not on `{dependency}`: move the \
                         shared code into a crate both may use, or make it a dev-dependency if only tests need it",
                        allowed.describe()
                    ),
                ));
            }
        }
    }
    for (name, _) in DEPENDENCY_RULE {
        if !workspace.contains(name) {
            violations.push(Violation::new(
                root_path,
                1,
                Rule::Dependency,
                format!("DEPENDENCY_RULE in xtask/src/tidy.rs names `{name}`, which is no workspace member: remove it"),
            ));
        }
    }
    violations
}

// ---------------------------------------------------------------------------------------------------------------
// Rust code without comments and strings (rules 5 to 7).
// ---------------------------------------------------------------------------------------------------------------

/// Rust source with every comment and every string and character literal blanked out (replaced by spaces, newlines
/// kept), so that line numbers and columns stay those of the original and only code remains.
///
/// An approximation of Rust's lexer that covers the code in this repository: line comments, nested block comments,
/// strings with escapes, raw strings (`r"..."`, `r#"..."#`, with a `b` or `c` prefix), and character literals, told
/// apart from lifetimes and labels by their closing quote (`'x'`, `'\n'`, `'\u{1F600}'`). A byte or C string prefix
/// is left in place as an identifier-like character, which is harmless for the keyword searches done here.
fn strip_comments_and_strings(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    // Each blanked character becomes as many spaces as it has UTF-8 bytes, so byte offsets match the original too.
    let blank = |out: &mut String, c: char| {
        if c == '\n' {
            out.push('\n');
        } else {
            out.extend(std::iter::repeat_n(' ', c.len_utf8()));
        }
    };
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        // `r` opens a raw string when it starts a token, alone or after a `b`/`c` prefix that starts one.
        let raw_prefix = c == 'r'
            && match i {
                0 => true,
                _ if !is_ident(chars[i - 1]) => true,
                _ if matches!(chars[i - 1], 'b' | 'c') => i < 2 || !is_ident(chars[i - 2]),
                _ => false,
            };
        let raw_hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
        } else if raw_prefix && chars.get(i + 1 + raw_hashes) == Some(&'"') {
            // A raw string: `r`, some `#`, `"`, then everything up to a `"` followed by as many `#`.
            out.push('r');
            out.extend(std::iter::repeat_n(' ', raw_hashes + 1));
            i += 2 + raw_hashes;
            while i < chars.len() {
                if chars[i] == '"'
                    && chars[i + 1..].iter().take(raw_hashes).filter(|&&h| h == '#').count() == raw_hashes
                {
                    out.extend(std::iter::repeat_n(' ', raw_hashes + 1));
                    i += 1 + raw_hashes;
                    break;
                }
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() {
                match chars[i] {
                    '\\' => {
                        out.push(' ');
                        if let Some(&escaped) = chars.get(i + 1) {
                            blank(&mut out, escaped);
                        }
                        i += 2;
                    }
                    '"' => {
                        out.push(' ');
                        i += 1;
                        break;
                    }
                    other => {
                        blank(&mut out, other);
                        i += 1;
                    }
                }
            }
        } else if c == '\'' && next == Some('\\') {
            // An escaped character literal: skip the backslash and the escaped character, then run to the closing
            // quote.
            let from = (i + 3).min(chars.len());
            let end = chars[from..].iter().position(|&q| q == '\'').map_or(chars.len(), |p| from + p + 1);
            for &q in &chars[i..end] {
                blank(&mut out, q);
            }
            i = end;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            for &q in &chars[i..i + 3] {
                blank(&mut out, q);
            }
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The 0-based line numbers of every `unsafe` keyword in code produced by [`strip_comments_and_strings`] (the word
/// alone: `unsafe_code` in `#![forbid(unsafe_code)]` is an identifier, not the keyword).
fn unsafe_lines(code: &str) -> Vec<usize> {
    code.lines().enumerate().filter(|(_, line)| contains_word(line, "unsafe")).map(|(index, _)| index).collect()
}

/// Whether `line` contains `word` with no identifier character on either side.
fn contains_word(line: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    line.match_indices(word).any(|(at, _)| {
        let before = line[..at].chars().next_back().is_none_or(|c| !is_ident(c));
        let after = line[at + word.len()..].chars().next().is_none_or(|c| !is_ident(c));
        before && after
    })
}

// ---------------------------------------------------------------------------------------------------------------
// Rule 5: a SAFETY comment for every unsafe.
// ---------------------------------------------------------------------------------------------------------------

/// Rule 5: every `unsafe` (block, `unsafe fn`, `unsafe impl`, `unsafe extern`, `#[unsafe(...)]`) in a Rust file has
/// its justification right above it.
///
/// The window searched for `SAFETY:` is a trailing `// SAFETY:` comment on the line of the `unsafe` itself, and the
/// contiguous run of comment lines
/// (`//`, `///`) and attribute lines (`#[...]`) immediately above it; a blank line or a code line ends the run. For
/// an `unsafe fn` a `# Safety` section in that run (the rustdoc convention for the caller's obligations) also counts.
fn check_safety_comments(path: &str, text: &str) -> Vec<Violation> {
    if !is_rust(path) {
        return Vec::new();
    }
    let code = strip_comments_and_strings(text);
    let lines: Vec<&str> = text.lines().collect();
    let code_lines: Vec<&str> = code.lines().collect();
    unsafe_lines(&code)
        .into_iter()
        .filter(|&index| {
            let is_fn = contains_word(code_lines[index], "fn");
            let justifies = |line: &str| line.contains("SAFETY:") || (is_fn && line.contains("# Safety"));
            if lines[index].contains("// SAFETY:") {
                return false;
            }
            let above = lines[..index].iter().rev().map(|line| line.trim_start());
            !above.take_while(|line| line.starts_with("//") || line.starts_with("#[")).any(justifies)
        })
        .map(|index| {
            Violation::new(
                path,
                index + 1,
                Rule::SafetyComment,
                "`unsafe` without a `// SAFETY:` comment on the lines right above it: state why this use is sound",
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Rule 6: unsafe only in gpu/src/launch.rs and oracle/src/real.rs.
// ---------------------------------------------------------------------------------------------------------------

/// The source folders where rule 6 applies, each with the one file allowed to use `unsafe`: the GPU crate's driver
/// calls, and the oracle's `vzeroupper` after faer's products (the oracle denies `unsafe_code` and allows it on that
/// one function).
const UNSAFE_HOMES: &[(&str, &str)] = &[("gpu/src/", "gpu/src/launch.rs"), ("oracle/src/", "oracle/src/real.rs")];

/// Rule 6: no Rust file under a folder of [`UNSAFE_HOMES`] other than its home uses the `unsafe` keyword in code
/// (comments and strings are ignored, see [`strip_comments_and_strings`]). The crates with `#![forbid(unsafe_code)]`
/// are left to the compiler.
fn check_unsafe_location(path: &str, text: &str) -> Vec<Violation> {
    let Some((_, home)) = UNSAFE_HOMES.iter().find(|(folder, _)| path.starts_with(folder)) else {
        return Vec::new();
    };
    if !is_rust(path) || path == *home {
        return Vec::new();
    }
    unsafe_lines(&strip_comments_and_strings(text))
        .into_iter()
        .map(|index| {
            Violation::new(
                path,
                index + 1,
                Rule::UnsafeLocation,
                format!("`unsafe` outside {home}: move this operation into a safe wrapper there"),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Rule 8: no import circles between the modules of the layered crates.
// ---------------------------------------------------------------------------------------------------------------

/// The source folders whose modules must form a layering (no file imports, directly or through others, a file that
/// imports it back): the GPU crate and the reference crate, where crate-wide helpers live in modules of their own.
const LAYERED_SOURCES: &[&str] = &["gpu/src/", "reference/src/"];

/// The module path of a file below its crate's source folder: `ring/state.rs` → `[ring, state]`, `ring/mod.rs` →
/// `[ring]`, `lib.rs` → `[]`.
fn module_path_of(relative: &str) -> Vec<String> {
    let stem = relative.strip_suffix(".rs").unwrap_or(relative);
    let mut parts: Vec<String> = stem.split('/').map(str::to_owned).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The file that defines the module a path names: the longest prefix of `path` that is a file (`a/b.rs` or
/// `a/b/mod.rs`), else the crate root `lib.rs` (an item of the root, or a re-export there).
fn module_file(files: &BTreeMap<String, String>, path: &[String]) -> String {
    for n in (1..=path.len()).rev() {
        let stem = path[..n].join("/");
        for candidate in [format!("{stem}.rs"), format!("{stem}/mod.rs")] {
            if files.contains_key(&candidate) {
                return candidate;
            }
        }
    }
    "lib.rs".to_owned()
}

/// The module paths that `code` names through `crate::…` and `super::…` (a `use` line or a qualified path), seen from
/// the module `here`. Lower-case segments only: a type or function name ends the module part of a path.
fn named_modules(code: &str, here: &[String]) -> Vec<Vec<String>> {
    let is_path_char = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    let mut named = Vec::new();
    let bytes = code.as_bytes();
    for (at, _) in code.match_indices("crate::").chain(code.match_indices("super::")) {
        // Only where the keyword starts a path, not inside another identifier (`my_crate::`).
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_' || bytes[at - 1] == b':') {
            continue;
        }
        let text: String = code[at..].chars().take_while(|&c| is_path_char(c)).collect();
        let mut segments = text.split("::").filter(|s| !s.is_empty());
        let mut path: Vec<String> = match segments.next() {
            Some("crate") => Vec::new(),
            _ => here[..here.len().saturating_sub(1)].to_vec(),
        };
        for segment in segments {
            match segment {
                "super" => {
                    path.pop();
                }
                s if s.chars().next().is_some_and(|c| c.is_lowercase()) => path.push(s.to_owned()),
                _ => break,
            }
        }
        named.push(path);
    }
    named
}

/// Rule 8: the modules of one crate's source folder (`files`: paths relative to it, with their text) import each
/// other without a circle. An edge goes from a file to the file of every module it names with `crate::…` or
/// `super::…` outside its `#[cfg(test)]` part (tests may reach anywhere), comments and strings ignored. A parent's
/// `pub use child::Item` re-export is not an edge (it names no `crate::`/`super::` path): a facade over its own
/// children is not a layer above them. `src_root` prefixes the paths in the violations.
fn check_module_cycles(src_root: &str, files: &BTreeMap<String, String>) -> Vec<Violation> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, text) in files {
        let stripped = strip_comments_and_strings(text);
        let code = stripped.split("#[cfg(test)]").next().unwrap_or("");
        for path in named_modules(code, &module_path_of(file)) {
            let target = module_file(files, &path);
            if &target != file {
                edges.entry(file.clone()).or_default().insert(target);
            }
        }
    }
    // Depth-first search; each circle is reported once, at the file where the search closed it.
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        circles: &mut Vec<Vec<String>>,
    ) {
        if let Some(at) = path.iter().position(|n| n == node) {
            circles.push(path[at..].to_vec());
            return;
        }
        if done.contains(node) {
            return;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            visit(next, edges, path, done, circles);
        }
        path.pop();
        done.insert(node.to_owned());
    }
    let (mut done, mut circles) = (BTreeSet::new(), Vec::new());
    for file in files.keys() {
        visit(file, &edges, &mut Vec::new(), &mut done, &mut circles);
    }
    circles
        .into_iter()
        .map(|circle| {
            let shown: Vec<String> = circle.iter().chain(circle.first()).map(|f| format!("{src_root}{f}")).collect();
            Violation::new(
                &format!("{src_root}{}", circle[0]),
                1,
                Rule::ModuleCycle,
                format!(
                    "modules import each other in a circle: {}; move what both need into a module of its own",
                    shown.join(" -> ")
                ),
            )
        })
        .collect()
}

/// The Rust files of a crate's source folder below `src_root` (the `bin/` targets excluded: they are crates of their
/// own), keyed by their path relative to it.
fn layered_sources(root: &Path, files: &[String], src_root: &str) -> BTreeMap<String, String> {
    files
        .iter()
        .filter_map(|f| f.strip_prefix(src_root).map(|rel| (f, rel)))
        .filter(|(_, rel)| rel.ends_with(".rs") && !rel.starts_with("bin/"))
        .filter_map(|(f, rel)| std::fs::read_to_string(root.join(f)).ok().map(|text| (rel.to_owned(), text)))
        .collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Rule 7: no ignored tests, no leftover debugging macros.
// ---------------------------------------------------------------------------------------------------------------

/// The code patterns rule 7 rejects, each with the advice printed beside it.
const FORBIDDEN: &[(&str, &str)] = &[
    ("#[ignore", "an ignored test checks nothing: make it pass, make it skip at run time with a reason, or delete it"),
    ("dbg!(", "a leftover `dbg!`: remove it, or print through the code's own reporting"),
    ("todo!(", "a `todo!` panics when reached: implement it, or return a typed error"),
];

/// Rule 7: no Rust code contains `#[ignore` (an ignored test), `dbg!(` or `todo!(`; comments and strings may mention
/// them (see [`strip_comments_and_strings`]). A macro is matched only as a whole name (`my_dbg!(` is not `dbg!(`).
fn check_forbidden_macros(path: &str, text: &str) -> Vec<Violation> {
    if !is_rust(path) {
        return Vec::new();
    }
    let code = strip_comments_and_strings(text);
    let mut violations = Vec::new();
    for (index, line) in code.lines().enumerate() {
        for (pattern, advice) in FORBIDDEN {
            let whole = line.match_indices(pattern).any(|(at, _)| {
                let ident_start = pattern.starts_with(|c: char| c.is_alphanumeric());
                let before = line[..at].chars().next_back();
                let after = line[at + pattern.len()..].chars().next();
                let starts_alone = !ident_start || before.is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
                // `#[ignore` must be the attribute itself, not `#[ignored_thing]`.
                let ends_alone = ident_start || after.is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
                starts_alone && ends_alone
            });
            if whole {
                violations.push(Violation::new(
                    path,
                    index + 1,
                    Rule::ForbiddenMacro,
                    format!("`{pattern}`: {advice}"),
                ));
            }
        }
    }
    violations
}

// ---------------------------------------------------------------------------------------------------------------
// The repository run.
// ---------------------------------------------------------------------------------------------------------------

/// Folders never walked when git cannot list the files: build outputs, git's own data, npm installs, the GPU bundle.
const SKIPPED_FOLDERS: &[&str] = &["target", ".git", "node_modules", "gpu-bundle"];

/// The repository's files, relative to `root` with `/` separators, sorted.
///
/// From git when it is available: tracked files plus untracked files that are not ignored (new files exist before
/// they are committed), keeping only those still on disk (a file moved without git is still tracked under its old
/// path). Otherwise a walk of `root` that skips [`SKIPPED_FOLDERS`].
fn repository_files(root: &Path) -> Result<Vec<String>> {
    let listed = Command::new("git")
        .args(["ls-files", "-z", "--cached", "--others", "--exclude-standard"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|output| output.status.success());
    let mut files = match listed {
        Some(output) => String::from_utf8(output.stdout)
            .context("git ls-files printed a non-UTF-8 path")?
            .split('\0')
            .filter(|path| !path.is_empty() && root.join(path).is_file())
            .map(str::to_owned)
            .collect(),
        None => {
            let mut files = Vec::new();
            walk(root, root, &mut files)?;
            files
        }
    };
    files.sort();
    files.dedup();
    Ok(files)
}

/// Collects the files under `dir` into `files`, relative to `root`, skipping [`SKIPPED_FOLDERS`].
fn walk(root: &Path, dir: &Path, files: &mut Vec<String>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        if entry.file_type()?.is_dir() {
            if !SKIPPED_FOLDERS.iter().any(|skipped| name == *skipped) {
                walk(root, &path, files)?;
            }
        } else if let Ok(relative) = path.strip_prefix(root) {
            let parts: Vec<String> =
                relative.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            files.push(parts.join("/"));
        }
    }
    Ok(())
}

/// Runs every rule over the repository at `root` whose files are `files`, and returns the violations sorted.
fn check_repository(root: &Path, files: &[String]) -> Result<Vec<Violation>> {
    let mut violations = Vec::new();
    for path in files {
        // Extensionless files are read to see whether a shebang makes them scripts.
        let read = header_style(path, "").is_some() || is_outside_path_checked(path, "") || extension(path).is_empty();
        if !read {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(root.join(path)) else {
            // Not UTF-8: a binary file, which no rule reads.
            continue;
        };
        violations.extend(check_header(path, &text));
        if is_outside_path_checked(path, &text) {
            violations.extend(check_outside_paths(path, &text));
        }
        violations.extend(check_safety_comments(path, &text));
        violations.extend(check_unsafe_location(path, &text));
        violations.extend(check_forbidden_macros(path, &text));
    }

    let root_manifest = std::fs::read_to_string(root.join("Cargo.toml")).context("reading the root Cargo.toml")?;
    let members = workspace_members(&root_manifest);
    if members.is_empty() {
        bail!("no `[workspace] members` found in the root Cargo.toml");
    }
    let mut manifests = Vec::new();
    for member in &members {
        let path = format!("{member}/Cargo.toml");
        match std::fs::read_to_string(root.join(&path)) {
            Ok(text) => manifests.push(parse_manifest(&path, &text)),
            Err(err) => violations.push(Violation::new(
                "Cargo.toml",
                1,
                Rule::Dependency,
                format!("member `{member}`: cannot read {path}: {err}"),
            )),
        }
    }
    violations.extend(check_dependency_rule("Cargo.toml", &manifests));

    for src_root in LAYERED_SOURCES {
        let sources = layered_sources(root, files, src_root);
        if sources.is_empty() {
            violations.push(Violation::new(src_root, 1, Rule::ModuleCycle, "no Rust source found in this folder"));
        }
        violations.extend(check_module_cycles(src_root, &sources));
    }

    match std::fs::read_to_string(root.join(ARCHITECTURE)) {
        Ok(architecture) => {
            let sources: Vec<&str> = files.iter().map(String::as_str).collect();
            let crate_folders: Vec<&str> = members.iter().map(String::as_str).collect();
            violations.extend(check_architecture_names(&architecture, &crate_folders, &sources));
        }
        Err(_) => violations.push(Violation::new(ARCHITECTURE, 1, Rule::Architecture, "the file is missing")),
    }

    violations.sort();
    Ok(violations)
}

/// Every rule over the whole repository; fails listing each violation as `path:line: rule: what`.
#[test]
fn tidy() {
    let root = crate::repo_root();
    let files = repository_files(&root).expect("listing the repository's files");
    assert!(files.iter().any(|f| f == "xtask/src/tidy.rs"), "the file listing missed this very file: {files:?}");
    let violations = check_repository(&root, &files).expect("reading the repository");
    let listing: Vec<String> = violations.iter().map(ToString::to_string).collect();
    assert!(violations.is_empty(), "{} tidy violations:\n{}", violations.len(), listing.join("\n"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(files: &[(&str, &str)]) -> BTreeMap<String, String> {
        files.iter().map(|(path, text)| ((*path).to_owned(), (*text).to_owned())).collect()
    }

    #[test]
    fn module_cycle_is_reported_through_crate_and_super_paths() {
        // flash.rs → ring/state.rs (crate::), ring/state.rs → flash.rs (super::super:: is the crate root, then
        // `flash`): a circle of two files.
        let files = sources(&[
            ("lib.rs", "pub mod flash;\npub mod ring;\n"),
            ("flash.rs", "use crate::ring::state::ChunkWindow;\n"),
            ("ring/mod.rs", "pub mod state;\n"),
            ("ring/state.rs", "use super::super::flash::GpuElement;\n"),
        ]);
        let found = check_module_cycles("gpu/src/", &files);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].rule, Rule::ModuleCycle);
        assert!(
            found[0].message.contains("gpu/src/flash.rs -> gpu/src/ring/state.rs -> gpu/src/flash.rs"),
            "{found:?}"
        );
    }

    #[test]
    fn module_cycle_ignores_layers_tests_comments_and_facades() {
        // Both import a helper module (a layer, no circle); the test module and a comment name the other file; the
        // parent re-exports its child (a facade); the child uses its parent's helper through `super::`.
        let files = sources(&[
            ("lib.rs", "pub mod common;\npub mod flash;\npub mod backward;\npub mod sparse;\n"),
            ("common.rs", "pub trait GpuElement {}\n"),
            ("flash.rs", "use crate::common::GpuElement;\n// crate::backward::x\n"),
            (
                "backward.rs",
                "use crate::common::GpuElement;\nuse crate::flash::check;\n#[cfg(test)]\nmod t { use crate::backward::x; use crate::flash::y; }\n",
            ),
            ("sparse/mod.rs", "pub mod block;\npub use block::forward;\npub(crate) struct RowState;\n"),
            ("sparse/block.rs", "use super::RowState;\nconst S: &str = \"crate::flash::\";\n"),
        ]);
        assert_eq!(check_module_cycles("gpu/src/", &files), Vec::<Violation>::new());
        // The same files with one edge added back from flash.rs to backward.rs close a circle.
        let mut broken = files.clone();
        broken.insert("flash.rs".to_owned(), "use crate::common::GpuElement;\nuse crate::backward::Plan;\n".to_owned());
        assert_eq!(check_module_cycles("gpu/src/", &broken).len(), 1);
    }

    #[test]
    fn module_paths_of_files() {
        assert_eq!(module_path_of("lib.rs"), Vec::<String>::new());
        assert_eq!(module_path_of("ring/mod.rs"), ["ring"]);
        assert_eq!(module_path_of("ring/state.rs"), ["ring", "state"]);
        let here = module_path_of("ring/state.rs");
        assert_eq!(named_modules("use super::link::StreamLink;", &here), [vec!["ring".to_owned(), "link".to_owned()]]);
        assert_eq!(named_modules("x: my_crate::a::B", &here), Vec::<Vec<String>>::new());
    }

    /// `n` steps up, built at run time so that this file's own text climbs nowhere.
    fn up(n: usize) -> String {
        "../".repeat(n)
    }

    /// An absolute path under a private root, built at run time for the same reason.
    fn private(root: &str, rest: &str) -> String {
        format!("/{root}/{rest}")
    }

    fn rules(violations: &[Violation]) -> Vec<(usize, Rule)> {
        violations.iter().map(|v| (v.line, v.rule)).collect()
    }

    #[test]
    fn violation_prints_path_line_rule_message() {
        let v = Violation::new("gpu/src/x.rs", 7, Rule::SafetyComment, "explain");
        assert_eq!(v.to_string(), "gpu/src/x.rs:7: safety-comment: explain");
    }

    #[test]
    fn header_rust_requires_inner_doc_line() {
        assert!(check_header("a/b.rs", "//! Says what this is for.\nfn f() {}\n").is_empty());
        assert_eq!(rules(&check_header("a/b.rs", "// plain comment\nfn f() {}\n")), [(1, Rule::Header)]);
        assert_eq!(rules(&check_header("a/b.rs", "use std::fmt;\n")), [(1, Rule::Header)]);
        assert_eq!(rules(&check_header("a/b.rs", "//!\n//! text on line two\n")), [(1, Rule::Header)]);
        assert_eq!(rules(&check_header("a/b.rs", "")), [(1, Rule::Header)]);
    }

    #[test]
    fn header_cuda_and_js_use_slash_slash() {
        assert!(check_header("gpu/kernels/k.cu", "// The kernel.\n__global__ void k() {}\n").is_empty());
        assert!(check_header("gpu/kernels/k.cuh", "// Helpers.\n").is_empty());
        assert!(check_header("x/check.mjs", "// check.mjs: loads pages.\n").is_empty());
        assert_eq!(rules(&check_header("gpu/kernels/k.cu", "#include <x>\n")), [(1, Rule::Header)]);
        assert_eq!(rules(&check_header("gpu/kernels/k.cuh", "/// doc\n")), [(1, Rule::Header)]);
    }

    #[test]
    fn header_scripts_follow_the_shebang() {
        assert!(check_header("x/run.sh", "#!/usr/bin/env bash\n# Runs things.\nset -e\n").is_empty());
        assert!(check_header(".ci/run", "#!/usr/bin/env bash\n# The CI entry point.\n").is_empty());
        assert_eq!(rules(&check_header("x/run.sh", "#!/usr/bin/env bash\nset -e\n")), [(2, Rule::Header)]);
        assert_eq!(rules(&check_header(".ci/run", "#!/bin/sh\n\n# late\n")), [(2, Rule::Header)]);
        // Files without an extension and without a shebang are not scripts.
        assert!(check_header(".gitignore", "target/\n").is_empty());
    }

    #[test]
    fn header_python_is_a_docstring() {
        assert!(check_header("p/a.py", "\"\"\"Writes case files.\n\nMore.\n\"\"\"\n").is_empty());
        assert!(check_header("p/a.py", "#!/usr/bin/env python3\n\"\"\"Times kernels.\n\"\"\"\n").is_empty());
        assert_eq!(rules(&check_header("p/a.py", "import os\n")), [(1, Rule::Header)]);
        assert_eq!(
            rules(&check_header("p/a.py", "#!/usr/bin/env python3\n\"\"\"\nlate\n\"\"\"\n")),
            [(2, Rule::Header)]
        );
        assert_eq!(rules(&check_header("tool", "#!/usr/bin/env python3\n# hash comment\n")), [(2, Rule::Header)]);
    }

    #[test]
    fn code_spans_skip_fences_and_pair_per_paragraph() {
        let md = "Text `a/b.rs` and `c/`.\n\n```\n`not/a/span.rs`\n```\n\nA stray ` here.\n\nThen `d/e.cu`.\n";
        assert_eq!(code_spans(md), ["a/b.rs", "c/", "here.", "d/e.cu"]);
    }

    #[test]
    fn architecture_names_by_path_or_folder() {
        let doc = "The crate `oracle/`, the ring `gpu/src/ring/`, the file `gpu/src/launch.rs`, all of `xtask/src/`.\n\
                   Not a folder: `gpu/kernels`; a bare name: `flash.rs`.\n";
        let sources = [
            "oracle/src/lib.rs",
            "oracle/build.rs",
            "gpu/src/ring/state.rs",
            "gpu/src/launch.rs",
            "gpu/src/flash.rs",
            "gpu/kernels/flash_fwd.cu",
            "xtask/src/deep/er.rs",
            "README.md",
            "fixtures/browser/run.sh",
        ];
        let violations = check_architecture_names(doc, &["oracle", "gpu", "xtask"], &sources);
        let named: Vec<&str> = violations.iter().map(|v| v.path.as_str()).collect();
        assert_eq!(named, ["gpu/src/flash.rs", "gpu/kernels/flash_fwd.cu"]);
        assert!(violations.iter().all(|v| v.rule == Rule::Architecture));
        assert!(violations[0].message.contains("`gpu/src/`"), "{}", violations[0].message);
    }

    #[test]
    fn architecture_crate_folder_names_only_the_crate_top() {
        let doc = "The crate `gpu/` and `oracle/src/lib.rs`, the driver `reference/ring-driver/`.";
        let crates = ["gpu", "oracle", "reference", "reference/ring-driver"];
        let covered = ["gpu/src/lib.rs", "gpu/build.rs", "oracle/src/lib.rs", "reference/ring-driver/src/lib.rs"];
        assert!(check_architecture_names(doc, &crates, &covered).is_empty());
        let deeper = ["gpu/src/ring/mod.rs", "gpu/tests/device.rs", "gpu/kernels/common.cuh", "reference/src/lib.rs"];
        let violations = check_architecture_names(doc, &crates, &deeper);
        let named: Vec<&str> = violations.iter().map(|v| v.path.as_str()).collect();
        assert_eq!(named, deeper);
    }

    #[test]
    fn outside_paths_relative_climb_depends_on_the_files_folder() {
        let top = format!("See `{}shared/DESIGN.md`.", up(1));
        assert_eq!(rules(&check_outside_paths("ARCHITECTURE.md", &top)), [(1, Rule::OutsidePath)]);
        assert!(check_outside_paths("docs/x.md", &top).is_empty());
        let include = format!("include_str!(\"{}gpu/kernels/common.cuh\")", up(3));
        assert!(check_outside_paths("gpu/src/ring/state.rs", &include).is_empty());
        assert_eq!(rules(&check_outside_paths("gpu/src/lib.rs", &include)), [(1, Rule::OutsidePath)]);
        let bare = format!("cd {}..", up(1));
        assert_eq!(rules(&check_outside_paths("x/run.sh", &format!("ok\n{bare}\n"))), [(2, Rule::OutsidePath)]);
        assert!(check_outside_paths("a/b/run.sh", &bare).is_empty());
        // A climb inside a longer path is not a start, and an ellipsis is not a climb.
        assert!(check_outside_paths("x/run.sh", &format!("cd \"$(dirname \"$0\")/{}..\"", up(3))).is_empty());
        assert!(check_outside_paths("a.md", "(exp, ln, ...) and 0..n").is_empty());
    }

    #[test]
    fn outside_paths_private_roots_are_reported() {
        let cases = format!("python3 dump.py --out {}", private("work", "peer-cases"));
        let violations = check_outside_paths("docs/peers.md", &cases);
        assert_eq!(rules(&violations), [(1, Rule::OutsidePath)]);
        assert!(violations[0].message.contains("peer-cases"), "{}", violations[0].message);
        let cache = format!("\"{}\"", private("root", ".cache/x"));
        assert_eq!(rules(&check_outside_paths("x/src/a.rs", &cache)), [(1, Rule::OutsidePath)]);
        let scratch = format!("ln -s x {}", private("tmp", "brief"));
        assert_eq!(rules(&check_outside_paths("x/run.sh", &scratch)), [(1, Rule::OutsidePath)]);
    }

    #[test]
    fn outside_paths_system_and_own_scratch_paths_pass() {
        let own = private("tmp", "attnproof-nccl/libnccl.so");
        let text = format!(
            "CUDA_HOME=/usr/local/cuda\ncmd >/dev/null 2>&1\n/proc/self/stat\nln -sf x {own}\nTMP=${{TMPDIR:-/tmp}}\n\
             https://github.com/a/work/b\n$HOME/work/x\n/rootfs/a\n"
        );
        assert!(check_outside_paths("x/run.sh", &text).is_empty(), "{:?}", check_outside_paths("x/run.sh", &text));
    }

    const ROOT_MANIFEST: &str = "[workspace]\nresolver = \"3\"\nmembers = [\"oracle\", \"gpu\", # the kernels\n  \
                                 \"xtask\"]\n\n[workspace.dependencies]\nmembers = [\"not-this\"]\n";

    #[test]
    fn workspace_members_read_multi_line_arrays() {
        assert_eq!(workspace_members(ROOT_MANIFEST), ["oracle", "gpu", "xtask"]);
        assert_eq!(workspace_members("[workspace]\nmembers = [\"a\", \"b/c\"]\n"), ["a", "b/c"]);
    }

    #[test]
    fn manifest_reads_normal_dependencies_only() {
        let text = "[package]\nname = \"attnproof-gpu\" # the crate\n\n[dependencies]\n\
                    attnproof-oracle.workspace = true\nring = { package = \"attnproof-ring-driver\", path = \"x\" }\n\
                    half = \"2\"\n\n[dev-dependencies]\nattnproof-harness.workspace = true\n\n\
                    [target.'cfg(unix)'.dependencies]\nlibc = \"0.2\"\n\n[dependencies.renamed]\n\
                    package = \"attnproof-proofs\"\npath = \"p\"\n\n[build-dependencies]\ncc = \"1\"\n";
        let manifest = parse_manifest("gpu/Cargo.toml", text);
        assert_eq!(manifest.package, Some(("attnproof-gpu".to_owned(), 2)));
        let names: Vec<&str> = manifest.dependencies.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["attnproof-oracle", "attnproof-ring-driver", "half", "libc", "attnproof-proofs"]);
        assert_eq!(manifest.dependencies[0].1, 5);
    }

    fn manifest(path: &str, package: &str, dependencies: &[&str]) -> Manifest {
        Manifest {
            path: path.to_owned(),
            package: Some((package.to_owned(), 2)),
            dependencies: dependencies.iter().enumerate().map(|(i, d)| ((*d).to_owned(), 10 + i)).collect(),
        }
    }

    /// A workspace of every crate in the rule, each with the dependencies the rule allows it.
    fn lawful_workspace() -> Vec<Manifest> {
        vec![
            manifest("oracle/Cargo.toml", "attnproof-oracle", &["rug"]),
            manifest("reference/ring-driver/Cargo.toml", "attnproof-ring-driver", &["attnproof-oracle"]),
            manifest("proofs/Cargo.toml", "attnproof-proofs", &["attnproof-oracle"]),
            manifest("fixtures/Cargo.toml", "attnproof-fixtures", &["attnproof-oracle", "attnproof-proofs"]),
            manifest("reference/Cargo.toml", "attnproof-reference", &["attnproof-oracle", "attnproof-ring-driver"]),
            manifest("gpu/Cargo.toml", "attnproof-gpu", &["attnproof-oracle", "attnproof-ring-driver", "cudarc"]),
            manifest(
                "tests/Cargo.toml",
                "attnproof-harness",
                &["attnproof-oracle", "attnproof-proofs", "attnproof-reference", "attnproof-gpu"],
            ),
            manifest("xtask/catalog/Cargo.toml", "attnproof-catalog", &[]),
            manifest("python/Cargo.toml", "attnproof-python", &["attnproof-harness", "pyo3"]),
            manifest("xtask/Cargo.toml", "xtask", &["attnproof-catalog", "anyhow"]),
        ]
    }

    #[test]
    fn dependency_rule_accepts_the_lawful_workspace() {
        assert!(check_dependency_rule("Cargo.toml", &lawful_workspace()).is_empty());
    }

    #[test]
    fn dependency_rule_rejects_a_forbidden_edge() {
        let mut workspace = lawful_workspace();
        workspace[5].dependencies.push(("attnproof-reference".to_owned(), 42));
        let violations = check_dependency_rule("Cargo.toml", &workspace);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert_eq!((violations[0].path.as_str(), violations[0].line), ("gpu/Cargo.toml", 42));
        assert!(violations[0].message.contains("attnproof-oracle, attnproof-ring-driver"), "{}", violations[0].message);

        let mut workspace = lawful_workspace();
        workspace[6].dependencies.push(("xtask".to_owned(), 9));
        assert_eq!(rules(&check_dependency_rule("Cargo.toml", &workspace)), [(9, Rule::Dependency)]);
    }

    #[test]
    fn dependency_rule_rejects_unknown_and_stale_crates() {
        let mut workspace = lawful_workspace();
        workspace.push(manifest("newcrate/Cargo.toml", "attnproof-new", &[]));
        let violations = check_dependency_rule("Cargo.toml", &workspace);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert_eq!(violations[0].path, "newcrate/Cargo.toml");

        let mut workspace = lawful_workspace();
        workspace.retain(|m| m.path != "xtask/catalog/Cargo.toml");
        let violations = check_dependency_rule("Cargo.toml", &workspace);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].message.contains("attnproof-catalog"));

        let mut workspace = lawful_workspace();
        workspace[0].package = None;
        assert!(check_dependency_rule("Cargo.toml", &workspace).iter().any(|v| v.path == "oracle/Cargo.toml"));
    }

    #[test]
    fn strip_blanks_comments_strings_and_chars_keeping_lines() {
        let text = "let a = \"un\\\"safe\"; // unsafe\n/* unsafe /* nested */ still */ let b = 'x';\n\
                    let c = r#\"raw \" unsafe\"#; let d = '\\''; fn f<'a>(x: &'a u8) {}\nunsafe_code\n";
        let code = strip_comments_and_strings(text);
        assert_eq!(code.lines().count(), text.lines().count());
        assert!(!code.contains("safe\""), "{code}");
        assert!(unsafe_lines(&code).is_empty(), "{code}");
        assert!(code.contains("fn f<'a>(x: &'a u8)"), "{code}");
        assert!(code.contains("let b =") && code.contains("let c =") && code.contains("let d ="), "{code}");
        assert_eq!(unsafe_lines(&strip_comments_and_strings("a\n  let x = unsafe { f() };\n")), [1]);
        assert_eq!(unsafe_lines(&strip_comments_and_strings("let s = br\"x\"; unsafe {}\n")), [0]);
    }

    #[test]
    fn safety_comment_window_is_the_comment_run_above() {
        let good = "fn f() {\n    // SAFETY: the pointer is live.\n    // More reasons.\n    unsafe { g() }\n}\n\
                    // SAFETY: sound.\n#[allow(x)]\nunsafe impl Send for T {}\n\
                    /// Does it.\n///\n/// # Safety\n/// The caller keeps p live.\npub unsafe fn h(p: *const u8) {}\n\
                    let y = unsafe { g() }; // SAFETY: same line.\n";
        assert!(
            check_safety_comments("gpu/src/launch.rs", good).is_empty(),
            "{:?}",
            check_safety_comments("a.rs", good)
        );
        let separated = "// SAFETY: about something else.\n\nunsafe { g() }\n";
        assert_eq!(rules(&check_safety_comments("a.rs", separated)), [(3, Rule::SafetyComment)]);
        let after_code = "// SAFETY: about the line below only.\nlet a = 1;\nunsafe impl Sync for T {}\n";
        assert_eq!(rules(&check_safety_comments("a.rs", after_code)), [(3, Rule::SafetyComment)]);
        let safety_doc_on_block = "/// # Safety\nlet x = unsafe { g() };\n";
        assert_eq!(rules(&check_safety_comments("a.rs", safety_doc_on_block)), [(2, Rule::SafetyComment)]);
        assert!(check_safety_comments("a.cu", "unsafe\n").is_empty());
    }

    #[test]
    fn unsafe_is_confined_to_launch_rs() {
        let text =
            "//! Docs mention unsafe.\n#![forbid(unsafe_code)]\nfn f() {\n    // SAFETY: x\n    unsafe { g() }\n}\n";
        assert_eq!(rules(&check_unsafe_location("gpu/src/flash.rs", text)), [(5, Rule::UnsafeLocation)]);
        assert_eq!(rules(&check_unsafe_location("gpu/src/ring/state.rs", text)), [(5, Rule::UnsafeLocation)]);
        assert!(check_unsafe_location("gpu/src/launch.rs", text).is_empty());
        assert_eq!(rules(&check_unsafe_location("oracle/src/dense.rs", text)), [(5, Rule::UnsafeLocation)]);
        assert!(check_unsafe_location("oracle/src/real.rs", text).is_empty());
        assert!(check_unsafe_location("gpu/tests/device.rs", text).is_empty());
        assert!(
            check_unsafe_location("gpu/src/lib.rs", "//! Every `unsafe` is in launch.\nconst S: &str = \"unsafe\";\n")
                .is_empty()
        );
    }

    #[test]
    fn forbidden_macros_in_code_only() {
        let bad = "#[test]\n#[ignore]\nfn t() {\n    dbg!(x);\n    todo!()\n}\n#[ignore = \"slow\"]\nfn u() {}\n";
        assert_eq!(
            rules(&check_forbidden_macros("a/tests/t.rs", bad)),
            [
                (2, Rule::ForbiddenMacro),
                (4, Rule::ForbiddenMacro),
                (5, Rule::ForbiddenMacro),
                (7, Rule::ForbiddenMacro)
            ]
        );
        let clean =
            "// never dbg!(x) or #[ignore]\nconst S: &str = \"todo!()\";\nmy_dbg!(x);\n#[ignored_helper]\nfn f() {}\n";
        assert!(check_forbidden_macros("a.rs", clean).is_empty(), "{:?}", check_forbidden_macros("a.rs", clean));
        assert!(check_forbidden_macros("a.md", bad).is_empty());
    }

    #[test]
    fn repository_listing_skips_build_output() {
        let files = repository_files(&crate::repo_root()).unwrap();
        assert!(files.iter().any(|f| f == "Cargo.toml"));
        assert!(files.iter().all(|f| !f.starts_with("target/") && !f.starts_with(".git/")));
    }

    #[test]
    fn walk_finds_files_and_skips_build_folders() {
        let root = crate::repo_root();
        let mut files = Vec::new();
        walk(&root.join("xtask"), &root.join("xtask"), &mut files).unwrap();
        assert!(files.iter().any(|f| f == "src/tidy.rs"), "{files:?}");
        assert!(files.iter().all(|f| !f.split('/').any(|part| SKIPPED_FOLDERS.contains(&part))));
    }
}
