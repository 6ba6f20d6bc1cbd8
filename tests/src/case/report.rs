//! Printing case reports: one line per output for people, or JSON for tools.

use std::fmt::Write as _;

use super::check::{CaseReport, OracleChoice, OutputReport, Region, Status};
use super::safetensors::json_string;

/// The outcome of one case file: a report, or why it could not be read.
pub type CaseOutcome = Result<CaseReport, super::error::CaseError>;

fn status_word(s: &Status) -> &'static str {
    match s {
        Status::Pass => "pass",
        Status::Fail => "FAIL",
        Status::NotVerified(_) => "not verified",
    }
}

fn region_text(r: &Region) -> String {
    let prefix = match r.prefix.as_slice() {
        [b, h] => format!("b{b} h{h}"),
        [h] => format!("h{h}"),
        other => format!("{other:?}"),
    };
    format!(
        "{prefix} rows {}..{} × cols {}..{} ({} of {} failing)",
        r.rows.start,
        r.rows.end,
        r.cols.start,
        r.cols.end,
        r.failing,
        r.rows.len() * r.cols.len()
    )
}

fn output_text(o: &OutputReport) -> String {
    let mut line = format!("  {:<4} {:<12}", o.output, status_word(&o.status));
    if let Some(v) = &o.verdict {
        let _ = write!(
            line,
            " max error/bound {:.3e} at {:?} (candidate {:e}, oracle {:e}, bound {:.3e})",
            v.max_ratio, v.worst_index, v.worst_values.0, v.worst_values.1, v.worst_bound
        );
    }
    if let Status::NotVerified(reason) = &o.status {
        let _ = write!(line, " reason: {reason}");
    }
    if let Some(cause) = &o.cause {
        let _ = write!(line, "\n       likely cause: {cause}");
    }
    if o.status == Status::Fail && o.cause.is_none() {
        let _ = write!(line, "\n       no single cause named; failing regions:");
        for r in &o.regions {
            let _ = write!(line, "\n         {}", region_text(r));
        }
        if o.more_regions > 0 {
            let _ = write!(line, "\n         (+{} more)", o.more_regions);
        }
    }
    line
}

/// The human-readable report of one case.
pub fn text(path: &str, outcome: &CaseOutcome) -> String {
    match outcome {
        Err(e) => format!("{path}: error: {e}"),
        Ok(r) => {
            let verdict = if r.failed() { "FAIL" } else { "pass" };
            let oracle = match r.oracle {
                OracleChoice::F64 => "f64",
                OracleChoice::Mpfr => "MPFR-256",
            };
            let mut s = format!("{path}: {verdict} (recipe {}, oracle {oracle}, kernel {:?})", r.recipe, r.kernel);
            if let Some(note) = &r.oracle_note {
                let _ = write!(s, "\n  note: {note}");
            }
            for o in &r.outputs {
                let _ = write!(s, "\n{}", output_text(o));
            }
            if let Some(gate) = &r.gate {
                let _ = write!(s, "\n  {gate}");
            }
            s
        }
    }
}

fn json_number(x: f64) -> String {
    if x.is_finite() { format!("{x:e}") } else { json_string(&x.to_string()) }
}

fn output_json(o: &OutputReport) -> String {
    let mut fields = vec![
        format!("\"output\":{}", json_string(o.output)),
        format!("\"status\":{}", json_string(status_word(&o.status).to_ascii_lowercase().as_str())),
    ];
    if let Status::NotVerified(reason) = &o.status {
        fields.push(format!("\"reason\":{}", json_string(reason)));
    }
    if let Some(v) = &o.verdict {
        fields.push(format!("\"max_error_over_bound\":{}", json_number(v.max_ratio)));
        let idx: Vec<String> = v.worst_index.iter().map(usize::to_string).collect();
        fields.push(format!("\"worst_index\":[{}]", idx.join(",")));
        fields.push(format!("\"worst_candidate\":{}", json_number(v.worst_values.0)));
        fields.push(format!("\"worst_oracle\":{}", json_number(v.worst_values.1)));
        fields.push(format!("\"worst_bound\":{}", json_number(v.worst_bound)));
    }
    fields.push(format!("\"cause\":{}", o.cause.as_deref().map_or("null".into(), json_string)));
    let regions: Vec<String> = o
        .regions
        .iter()
        .map(|r| {
            let prefix: Vec<String> = r.prefix.iter().map(usize::to_string).collect();
            format!(
                "{{\"prefix\":[{}],\"rows\":[{},{}],\"cols\":[{},{}],\"failing\":{}}}",
                prefix.join(","),
                r.rows.start,
                r.rows.end,
                r.cols.start,
                r.cols.end,
                r.failing
            )
        })
        .collect();
    fields.push(format!("\"regions\":[{}]", regions.join(",")));
    fields.push(format!("\"more_regions\":{}", o.more_regions));
    format!("{{{}}}", fields.join(","))
}

/// The JSON report of one case (one object; `error` set when the file could not be read).
pub fn json(path: &str, outcome: &CaseOutcome) -> String {
    match outcome {
        Err(e) => {
            format!("{{\"path\":{},\"status\":\"error\",\"error\":{}}}", json_string(path), json_string(&e.to_string()))
        }
        Ok(r) => {
            let outputs: Vec<String> = r.outputs.iter().map(output_json).collect();
            let gate = r.gate.as_ref().map_or("null".into(), |g| {
                let canned: Vec<String> = g
                    .canned
                    .iter()
                    .map(|c| {
                        format!(
                            "{{\"name\":{},\"applicable\":{},\"rejected\":{}}}",
                            json_string(c.name),
                            c.applicable,
                            c.rejected
                        )
                    })
                    .collect();
                format!("{{\"valid\":{},\"canned\":[{}]}}", g.valid(), canned.join(","))
            });
            format!(
                "{{\"path\":{},\"status\":{},\"recipe\":{},\"kernel\":{},\"oracle\":{},\"oracle_note\":{},\"outputs\":[{}],\"gate\":{}}}",
                json_string(path),
                json_string(if r.failed() { "fail" } else { "pass" }),
                json_string(&r.recipe),
                json_string(&r.kernel),
                json_string(match r.oracle {
                    OracleChoice::F64 => "f64",
                    OracleChoice::Mpfr => "mpfr",
                }),
                r.oracle_note.as_deref().map_or("null".into(), json_string),
                outputs.join(","),
                gate
            )
        }
    }
}
