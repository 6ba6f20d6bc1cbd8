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
            let _ = write!(s, "\n  bound assumes: {}", r.kernel_params);
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
            let p = &r.kernel_params;
            let count = |c: Option<usize>| c.map_or("null".into(), |c| c.to_string());
            let kernel_params = format!(
                "{{\"kv_tile\":{},\"q_tile\":{},\"mma_k\":{},\"exp\":{},\"split_kv\":{}}}",
                count(p.kv_tile),
                count(p.q_tile),
                count(p.mma_k),
                p.exp.map_or("null".into(), |e| json_string(e.name())),
                count(p.split_kv)
            );
            format!(
                "{{\"path\":{},\"status\":{},\"recipe\":{},\"kernel\":{},\"kernel_params\":{},\"assumptions\":{},\"oracle\":{},\"oracle_note\":{},\"outputs\":[{}],\"gate\":{}}}",
                json_string(path),
                json_string(if r.failed() { "fail" } else { "pass" }),
                json_string(&r.recipe),
                json_string(&r.kernel),
                kernel_params,
                json_string(&p.to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::recipe::{ExpForm, KernelParams};
    use crate::verdict::OutputVerdict;

    fn output(
        name: &'static str,
        status: Status,
        cause: Option<&str>,
        regions: Vec<Region>,
        more: usize,
    ) -> OutputReport {
        let verdict = OutputVerdict {
            output: name,
            max_ratio: 2.5,
            worst_index: vec![0, 1, 2],
            worst_values: (1.5, 1.0),
            worst_bound: 0.2,
            elements: 40,
        };
        OutputReport {
            output: name,
            verdict: (!matches!(status, Status::NotVerified(_))).then_some(verdict),
            status,
            cause: cause.map(str::to_owned),
            regions,
            more_regions: more,
        }
    }

    fn report() -> CaseReport {
        let region = |prefix: Vec<usize>, rows, cols, failing| Region { prefix, rows, cols, failing };
        CaseReport {
            recipe: "bf16-in/f32-acc/p-bf16".into(),
            kernel: "k".into(),
            kernel_params: KernelParams {
                kv_tile: Some(128),
                exp: Some(ExpForm::Exp2Approx),
                ..KernelParams::default()
            },
            oracle: OracleChoice::Mpfr,
            oracle_note: Some("MPFR skipped".into()),
            outputs: vec![
                output(
                    "O",
                    Status::Fail,
                    None,
                    vec![region(vec![0, 1], 8..10, 0..10, 14), region(vec![2], 0..1, 3..4, 1)],
                    3,
                ),
                output("LSE", Status::Fail, Some("LSE base: base 2"), vec![], 0),
                output("dQ", Status::Pass, None, vec![], 0),
                output("dK", Status::Fail, None, vec![], 0),
                output("dV", Status::NotVerified("no model".into()), None, vec![], 0),
            ],
            gate: None,
        }
    }

    /// Each output's line says its status and worst element; a failure names its cause, or else lists its regions
    /// (batch and head, or the head alone for packed layouts) and counts those left out.
    #[test]
    fn the_text_report_says_what_failed_and_where() {
        let text = text("case.safetensors", &Ok(report()));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "case.safetensors: FAIL (recipe bf16-in/f32-acc/p-bf16, oracle MPFR-256, kernel \"k\")");
        assert_eq!(lines[1], "  note: MPFR skipped");
        assert_eq!(
            lines[2],
            "  bound assumes: kv_tile 128 (stated), q_tile 1 (worst case), mma_k 1 (worst case), exp ex2 (stated), \
             split_kv up to one per KV tile (worst case)"
        );
        let lines = [&lines[..2], &lines[3..]].concat();
        assert!(lines[2].starts_with("  O    FAIL         max error/bound 2.500e0 at [0, 1, 2]"), "{}", lines[2]);
        assert!(lines[2].ends_with("(candidate 1.5e0, oracle 1e0, bound 2.000e-1)"), "{}", lines[2]);
        assert_eq!(lines[3], "       no single cause named; failing regions:");
        assert_eq!(lines[4], "         b0 h1 rows 8..10 × cols 0..10 (14 of 20 failing)");
        assert_eq!(lines[5], "         h2 rows 0..1 × cols 3..4 (1 of 1 failing)");
        assert_eq!(lines[6], "         (+3 more)");
        assert!(lines[7].starts_with("  LSE  FAIL"), "{}", lines[7]);
        assert_eq!(lines[8], "       likely cause: LSE base: base 2", "a named cause lists no regions");
        assert!(lines[9].starts_with("  dQ   pass"), "{}", lines[9]);
        assert!(lines[10].starts_with("  dK   FAIL"), "{}", lines[10]);
        assert_eq!(lines[11], "       no single cause named; failing regions:", "even without regions to list");
        assert_eq!(lines[12], "  dV   not verified reason: no model");
        assert_eq!(lines.len(), 13, "{text}");
        assert_eq!(text.matches("(+").count(), 1, "only a capped list says how many more");
    }

    /// The JSON report holds the same facts: numbers in exponent form, a non-finite one as a string (JSON has no
    /// infinity), regions as index ranges, and the gate's canned answers.
    #[test]
    fn the_json_report_holds_the_same_facts() {
        let mut r = report();
        r.outputs[3].verdict.as_mut().unwrap().max_ratio = f64::INFINITY;
        r.gate = Some(crate::gate::GateReport {
            canned: vec![crate::gate::CannedResult { name: "zeros", applicable: true, rejected: true, max_ratio: 9.0 }],
        });
        let json = json("c", &Ok(r));
        for part in [
            "{\"path\":\"c\",\"status\":\"fail\",\"recipe\":\"bf16-in/f32-acc/p-bf16\",\"kernel\":\"k\"",
            "\"kernel_params\":{\"kv_tile\":128,\"q_tile\":null,\"mma_k\":null,\"exp\":\"ex2\",\"split_kv\":null}",
            "\"assumptions\":\"kv_tile 128 (stated), q_tile 1 (worst case)",
            "\"oracle\":\"mpfr\"",
            "\"oracle_note\":\"MPFR skipped\"",
            "{\"output\":\"O\",\"status\":\"fail\",\"max_error_over_bound\":2.5e0,\"worst_index\":[0,1,2]",
            "\"worst_candidate\":1.5e0,\"worst_oracle\":1e0,\"worst_bound\":2e-1,\"cause\":null",
            "\"regions\":[{\"prefix\":[0,1],\"rows\":[8,10],\"cols\":[0,10],\"failing\":14}",
            "\"more_regions\":3}",
            "\"cause\":\"LSE base: base 2\"",
            "\"max_error_over_bound\":\"inf\"",
            "{\"output\":\"dV\",\"status\":\"not verified\",\"reason\":\"no model\",\"cause\":null",
            "\"gate\":{\"valid\":true,\"canned\":[{\"name\":\"zeros\",\"applicable\":true,\"rejected\":true}]}}",
        ] {
            assert!(json.contains(part), "{part}\nmissing from\n{json}");
        }
    }
}
