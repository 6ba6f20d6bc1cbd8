//! The equation index: fills the generated "Where" blocks of `docs/equations.md` from the equation tags in the
//! source, and checks that the document and the code name the same equations.
//!
//! This is a source-generation test in the manner of rust-analyzer's `sourcegen`: the test regenerates the document,
//! compares it with the file on disk and, when they differ, writes the new text and fails, so that a stale index
//! cannot be committed by accident and fixing it is one test run.
//!
//! # Tag grammar
//!
//! A *label* is the letter `E`, a decimal number without a leading zero, and at most one lowercase letter: `E4`,
//! `E11a`. A label counts only as a whole word: the characters right before and after it are not ASCII letters,
//! digits or `_` (so `0xE1` and `E4M3` are not labels), and a label written between backticks is a mention of the
//! label itself, not a tag (the book's parser documents its `` `E1` `` syntax that way).
//! A *range* is a label, an en dash `–` or a hyphen `-`, then a second label whose `E` may be omitted: `E18–E20`,
//! `E6-E10`, `E2–5`. It stands for every number from the first to the last, without letters (`E6–E10` does not
//! include `E10a`); between two lettered labels of one number it stands for the letters in between (`E1a–E1d`). A
//! range whose end comes before its start stands for its two ends only. Two labels joined by an ellipsis (`E1 … E32`,
//! `E1..E32`) name the equation sheet as a whole and tag nothing.
//!
//! # Where tags are read
//!
//! In `*.rs`, `*.cu` and `*.cuh` files only comments count (code and string literals are skipped). A tag in an outer
//! doc comment (`///`, `/** */`) names the item the comment documents, prefixed by its `impl` or `trait` type; a tag
//! in an inner doc comment (`//!`) or a plain comment names the file. In the book's chapters (`fixtures/book/*.md`)
//! the whole text counts and names the chapter. Each file is classified by its path into a [`Kind`].

#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::path::Path;

/// The document, relative to the repository root, whose "Where" blocks this module generates.
const DOC: &str = "docs/equations.md";

/// The message of a failing freshness test after it rewrote the document.
const STALE: &str = "docs/equations.md was stale; it has been updated, commit it";

/// Directories never scanned: build outputs, version control, node modules, the GPU bundle.
const SKIPPED_DIRS: &[&str] = &["target", ".git", "node_modules", "gpu-bundle"];

/// This file: its tests and docs spell out labels as examples, which are not tags.
const SELF_PATH: &str = "xtask/src/equations.rs";

/// An equation label such as `E11a`: its number and optional letter, ordered by number, then letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Label {
    /// The equation number, at least 1.
    number: u32,
    /// The lowercase letter after the number, if any.
    letter: Option<char>,
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "E{}", self.number)?;
        if let Some(letter) = self.letter {
            write!(f, "{letter}")?;
        }
        Ok(())
    }
}

/// What kind of place implements or checks an equation, decided by the file's path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// `oracle/src/`: the equation as a generic function over the scalar trait.
    Oracle,
    /// `proofs/src/`: a theorem about it.
    Theorem,
    /// `fixtures/src/` (outside the book): a worked example.
    Fixture,
    /// `reference/src/` and `reference/ring-driver/src/`: a tiled CPU schedule.
    Reference,
    /// `gpu/src/` and `gpu/kernels/`: a CUDA kernel or its host side.
    Kernel,
    /// The harness (`tests/`) and every crate's integration tests and examples.
    Check,
    /// `xtask/`: a mutant that must break a check of the equation.
    Mutant,
    /// `fixtures/book/` and the book's builder `fixtures/src/book/`.
    Book,
}

impl Kind {
    /// The name the document prints for this kind.
    fn title(self) -> &'static str {
        match self {
            Kind::Oracle => "oracle",
            Kind::Theorem => "theorem",
            Kind::Fixture => "fixture",
            Kind::Reference => "reference schedule",
            Kind::Kernel => "kernel",
            Kind::Check => "harness check",
            Kind::Mutant => "mutation catalog",
            Kind::Book => "book chapter",
        }
    }

    /// The kind of a file from its path relative to the repository root (with `/` separators), or `None` for a
    /// file outside every kind.
    fn of_path(path: &str) -> Option<Kind> {
        let in_tests = path.split('/').any(|part| part == "tests" || part == "examples");
        if path.starts_with("fixtures/book/") || path.starts_with("fixtures/src/book/") {
            Some(Kind::Book)
        } else if path.starts_with("tests/") || in_tests {
            Some(Kind::Check)
        } else if path.starts_with("oracle/") {
            Some(Kind::Oracle)
        } else if path.starts_with("proofs/") {
            Some(Kind::Theorem)
        } else if path.starts_with("fixtures/") {
            Some(Kind::Fixture)
        } else if path.starts_with("reference/") {
            Some(Kind::Reference)
        } else if path.starts_with("gpu/") {
            Some(Kind::Kernel)
        } else if path.starts_with("xtask/") {
            Some(Kind::Mutant)
        } else {
            None
        }
    }
}

/// One place that names an equation: a file, and the item there when the tag documents one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Place {
    /// What the place is.
    kind: Kind,
    /// The file, relative to the repository root.
    path: String,
    /// The documented item (`SoftmaxState::merge`), or `None` when the tag speaks for the whole file.
    item: Option<String>,
}

/// Every place of the code, per equation label.
type Index = BTreeMap<Label, BTreeSet<Place>>;

/// Whether `c` may be part of a word, which a label must not touch.
fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Parses a label at the start of `chars` (with its `E` when `needs_e`), returning it and the characters it used.
fn label_at(chars: &[char], needs_e: bool) -> Option<(Label, usize)> {
    let mut at = 0;
    if chars.first() == Some(&'E') {
        at = 1;
    } else if needs_e {
        return None;
    }
    let digits = chars[at..].iter().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 || digits > 3 || chars[at] == '0' {
        return None;
    }
    let number: u32 = chars[at..at + digits].iter().collect::<String>().parse().ok()?;
    at += digits;
    let letter = match chars.get(at) {
        Some(c) if c.is_ascii_lowercase() => {
            at += 1;
            Some(*c)
        }
        _ => None,
    };
    if chars.get(at).is_some_and(|c| is_word_char(*c)) {
        return None;
    }
    Some((Label { number, letter }, at))
}

/// The labels a range from `start` to `end` stands for (see the module docs).
fn expand_range(start: Label, end: Label) -> Vec<Label> {
    match (start.letter, end.letter) {
        (None, None) if start.number <= end.number => {
            (start.number..=end.number).map(|number| Label { number, letter: None }).collect()
        }
        (Some(first), Some(last)) if start.number == end.number && first <= last => {
            (first..=last).map(|letter| Label { number: start.number, letter: Some(letter) }).collect()
        }
        _ => vec![start, end],
    }
}

/// The length of an ellipsis and a second label after a first one (`..E32`, ` … E32`, `…E32`), the way prose names
/// the equation sheet as a whole (`E1 … E32`), which tags no equation.
fn sheet_span_len(after_label: &[char]) -> Option<usize> {
    let ellipsis = [&['.', '.'][..], &[' ', '…', ' '][..], &['…'][..]]
        .into_iter()
        .find(|ellipsis| after_label.starts_with(ellipsis))?
        .len();
    let (_, used) = label_at(&after_label[ellipsis..], true)?;
    Some(ellipsis + used)
}

/// Every equation label `text` tags, ranges expanded, in the order they appear.
fn tags_in(text: &str) -> Vec<Label> {
    let chars: Vec<char> = text.chars().collect();
    let mut labels = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_word = i == 0 || !is_word_char(chars[i - 1]);
        let Some((start, used)) = label_at(&chars[i..], true).filter(|_| starts_word) else {
            i += 1;
            continue;
        };
        let mut end_at = i + used;
        let mut range_end = None;
        if matches!(chars.get(end_at), Some('–' | '-'))
            && let Some((end, used_end)) = label_at(&chars[end_at + 1..], false)
        {
            range_end = Some(end);
            end_at += 1 + used_end;
        }
        let quoted = i > 0 && chars[i - 1] == '`' && chars.get(end_at) == Some(&'`');
        let sheet = range_end.is_none() && sheet_span_len(&chars[end_at..]).is_some();
        if sheet {
            end_at += sheet_span_len(&chars[end_at..]).unwrap_or(0);
        } else if !quoted {
            match range_end {
                Some(end) => labels.extend(expand_range(start, end)),
                None => labels.push(start),
            }
        }
        i = end_at;
    }
    labels
}

/// How a comment attaches to the code around it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CommentKind {
    /// `///` or `/** */`: documents the next item.
    OuterDoc,
    /// Anything else (`//!`, `/*! */`, `//`, `/* */`): speaks for the file.
    Other,
}

/// One comment's text, with the 0-based line on which it ends.
#[derive(Debug, PartialEq, Eq)]
struct Comment {
    /// Whether it documents the next item.
    kind: CommentKind,
    /// The line of the comment's last character.
    end_line: usize,
    /// The text after the comment's opening marker.
    text: String,
}

/// The comments of a Rust or CUDA source, skipping string literals, character literals and Rust's raw strings.
fn comments(source: &str) -> Vec<Comment> {
    let chars: Vec<char> = source.chars().collect();
    let mut found = Vec::new();
    let mut line = 0;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c == '/' && next == Some('/') {
            let end = chars[i..].iter().position(|&c| c == '\n').map_or(chars.len(), |n| i + n);
            let kind = if chars.get(i + 2) == Some(&'/') && chars.get(i + 3) != Some(&'/') {
                CommentKind::OuterDoc
            } else {
                CommentKind::Other
            };
            found.push(Comment { kind, end_line: line, text: chars[i + 2..end].iter().collect() });
            i = end;
        } else if c == '/' && next == Some('*') {
            let kind = if chars.get(i + 2) == Some(&'*') && chars.get(i + 3) != Some(&'/') {
                CommentKind::OuterDoc
            } else {
                CommentKind::Other
            };
            // Rust block comments nest; CUDA's do not, but a CUDA comment that opens another is rare enough that
            // reading it as nested costs nothing.
            let mut depth = 1;
            let mut j = i + 2;
            while j < chars.len() && depth > 0 {
                if chars[j] == '/' && chars.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if chars[j] == '*' && chars.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    if chars[j] == '\n' {
                        line += 1;
                    }
                    j += 1;
                }
            }
            let text_end = if depth == 0 { j - 2 } else { j };
            found.push(Comment { kind, end_line: line, text: chars[i + 2..text_end].iter().collect() });
            i = j;
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && (i == 0 || !is_word_char(chars[i - 1])) {
            let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
            if chars.get(i + 1 + hashes) != Some(&'"') {
                i += 1;
                continue;
            }
            let mut j = i + 2 + hashes;
            while j < chars.len() {
                if chars[j] == '"' && chars[j + 1..].iter().take(hashes).filter(|&&c| c == '#').count() == hashes {
                    j += 1 + hashes;
                    break;
                }
                if chars[j] == '\n' {
                    line += 1;
                }
                j += 1;
            }
            i = j;
        } else if c == '"' {
            let mut j = i + 1;
            while j < chars.len() && chars[j] != '"' {
                if chars[j] == '\\' {
                    j += 1;
                }
                if chars.get(j) == Some(&'\n') {
                    line += 1;
                }
                j += 1;
            }
            i = j + 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '"'); a Rust lifetime ('a) has no closing quote right after.
            if next == Some('\\') {
                let close = chars.get(i + 3..).and_then(|tail| tail.iter().take(10).position(|&c| c == '\''));
                i = close.map_or(i + 1, |n| i + 4 + n);
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    found
}

/// The name of the item a line declares (`fn`, `struct`, `enum`, `trait`, `const`, `static`, `type`, `mod`,
/// `union`, `macro_rules!`, or a CUDA function), or `None` for any other line.
fn declared_item(line: &str) -> Option<String> {
    let mut rest = line.trim();
    while let Some(stripped) = ["pub(crate) ", "pub(super) ", "pub ", "async ", "unsafe ", "extern \"C\" "]
        .iter()
        .find_map(|p| rest.strip_prefix(p))
    {
        rest = stripped;
    }
    if let Some(function) = rest.strip_prefix("const fn ") {
        rest = &rest[rest.len() - function.len() - "fn ".len()..];
    }
    let keywords =
        ["fn ", "struct ", "enum ", "trait ", "const ", "static ", "type ", "mod ", "union ", "macro_rules! "];
    if let Some(keyword) = keywords.iter().find(|k| rest.starts_with(**k)) {
        let name: String = rest[keyword.len()..].chars().take_while(|c| is_word_char(*c)).collect();
        return (!name.is_empty()).then_some(name);
    }
    // A CUDA function: `__global__ void name(`, `__device__ __forceinline__ float name(`, `template <...>` skipped.
    if rest.starts_with("__global__") || rest.starts_with("__device__") || rest.starts_with("static __device__") {
        let before_paren = &rest[..rest.find('(')?];
        let name: String =
            before_paren.chars().rev().take_while(|c| is_word_char(*c)).collect::<Vec<_>>().into_iter().rev().collect();
        return (!name.is_empty()).then_some(name);
    }
    None
}

/// The type an `impl` or `trait` line opens a block for (`impl<S> Trait for Ty<S> {` gives `Ty`).
fn block_owner(line: &str) -> Option<String> {
    let trimmed = line.trim_start().trim_start_matches("pub ").trim_start_matches("unsafe ");
    let rest = if let Some(rest) = trimmed.strip_prefix("impl").filter(|r| r.starts_with(['<', ' '])) {
        rest
    } else {
        trimmed.strip_prefix("trait ")?
    };
    // Drop the impl's own generic parameters, then take the type after ` for ` when there is one.
    let mut depth = 0;
    let mut without_generics = String::new();
    for c in rest.chars() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            _ if depth == 0 => without_generics.push(c),
            _ => {}
        }
    }
    let target = without_generics.split(" for ").last()?.trim();
    let name: String = target.split("::").last()?.chars().take_while(|c| is_word_char(*c)).collect();
    (!name.is_empty()).then_some(name)
}

/// The item an outer doc comment ending on line `doc_end` documents, `Type::item` inside an `impl` or `trait`.
fn documented_item(lines: &[&str], doc_end: usize) -> Option<String> {
    let item_line = lines[doc_end + 1..].iter().position(|line| {
        let t = line.trim_start();
        !(t.is_empty() || t.starts_with("///") || t.starts_with("#[") || t.starts_with("template"))
    })? + doc_end
        + 1;
    let name = declared_item(lines[item_line])?;
    let indent = |line: &str| line.len() - line.trim_start().len();
    let item_indent = indent(lines[item_line]);
    if item_indent == 0 {
        return Some(name);
    }
    // The innermost enclosing block opened at a smaller indentation, if it is an impl or a trait.
    let owner_line =
        lines[..item_line].iter().rev().find(|line| !line.trim().is_empty() && indent(line) < item_indent)?;
    Some(match block_owner(owner_line) {
        Some(owner) => format!("{owner}::{name}"),
        None => name,
    })
}

/// The places `text`, the contents of the file at `path` (relative, `/`-separated), gives each label it tags.
fn scan_file(path: &str, text: &str) -> Vec<(Label, Place)> {
    let Some(kind) = Kind::of_path(path) else {
        return Vec::new();
    };
    let place = |item: Option<String>| Place { kind, path: path.to_owned(), item };
    if path.ends_with(".md") {
        return tags_in(text).into_iter().map(|label| (label, place(None))).collect();
    }
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for comment in comments(text) {
        let labels = tags_in(&comment.text);
        if labels.is_empty() {
            continue;
        }
        let item = match comment.kind {
            CommentKind::OuterDoc => documented_item(&lines, comment.end_line),
            CommentKind::Other => None,
        };
        found.extend(labels.into_iter().map(|label| (label, place(item.clone()))));
    }
    found
}

/// Whether the file at `path` (relative, `/`-separated) is one the index reads.
fn is_scanned(path: &str) -> bool {
    let source = [".rs", ".cu", ".cuh"].iter().any(|ext| path.ends_with(ext));
    let chapter = path.starts_with("fixtures/book/") && path.ends_with(".md");
    (source || chapter) && path != SELF_PATH
}

/// Collects the scanned files below `dir` as paths relative to `root`, sorted.
fn walk(root: &Path, dir: &Path, files: &mut Vec<String>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if !SKIPPED_DIRS.iter().any(|skip| name == *skip) {
                walk(root, &path, files)?;
            }
            continue;
        }
        let relative = path.strip_prefix(root).unwrap_or(&path).to_string_lossy().replace('\\', "/");
        if is_scanned(&relative) {
            files.push(relative);
        }
    }
    Ok(())
}

/// The index of the whole repository below `root`.
fn collect(root: &Path) -> std::io::Result<Index> {
    let mut files = Vec::new();
    walk(root, root, &mut files)?;
    let mut index = Index::new();
    for file in files {
        let text = fs::read_to_string(root.join(&file))?;
        for (label, place) in scan_file(&file, &text) {
            index.entry(label).or_default().insert(place);
        }
    }
    Ok(index)
}

/// The generated body of one "Where" block: one line per kind, each file once with its items.
fn render_places(places: Option<&BTreeSet<Place>>) -> String {
    let Some(places) = places.filter(|p| !p.is_empty()) else {
        return "- **nowhere**: no file of the code tags this equation\n".to_owned();
    };
    let mut by_kind: BTreeMap<Kind, BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
    for place in places {
        let items = by_kind.entry(place.kind).or_default().entry(&place.path).or_default();
        if let Some(item) = &place.item {
            items.insert(item);
        }
    }
    let mut out = String::new();
    for (kind, files) in by_kind {
        let entries: Vec<String> = files
            .into_iter()
            .map(|(path, items)| {
                if items.is_empty() {
                    format!("`{path}`")
                } else {
                    let items: Vec<String> = items.into_iter().map(|item| format!("`{item}`")).collect();
                    format!("`{path}` ({})", items.join(", "))
                }
            })
            .collect();
        out.push_str(&format!("- **{}**: {}\n", kind.title(), entries.join("; ")));
    }
    out
}

/// The begin marker of `label`'s generated block.
fn begin_marker(label: Label) -> String {
    format!("<!-- where:{label} begin -->")
}

/// The end marker of `label`'s generated block.
fn end_marker(label: Label) -> String {
    format!("<!-- where:{label} end -->")
}

/// A document with its generated blocks refilled.
#[derive(Debug, PartialEq, Eq)]
struct Filled {
    /// The new text of the document.
    text: String,
    /// The equations the document restates (those with a generated block), in document order.
    restated: Vec<Label>,
}

/// Refills every `<!-- where:LABEL begin -->` … `<!-- where:LABEL end -->` block of `doc` from `index`, or says
/// which marker is malformed.
fn fill(doc: &str, index: &Index) -> Result<Filled, String> {
    const OPEN: &str = "<!-- where:";
    let mut text = String::new();
    let mut restated = Vec::new();
    let mut rest = doc;
    while let Some(start) = rest.find(OPEN) {
        let after_open = &rest[start + OPEN.len()..];
        let label_text = after_open.split_whitespace().next().unwrap_or_default();
        let label = match tags_in(label_text).as_slice() {
            [label] if label.to_string() == label_text => *label,
            _ => return Err(format!("`{OPEN}{label_text}`: not an equation label")),
        };
        let begin = begin_marker(label);
        if !rest[start..].starts_with(&begin) {
            return Err(format!("expected `{begin}`"));
        }
        let end = end_marker(label);
        let body_start = start + begin.len();
        let Some(end_at) = rest[body_start..].find(&end) else {
            return Err(format!("`{begin}` has no `{end}`"));
        };
        if restated.contains(&label) {
            return Err(format!("{label} has two generated blocks"));
        }
        restated.push(label);
        text.push_str(&rest[..body_start]);
        text.push('\n');
        text.push_str(&render_places(index.get(&label)));
        text.push_str(&end);
        rest = &rest[body_start + end_at + end.len()..];
    }
    text.push_str(rest);
    Ok(Filled { text, restated })
}

/// The disagreements between the equations a document restates and those the code tags, one sentence each.
fn coverage_problems(restated: &[Label], index: &Index) -> Vec<String> {
    let restated_set: BTreeSet<Label> = restated.iter().copied().collect();
    let mut problems = Vec::new();
    let nowhere: Vec<String> =
        restated.iter().filter(|label| index.get(label).is_none_or(|p| p.is_empty())).map(|l| l.to_string()).collect();
    if !nowhere.is_empty() {
        problems.push(format!("restated in {DOC} but tagged nowhere in the code: {}", nowhere.join(", ")));
    }
    let unrestated: Vec<String> = index
        .iter()
        .filter(|(label, _)| !restated_set.contains(label))
        .map(|(label, places)| {
            let files: BTreeSet<&str> = places.iter().map(|p| p.path.as_str()).collect();
            format!("{label} (in {})", files.into_iter().collect::<Vec<_>>().join(", "))
        })
        .collect();
    if !unrestated.is_empty() {
        problems.push(format!("tagged in the code but not restated in {DOC}: {}", unrestated.join("; ")));
    }
    problems
}

mod tests {
    use super::*;

    /// Shorthand for a label in tests.
    fn label(number: u32, letter: Option<char>) -> Label {
        Label { number, letter }
    }

    /// The labels of `text`, as strings.
    fn tags(text: &str) -> Vec<String> {
        tags_in(text).iter().map(|l| l.to_string()).collect()
    }

    #[test]
    fn equations_doc_is_fresh() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives one level below the root");
        let index = collect(root).expect("the repository's sources are readable");
        let path = root.join(DOC);
        let old = fs::read_to_string(&path).expect("docs/equations.md exists");
        let filled = fill(&old, &index).unwrap_or_else(|err| panic!("{DOC}: {err}"));
        let problems = coverage_problems(&filled.restated, &index);
        if filled.text != old {
            fs::write(&path, &filled.text).expect("docs/equations.md is writable");
            panic!("{STALE}");
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn equations_grammar_reads_single_labels() {
        assert_eq!(tags("E4 merge (E11a), E1c; E2's m"), ["E4", "E11a", "E1c", "E2"]);
        assert_eq!(tags("E17/E22/E23"), ["E17", "E22", "E23"]);
        assert_eq!(tags("```equation E2\n"), ["E2"]);
    }

    #[test]
    fn equations_grammar_rejects_non_labels() {
        assert!(tags("0xE1 E4M3 E03 E0 BE2 E4_x E11ab").is_empty());
        assert!(tags("the label `E1` … `E32` is a mention").is_empty());
        assert!(tags("no labels at all: E, e4, Ex").is_empty());
        assert!(tags("the sheet (E1 … E32), E1..E32, E1…E32").is_empty());
    }

    #[test]
    fn equations_ranges_expand() {
        assert_eq!(tags("E18–E20"), ["E18", "E19", "E20"]);
        assert_eq!(tags("(E6-E10)"), ["E6", "E7", "E8", "E9", "E10"]);
        assert_eq!(tags("E2–5"), ["E2", "E3", "E4", "E5"]);
        assert_eq!(tags("E1a–E1d"), ["E1a", "E1b", "E1c", "E1d"]);
        assert_eq!(tags("E20–E18"), ["E20", "E18"]);
        assert_eq!(expand_range(label(10, None), label(11, Some('a'))), [label(10, None), label(11, Some('a'))]);
        assert_eq!(tags("E25–E30 and E6–E10a"), ["E25", "E26", "E27", "E28", "E29", "E30", "E6", "E10a"]);
    }

    #[test]
    fn equations_comments_skip_code_and_strings() {
        let source =
            "let s = \"// E1 in a string\"; let c = '\"'; // E2 after code\n/* E3 */ let r = r#\"E4 \"// E5\"#;\n";
        let texts: Vec<String> = comments(source).into_iter().map(|c| c.text).collect();
        assert_eq!(texts, [" E2 after code", " E3 "]);
        assert!(scan_file("oracle/src/x.rs", "fn e4() -> u32 { 4 } // E4\n").iter().all(|(l, _)| l.number == 4));
        assert!(scan_file("oracle/src/x.rs", "const E4: u32 = 4;\n").is_empty());
    }

    #[test]
    fn equations_places_name_items_and_files() {
        let source = "//! Header (E2).\n\n/// State (E2).\n#[derive(Debug)]\npub struct State;\n\nimpl<S: Real> \
                      Trait for State<S> {\n    /// E4: merge.\n    pub fn merge(&self) {\n        // E5 inside\n    }\n}\n";
        let found = scan_file("oracle/src/online.rs", source);
        let named: Vec<(String, Option<String>)> =
            found.into_iter().map(|(label, place)| (label.to_string(), place.item)).collect();
        assert_eq!(
            named,
            [
                ("E2".to_owned(), None),
                ("E2".to_owned(), Some("State".to_owned())),
                ("E4".to_owned(), Some("State::merge".to_owned())),
                ("E5".to_owned(), None),
            ]
        );
        let cuda =
            "// E4 merge\n__global__ void state_merge(float* m) {}\n/// E5\n__global__ void state_finalize(int n) {}\n";
        let items: Vec<Option<String>> =
            scan_file("gpu/kernels/ring_state.cu", cuda).into_iter().map(|(_, p)| p.item).collect();
        assert_eq!(items, [None, Some("state_finalize".to_owned())]);
    }

    #[test]
    fn equations_paths_classify() {
        let kinds: Vec<Option<Kind>> = [
            "oracle/src/online.rs",
            "oracle/tests/it/semantics.rs",
            "proofs/src/nsa.rs",
            "fixtures/src/lib.rs",
            "fixtures/src/book/math.rs",
            "fixtures/book/ring.md",
            "reference/ring-driver/src/lib.rs",
            "gpu/kernels/flash_fwd.cu",
            "gpu/tests/it/ring.rs",
            "tests/src/verdict.rs",
            "xtask/catalog/src/lib.rs",
            "python/attnproof_dump.py",
        ]
        .iter()
        .map(|p| Kind::of_path(p))
        .collect();
        use Kind::*;
        let expected =
            [Oracle, Check, Theorem, Fixture, Book, Book, Reference, Kernel, Check, Check, Mutant].map(Some).to_vec();
        assert_eq!(kinds[..11], expected[..]);
        assert_eq!(kinds[11], None);
        assert!(is_scanned("fixtures/book/ring.md") && !is_scanned("docs/ring.md") && !is_scanned(SELF_PATH));
    }

    /// A small index: E4 in the oracle (an item) and the book (a chapter).
    fn planted_index() -> Index {
        let mut index = Index::new();
        let places = index.entry(label(4, None)).or_default();
        places.insert(Place { kind: Kind::Book, path: "fixtures/book/a.md".into(), item: None });
        places.insert(Place { kind: Kind::Oracle, path: "oracle/src/o.rs".into(), item: Some("merge".into()) });
        index
    }

    #[test]
    fn equations_fill_detects_a_planted_mismatch() {
        let index = planted_index();
        let stale = "# Doc\n\nE4 text.\n<!-- where:E4 begin -->\n- **oracle**: `oracle/src/gone.rs`\n<!-- where:E4 end -->\ntail\n";
        let filled = fill(stale, &index).expect("well-formed markers");
        assert_ne!(filled.text, stale, "a stale block must be noticed");
        assert_eq!(
            filled.text,
            "# Doc\n\nE4 text.\n<!-- where:E4 begin -->\n- **oracle**: `oracle/src/o.rs` (`merge`)\n\
             - **book chapter**: `fixtures/book/a.md`\n<!-- where:E4 end -->\ntail\n"
        );
        assert_eq!(fill(&filled.text, &index).expect("still well-formed").text, filled.text, "filling is idempotent");
        assert_eq!(filled.restated, [label(4, None)]);
    }

    #[test]
    fn equations_fill_rejects_malformed_markers() {
        let index = planted_index();
        assert!(fill("<!-- where:E4 begin -->\nno end\n", &index).is_err());
        assert!(fill("<!-- where:X4 begin --><!-- where:X4 end -->", &index).is_err());
        assert!(
            fill("<!-- where:E4 begin --><!-- where:E4 end --><!-- where:E4 begin --><!-- where:E4 end -->", &index)
                .is_err()
        );
    }

    #[test]
    fn equations_coverage_lists_both_directions() {
        let mut index = planted_index();
        index.entry(label(99, None)).or_default().insert(Place {
            kind: Kind::Kernel,
            path: "gpu/src/x.rs".into(),
            item: None,
        });
        assert!(coverage_problems(&[label(4, None), label(99, None)], &index).is_empty());
        let problems = coverage_problems(&[label(4, None), label(5, None)], &index);
        assert_eq!(
            problems,
            [
                "restated in docs/equations.md but tagged nowhere in the code: E5",
                "tagged in the code but not restated in docs/equations.md: E99 (in gpu/src/x.rs)",
            ]
        );
        assert!(render_places(None).contains("nowhere"));
    }
}
