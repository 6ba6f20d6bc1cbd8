//! Every `cargo xtask` command, its flags, their value types, defaults and help texts, declared once in [`COMMANDS`]:
//! parsing ([`parse`]) and `cargo xtask help` ([`overview`], [`command_help`]) both read that table.
//!
//! Modelled on rust-analyzer's `xtask/src/flags.rs`, but written as a plain table rather than with a macro crate, so
//! that xtask keeps its one dependency. A flag takes its value either as the next argument or joined with `=`
//! (`--len 4096`, `--len=4096`); a flag given twice keeps its last value unless it is repeatable. Commands that run
//! another program (`test`, `bench-oracle`) forward every argument they do not declare, unchanged and in order.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;

/// A command of `cargo xtask`; `main` dispatches on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `cargo xtask test`.
    Test,
    /// `cargo xtask verify`.
    Verify,
    /// `cargo xtask bench-oracle`.
    BenchOracle,
    /// `cargo xtask mutants`.
    Mutants,
    /// `cargo xtask fuzz`.
    Fuzz,
    /// `cargo xtask gpu-bundle`.
    GpuBundle,
    /// `cargo xtask teach`.
    Teach,
    /// `cargo xtask check`.
    Check,
    /// `cargo xtask help`.
    Help,
}

/// What a flag's value must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    /// An integer above zero.
    PositiveInt,
    /// An integer of zero or more.
    UnsignedInt,
    /// A finite number above zero; fractions allowed.
    PositiveNumber,
    /// Any UTF-8 text.
    Text,
    /// A file system path (need not be UTF-8).
    Path,
}

impl ValueType {
    /// What the type accepts, in words, for errors.
    fn expected(self) -> &'static str {
        match self {
            ValueType::PositiveInt => "a positive integer",
            ValueType::UnsignedInt => "an unsigned integer",
            ValueType::PositiveNumber => "a positive number",
            ValueType::Text => "text",
            ValueType::Path => "a path",
        }
    }
}

/// One flag of a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag {
    /// The flag as typed, with its dashes: `--len`.
    pub name: &'static str,
    /// The value's placeholder in the usage (`L`) and its type, or `None` for a switch that takes no value.
    pub value: Option<(&'static str, ValueType)>,
    /// Whether the flag may be given several times, each value kept (otherwise the last one wins).
    pub repeatable: bool,
    /// The value used when the flag is absent, as it would be typed.
    pub default: Option<&'static str>,
    /// One line of help.
    pub help: &'static str,
}

/// A switch: a flag without a value.
const fn switch(name: &'static str, help: &'static str) -> Flag {
    Flag { name, value: None, repeatable: false, default: None, help }
}

/// A flag with a value of type `ty`, shown as `placeholder` in the usage.
const fn valued(name: &'static str, placeholder: &'static str, ty: ValueType, help: &'static str) -> Flag {
    Flag { name, value: Some((placeholder, ty)), repeatable: false, default: None, help }
}

/// What a command does with arguments that are not its flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operands {
    /// None are accepted.
    None,
    /// Arguments that are not declared flags (positional ones, unknown flags, everything after `--`) are forwarded
    /// unchanged, in order, to the program the command runs; `-h`/`--help` too.
    Forwarded {
        /// Their placeholder in the usage.
        usage: &'static str,
        /// One line of help.
        help: &'static str,
    },
    /// Positional arguments, between `min` and `max` of them; an unknown flag is an error.
    Positional {
        /// Their placeholder in the usage.
        usage: &'static str,
        /// One line of help.
        help: &'static str,
        /// The fewest accepted.
        min: usize,
        /// The most accepted, or `None` for no limit.
        max: Option<usize>,
    },
}

/// One command: its name, what it does, its flags and its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandSpec {
    /// Which command it is.
    pub command: Command,
    /// The name typed after `cargo xtask`.
    pub name: &'static str,
    /// One line for the command list of `cargo xtask help`.
    pub summary: &'static str,
    /// Its flags.
    pub flags: &'static [Flag],
    /// What it does with other arguments.
    pub operands: Operands,
}

/// Every command of `cargo xtask`, in the order `cargo xtask help` lists them.
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec {
        command: Command::Test,
        name: "test",
        summary: "cargo test --workspace [ARGS...], then print `test: N passed, M failed`",
        flags: &[],
        operands: Operands::Forwarded {
            usage: "[ARGS...]",
            help: "arguments for cargo test (`-p CRATE` replaces --workspace; `-- --nocapture` reaches libtest)",
        },
    },
    CommandSpec {
        command: Command::Verify,
        name: "verify",
        summary: "fmt, clippy, tests (insta read-only), snapshot hygiene, GPU tests if present",
        flags: &[],
        operands: Operands::None,
    },
    CommandSpec {
        command: Command::BenchOracle,
        name: "bench-oracle",
        summary: "dense oracle benchmark in release (defaults: --len 16384 --head-dim 128)",
        flags: &[
            Flag { default: Some("16384"), ..valued("--len", "L", ValueType::PositiveInt, "sequence length") },
            Flag { default: Some("128"), ..valued("--head-dim", "D", ValueType::PositiveInt, "head dimension") },
        ],
        operands: Operands::Forwarded {
            usage: "[--heads H] [--reps R] [--causal] [--ghz G] [--no-numpy]",
            help: "any other argument goes to the benchmark (examples/bench_dense.rs) unchanged",
        },
    },
    CommandSpec {
        command: Command::Mutants,
        name: "mutants",
        summary: "apply each CPU mutant of the catalog (or cargo-mutants' over a scope, or over a diff) to a scratch \
                  copy; fail unless all are killed",
        flags: &[
            switch("--list", "print the whole catalog (CPU and GPU), whether each mutant applies and where it runs"),
            Flag { repeatable: true, ..valued("--only", "NAME", ValueType::Text, "run only this mutant") },
            // Above the suites' own 48, so that a mutant only some shapes expose still meets one, yet small enough
            // that a mutant's test run takes seconds.
            Flag {
                default: Some("64"),
                ..valued("--cases", "N", ValueType::PositiveInt, "PROPTEST_CASES for every test run")
            },
            // Fixed (0x6d75_7461_6e74, "mutant" in ASCII), so that which cases run does not change between runs.
            Flag {
                default: Some("120351231143540"),
                ..valued("--seed", "S", ValueType::UnsignedInt, "PROPTEST_RNG_SEED for every test run")
            },
            Flag {
                default: Some("300"),
                ..valued(
                    "--timeout",
                    "SECS",
                    ValueType::PositiveInt,
                    "per-mutant limit, build included; a run past it counts as killed by timeout",
                )
            },
            switch(
                "--diff",
                "cargo-mutants on the code changed since REV (default: the merge base with main), then the catalog's \
                 mutants anchored in changed files; one table",
            ),
            switch(
                "--resume",
                "with --scope: go on from each scope's last record (cargo-mutants --iterate): mutants it shows caught \
                 or unviable are skipped, survivors and mutants never reached are run",
            ),
            valued(
                "--shard",
                "K/N",
                ValueType::Text,
                "with --scope: only the K-th of N slices of each scope's mutants (from 0), into a record of its own, \
                 so that a scope too long for one sitting runs slice by slice",
            ),
            Flag {
                repeatable: true,
                ..valued(
                    "--scope",
                    "NAME",
                    ValueType::Text,
                    "cargo-mutants over scope NAME (proofs, verdict, harness, fixtures, oracle, reference, reference-ring, \
                     reference-sparse, or all; docs/mutation.md)",
                )
            },
        ],
        operands: Operands::Positional {
            usage: "[REV]",
            help: "with --diff: the revision to compare the working tree with",
            min: 0,
            max: Some(1),
        },
    },
    CommandSpec {
        command: Command::Fuzz,
        name: "fuzz",
        summary: "run the proptest suites in release with fresh seeds for N minutes",
        flags: &[
            Flag {
                default: Some("10"),
                ..valued(
                    "--minutes",
                    "N",
                    ValueType::PositiveNumber,
                    "fuzz for N minutes (fractions allowed), not counting the initial build",
                )
            },
            valued(
                "--target",
                "T",
                ValueType::Text,
                "fuzz only the module T of the harness test binary (tests/tests/it/T.rs; default: every module)",
            ),
            Flag {
                default: Some("256"),
                ..valued("--cases-per-batch", "K", ValueType::PositiveInt, "PROPTEST_CASES of each batch")
            },
        ],
        operands: Operands::None,
    },
    CommandSpec {
        command: Command::GpuBundle,
        name: "gpu-bundle",
        summary: "build the GPU test binaries and GPU mutants (release) into gpu-bundle/ with run.sh",
        flags: &[],
        operands: Operands::None,
    },
    CommandSpec {
        command: Command::Teach,
        name: "teach",
        summary: "build the teaching book (HTML, from the fixture snapshots) into DIR (default target/book)",
        flags: &[valued(
            "--out",
            "DIR",
            ValueType::Path,
            "where the book goes (default target/book in the workspace; a relative DIR is taken from here)",
        )],
        operands: Operands::None,
    },
    CommandSpec {
        command: Command::Check,
        name: "check",
        summary: "check case files (docs/case-format.md): exit 0 pass, 1 a failure, 2 a bad file",
        flags: &[
            switch("--json", "print the report as JSON"),
            switch("--mpfr", "compare against the MPFR oracle instead of the f64 one"),
            switch("--require-verified", "also fail on an output the model cannot bound"),
        ],
        operands: Operands::Positional { usage: "CASE...", help: "the case files to check", min: 1, max: None },
    },
    CommandSpec {
        command: Command::Help,
        name: "help",
        summary: "print this message, or with COMMAND that command's flags",
        flags: &[],
        operands: Operands::Positional { usage: "[COMMAND]", help: "a command", min: 0, max: Some(1) },
    },
];

/// The command named `name`.
pub fn command(name: &str) -> Option<&'static CommandSpec> {
    COMMANDS.iter().find(|c| c.name == name)
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Invocation {
    /// Print help: the overview, or one command's.
    Help(Option<&'static CommandSpec>),
    /// Run a command.
    Run(Parsed),
}

/// A parsed flag value.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Int(u64),
    Number(f64),
    Text(String),
    Path(PathBuf),
}

/// A command's parsed arguments: the values of its flags (each checked against its type) and its operands.
#[derive(Debug)]
pub struct Parsed {
    /// The command.
    pub spec: &'static CommandSpec,
    /// Flags given, in order, with their values (`None` for switches).
    given: Vec<(&'static Flag, Option<Value>)>,
    /// Operands, in order: positional arguments, or everything forwarded.
    pub operands: Vec<OsString>,
}

impl Parsed {
    /// The declaration of `name`; a name the command does not declare is a bug in xtask, not a user error.
    fn flag(&self, name: &str) -> &'static Flag {
        self.spec
            .flags
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("`{}` declares no flag {name}", self.spec.name))
    }

    /// Every value given for `name`, in order, or its default when none was given.
    fn values(&self, name: &str) -> Vec<Value> {
        let flag = self.flag(name);
        let given: Vec<Value> =
            self.given.iter().filter(|(f, _)| f.name == name).filter_map(|(_, v)| v.clone()).collect();
        match (given.is_empty(), flag.default, flag.value) {
            (true, Some(default), Some((_, ty))) => {
                vec![parse_value(ty, default).unwrap_or_else(|| panic!("default of {name} is not {}", ty.expected()))]
            }
            _ => given,
        }
    }

    /// Whether the switch `name` was given.
    pub fn switch(&self, name: &str) -> bool {
        assert!(self.flag(name).value.is_none(), "{name} is not a switch");
        self.given.iter().any(|(f, _)| f.name == name)
    }

    /// The integer value of `name` (the last given, else its default), or `None` if absent without a default.
    pub fn int(&self, name: &str) -> Option<u64> {
        self.values(name).into_iter().next_back().map(|v| match v {
            Value::Int(n) => n,
            other => panic!("{name} is not an integer flag: {other:?}"),
        })
    }

    /// The numeric value of `name` (the last given, else its default), or `None` if absent without a default.
    pub fn number(&self, name: &str) -> Option<f64> {
        self.values(name).into_iter().next_back().map(|v| match v {
            Value::Number(x) => x,
            other => panic!("{name} is not a number flag: {other:?}"),
        })
    }

    /// Every text value given for `name`, in order (a non-repeatable flag has at most its last one).
    pub fn texts(&self, name: &str) -> Vec<String> {
        let mut values = self.values(name).into_iter().map(|v| match v {
            Value::Text(s) => s,
            other => panic!("{name} is not a text flag: {other:?}"),
        });
        if self.flag(name).repeatable { values.collect() } else { values.next_back().into_iter().collect() }
    }

    /// The text value of `name` (the last given, else its default).
    pub fn text(&self, name: &str) -> Option<String> {
        self.texts(name).pop()
    }

    /// The path value of `name` (the last given), or `None` if absent.
    pub fn path(&self, name: &str) -> Option<PathBuf> {
        self.values(name).into_iter().next_back().map(|v| match v {
            Value::Path(p) => p,
            other => panic!("{name} is not a path flag: {other:?}"),
        })
    }

    /// The switches given, as typed, in order (for commands that pass them on to another program).
    pub fn switches(&self) -> Vec<&'static str> {
        self.given.iter().filter(|(f, v)| f.value.is_none() && v.is_none()).map(|(f, _)| f.name).collect()
    }
}

/// A command line `cargo xtask` cannot run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlagError {
    /// The first argument names no command.
    UnknownCommand(String),
    /// A flag the command does not declare.
    UnknownFlag {
        /// The command.
        command: &'static str,
        /// The flag as typed.
        flag: String,
    },
    /// A flag that needs a value came last.
    MissingValue {
        /// The command.
        command: &'static str,
        /// The flag.
        flag: &'static str,
    },
    /// A value that is not of the flag's type.
    BadValue {
        /// The command.
        command: &'static str,
        /// The flag.
        flag: &'static str,
        /// The value as typed.
        value: String,
        /// What the flag accepts, in words.
        expected: &'static str,
    },
    /// A switch given a value with `=`.
    UnexpectedValue {
        /// The command.
        command: &'static str,
        /// The switch.
        flag: &'static str,
    },
    /// An operand the command does not take (or one too many).
    UnexpectedOperand {
        /// The command.
        command: &'static str,
        /// The operand, lossily decoded.
        operand: String,
    },
    /// Fewer operands than the command needs.
    MissingOperand {
        /// The command.
        command: &'static str,
        /// The operands' placeholder.
        usage: &'static str,
    },
    /// An argument that had to be UTF-8 (a command name, a flag, a non-path value) is not.
    NotUtf8 {
        /// The command, or `cargo xtask` before one is known.
        command: &'static str,
        /// The argument, lossily decoded.
        arg: String,
    },
}

impl fmt::Display for FlagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let command = match self {
            FlagError::UnknownCommand(name) => {
                return write!(f, "unknown command `{name}`\n\n{}", overview());
            }
            FlagError::UnknownFlag { command, flag } => {
                write!(f, "unknown flag `{flag}` for `{command}`")?;
                command
            }
            FlagError::MissingValue { command, flag } => {
                write!(f, "`{flag}` needs a value")?;
                command
            }
            FlagError::BadValue { command, flag, value, expected } => {
                write!(f, "`{flag}` needs {expected}, got `{value}`")?;
                command
            }
            FlagError::UnexpectedValue { command, flag } => {
                write!(f, "`{flag}` takes no value")?;
                command
            }
            FlagError::UnexpectedOperand { command, operand } => {
                write!(f, "unexpected argument `{operand}` for `{command}`")?;
                command
            }
            FlagError::MissingOperand { command, usage } => {
                write!(f, "`{command}` needs {usage}")?;
                command
            }
            FlagError::NotUtf8 { command, arg } => {
                write!(f, "argument {arg:?} is not valid UTF-8")?;
                command
            }
        };
        match self::command(command) {
            Some(spec) => write!(f, "\n\n{}", usage(spec)),
            None => Ok(()),
        }
    }
}

impl std::error::Error for FlagError {}

/// Parses `cargo xtask`'s arguments (without the program name): the command, then its flags and operands.
pub fn parse(args: Vec<OsString>) -> Result<Invocation, FlagError> {
    let mut args = args.into_iter();
    let Some(first) = args.next() else { return Ok(Invocation::Help(None)) };
    let name = first.to_str().ok_or_else(|| FlagError::NotUtf8 { command: "", arg: lossy(&first) })?;
    if name == "-h" || name == "--help" {
        return Ok(Invocation::Help(None));
    }
    let spec = command(name).ok_or_else(|| FlagError::UnknownCommand(name.to_owned()))?;
    let parsed = parse_command(spec, args.collect())?;
    match (spec.command, parsed) {
        (Command::Help, Invocation::Run(p)) => match p.operands.first() {
            None => Ok(Invocation::Help(None)),
            Some(name) => {
                let name = lossy(name);
                command(&name).map(|c| Invocation::Help(Some(c))).ok_or(FlagError::UnknownCommand(name))
            }
        },
        (_, parsed) => Ok(parsed),
    }
}

/// Parses one command's arguments against its declaration.
pub fn parse_command(spec: &'static CommandSpec, args: Vec<OsString>) -> Result<Invocation, FlagError> {
    let command = spec.name;
    let forwarded = matches!(spec.operands, Operands::Forwarded { .. });
    let mut parsed = Parsed { spec, given: Vec::new(), operands: Vec::new() };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let text = arg.to_str();
        if text == Some("--") {
            if forwarded {
                parsed.operands.push(arg);
            }
            parsed.operands.extend(args.by_ref());
            break;
        }
        if !forwarded && matches!(text, Some("-h" | "--help")) {
            return Ok(Invocation::Help(Some(spec)));
        }
        let Some(text) = text.filter(|t| t.starts_with("--")) else {
            parsed.operands.push(arg);
            continue;
        };
        let (name, inline) = match text.split_once('=') {
            Some((name, value)) => (name, Some(OsString::from(value))),
            None => (text, None),
        };
        let Some(flag) = spec.flags.iter().find(|f| f.name == name) else {
            if forwarded {
                parsed.operands.push(arg);
                continue;
            }
            return Err(FlagError::UnknownFlag { command, flag: name.to_owned() });
        };
        let value = match (flag.value, inline) {
            (None, None) => None,
            (None, Some(_)) => return Err(FlagError::UnexpectedValue { command, flag: flag.name }),
            (Some((_, ty)), inline) => {
                let raw = inline.or_else(|| args.next()).ok_or(FlagError::MissingValue { command, flag: flag.name })?;
                let value = match ty {
                    ValueType::Path => Some(Value::Path(PathBuf::from(&raw))),
                    _ => raw.to_str().and_then(|text| parse_value(ty, text)),
                };
                Some(value.ok_or_else(|| FlagError::BadValue {
                    command,
                    flag: flag.name,
                    value: lossy(&raw),
                    expected: ty.expected(),
                })?)
            }
        };
        parsed.given.push((flag, value));
    }
    match spec.operands {
        Operands::None => {
            if let Some(extra) = parsed.operands.first() {
                return Err(FlagError::UnexpectedOperand { command, operand: lossy(extra) });
            }
        }
        Operands::Forwarded { .. } => {}
        Operands::Positional { usage, min, max, .. } => {
            if parsed.operands.len() < min {
                return Err(FlagError::MissingOperand { command, usage });
            }
            if let Some(extra) = max.and_then(|max| parsed.operands.get(max)) {
                return Err(FlagError::UnexpectedOperand { command, operand: lossy(extra) });
            }
        }
    }
    Ok(Invocation::Run(parsed))
}

/// Parses `cargo xtask ARGS...` for unit tests of a command's options: the parsed command, or the error.
#[cfg(test)]
pub fn parse_for_test(args: &[&str]) -> Result<Parsed, FlagError> {
    match parse(args.iter().map(OsString::from).collect())? {
        Invocation::Run(parsed) => Ok(parsed),
        Invocation::Help(spec) => panic!("{args:?} asks for help ({:?}), not for a command", spec.map(|s| s.name)),
    }
}

/// `text` as a value of type `ty`, or `None` if it is not one.
fn parse_value(ty: ValueType, text: &str) -> Option<Value> {
    match ty {
        ValueType::PositiveInt => text.parse::<u64>().ok().filter(|&n| n > 0).map(Value::Int),
        ValueType::UnsignedInt => text.parse::<u64>().ok().map(Value::Int),
        ValueType::PositiveNumber => text.parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0).map(Value::Number),
        ValueType::Text => Some(Value::Text(text.to_owned())),
        ValueType::Path => Some(Value::Path(PathBuf::from(text))),
    }
}

/// An argument for an error message.
fn lossy(arg: &OsString) -> String {
    arg.to_string_lossy().into_owned()
}

/// A command's synopsis: `mutants [--list] [--only NAME]... [--cases N] ...`.
fn synopsis(spec: &CommandSpec) -> String {
    let mut parts = vec![spec.name.to_owned()];
    for flag in spec.flags {
        let value = flag.value.map(|(placeholder, _)| format!(" {placeholder}")).unwrap_or_default();
        parts.push(format!("[{}{value}]{}", flag.name, if flag.repeatable { "..." } else { "" }));
    }
    match spec.operands {
        Operands::None => {}
        Operands::Forwarded { usage, .. } | Operands::Positional { usage, .. } => parts.push(usage.to_owned()),
    }
    parts.join(" ")
}

/// The usage line of one command.
fn usage(spec: &CommandSpec) -> String {
    format!("usage: cargo xtask {}", synopsis(spec))
}

/// `cargo xtask help`: every command with its synopsis, and its summary on the line below (the synopses are too
/// wide for a column beside them).
pub fn overview() -> String {
    let mut text = String::from("usage: cargo xtask <command> [args]\n\ncommands:\n");
    for spec in COMMANDS {
        text.push_str(&format!("  {}\n      {}\n", synopsis(spec), spec.summary));
    }
    text.push_str("\n`cargo xtask help COMMAND` (or `cargo xtask COMMAND --help`) describes a command's flags.");
    text
}

/// `cargo xtask help COMMAND`: the command's usage, summary, and one line per flag and operand.
pub fn command_help(spec: &CommandSpec) -> String {
    let mut rows: Vec<(String, String)> = spec
        .flags
        .iter()
        .map(|flag| {
            let value = flag.value.map(|(placeholder, _)| format!(" {placeholder}")).unwrap_or_default();
            let mut help = flag.help.to_owned();
            if let Some(default) = flag.default {
                help.push_str(&format!(" (default {default})"));
            }
            if flag.repeatable {
                help.push_str(" (repeatable)");
            }
            (format!("{}{value}", flag.name), help)
        })
        .collect();
    match spec.operands {
        Operands::None => {}
        Operands::Forwarded { usage, help } | Operands::Positional { usage, help, .. } => {
            rows.push((usage.to_owned(), help.to_owned()));
        }
    }
    let width = rows.iter().map(|(left, _)| left.len()).max().unwrap_or(0);
    let mut text = format!("{}\n\n{}\n", usage(spec), spec.summary);
    if !rows.is_empty() {
        text.push('\n');
    }
    for (left, help) in rows {
        text.push_str(&format!("  {left:<width$}  {help}\n"));
    }
    text.trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    /// Parses `cargo xtask ARGS...` expecting a command to run.
    fn run(args: &[&str]) -> Parsed {
        parse_for_test(args).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    fn error(args: &[&str]) -> FlagError {
        match parse(os(args)) {
            Err(err) => err,
            Ok(other) => panic!("{args:?}: expected an error, got {other:?}"),
        }
    }

    #[test]
    fn names_are_unique_and_defaults_have_their_types() {
        for (i, spec) in COMMANDS.iter().enumerate() {
            assert!(COMMANDS[..i].iter().all(|c| c.name != spec.name && c.command != spec.command), "{}", spec.name);
            for (j, flag) in spec.flags.iter().enumerate() {
                assert!(flag.name.starts_with("--") && flag.name.len() > 2, "{}: {}", spec.name, flag.name);
                assert!(spec.flags[..j].iter().all(|f| f.name != flag.name), "{}: {} twice", spec.name, flag.name);
                assert!(!flag.help.is_empty(), "{}: {} has no help", spec.name, flag.name);
                if let Some(default) = flag.default {
                    let (_, ty) = flag.value.expect("a switch has no default");
                    assert!(parse_value(ty, default).is_some(), "{}: default of {}", spec.name, flag.name);
                }
            }
        }
    }

    #[test]
    fn values_follow_or_join_their_flag_and_defaults_fill_in() {
        let p = run(&["bench-oracle"]);
        assert_eq!((p.int("--len"), p.int("--head-dim")), (Some(16384), Some(128)));
        let p = run(&["bench-oracle", "--len", "4096", "--head-dim=64", "--causal", "--reps", "3"]);
        assert_eq!((p.int("--len"), p.int("--head-dim")), (Some(4096), Some(64)));
        assert_eq!(p.operands, os(&["--causal", "--reps", "3"]));
        let p = run(&["mutants", "--only", "a", "--only=b", "--cases", "8", "--seed=3", "--timeout", "9", "--list"]);
        assert_eq!(p.texts("--only"), ["a", "b"]);
        assert_eq!((p.int("--cases"), p.int("--seed"), p.int("--timeout")), (Some(8), Some(3), Some(9)));
        assert!(p.switch("--list"));
        let p = run(&["mutants"]);
        assert_eq!(
            (p.int("--cases"), p.int("--seed"), p.int("--timeout")),
            (Some(64), Some(0x6d75_7461_6e74), Some(300))
        );
        assert!(!p.switch("--list") && p.texts("--only").is_empty());
        let p = run(&["fuzz", "--minutes", "0.5", "--target", "ring", "--target=sparse"]);
        assert_eq!((p.number("--minutes"), p.text("--target")), (Some(0.5), Some("sparse".to_owned())));
        assert_eq!(run(&["fuzz"]).number("--minutes"), Some(10.0));
        assert_eq!(run(&["teach", "--out=/srv/book-b"]).path("--out"), Some(PathBuf::from("/srv/book-b")));
        assert_eq!(run(&["teach"]).path("--out"), None);
    }

    #[test]
    fn forwarding_commands_pass_everything_else_on_in_order() {
        let p = run(&["test", "-p", "xtask", "--no-fail-fast", "--", "--nocapture", "--help"]);
        assert_eq!(p.operands, os(&["-p", "xtask", "--no-fail-fast", "--", "--nocapture", "--help"]));
        assert_eq!(run(&["test", "--help"]).operands, os(&["--help"]));
    }

    #[test]
    fn positional_operands_and_switches() {
        let p = run(&["check", "a.safetensors", "--json", "b.safetensors", "--mpfr"]);
        assert_eq!(p.operands, os(&["a.safetensors", "b.safetensors"]));
        assert_eq!(p.switches(), ["--json", "--mpfr"]);
        assert!(!p.switch("--require-verified"));
        assert_eq!(error(&["check", "--json"]), FlagError::MissingOperand { command: "check", usage: "CASE..." });
    }

    #[test]
    fn help_is_asked_for_in_every_spelling() {
        for args in [&[][..], &["help"], &["-h"], &["--help"]] {
            assert!(matches!(parse(os(args)), Ok(Invocation::Help(None))), "{args:?}");
        }
        for args in [&["help", "mutants"][..], &["mutants", "--help"], &["mutants", "--list", "-h"]] {
            assert!(matches!(parse(os(args)), Ok(Invocation::Help(Some(c))) if c.name == "mutants"), "{args:?}");
        }
        assert_eq!(error(&["help", "nope"]), FlagError::UnknownCommand("nope".to_owned()));
        assert!(matches!(error(&["help", "test", "verify"]), FlagError::UnexpectedOperand { .. }));
    }

    #[test]
    fn errors_name_the_problem() {
        assert_eq!(error(&["frobnicate"]), FlagError::UnknownCommand("frobnicate".to_owned()));
        assert_eq!(
            error(&["mutants", "--bogus"]),
            FlagError::UnknownFlag { command: "mutants", flag: "--bogus".into() }
        );
        assert_eq!(error(&["mutants", "--timeout"]), FlagError::MissingValue { command: "mutants", flag: "--timeout" });
        assert_eq!(
            error(&["bench-oracle", "--len"]),
            FlagError::MissingValue { command: "bench-oracle", flag: "--len" }
        );
        let bad = |args: &[&'static str], flag: &'static str, value: &str, expected: &'static str| {
            assert_eq!(error(args), FlagError::BadValue { command: args[0], flag, value: value.into(), expected });
        };
        bad(&["mutants", "--cases", "0"], "--cases", "0", "a positive integer");
        bad(&["mutants", "--seed", "-1"], "--seed", "-1", "an unsigned integer");
        bad(&["bench-oracle", "--head-dim", "abc"], "--head-dim", "abc", "a positive integer");
        bad(&["fuzz", "--minutes", "inf"], "--minutes", "inf", "a positive number");
        bad(&["fuzz", "--cases-per-batch=-3"], "--cases-per-batch", "-3", "a positive integer");
        assert_eq!(
            error(&["mutants", "--list=yes"]),
            FlagError::UnexpectedValue { command: "mutants", flag: "--list" }
        );
        assert_eq!(
            error(&["verify", "now"]),
            FlagError::UnexpectedOperand { command: "verify", operand: "now".into() }
        );
        assert!(matches!(error(&["gpu-bundle", "--release"]), FlagError::UnknownFlag { .. }));
        // The message carries the command's usage line, which comes from the same table.
        let message = error(&["mutants", "--bogus"]).to_string();
        assert!(message.starts_with("unknown flag `--bogus` for `mutants`"), "{message}");
        assert!(message.contains("usage: cargo xtask mutants [--list] [--only NAME]... [--cases N]"), "{message}");
    }

    #[test]
    fn help_lists_every_command_and_flag() {
        let text = overview();
        for spec in COMMANDS {
            assert!(text.contains(&format!("  {}", synopsis(spec))), "overview lacks {}", spec.name);
            let help = command_help(spec);
            for flag in spec.flags {
                assert!(help.contains(flag.name) && help.contains(flag.help), "{}: {}", spec.name, flag.name);
            }
        }
        assert!(text.contains("bench-oracle [--len L] [--head-dim D] [--heads H] [--reps R] [--causal]"), "{text}");
        assert!(command_help(command("mutants").unwrap()).contains("--cases N"));
        assert!(command_help(command("mutants").unwrap()).contains("(default 64)"));
    }
}
