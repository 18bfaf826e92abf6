//! Reports of checks that run over cases: one summary line per case, and
//! every failure of every case in one panic message.

use super::cases::Case;
use std::fmt::Write as _;

/// What one case produced: failure lines and a one-line summary.
pub(crate) struct CaseReport {
    pub(crate) failures: Vec<String>,
    pub(crate) summary: String,
}

impl CaseReport {
    pub(crate) fn new(failures: Vec<String>, summary: String) -> CaseReport {
        let summary = if failures.is_empty() {
            summary
        } else {
            format!("FAILED ({} problems) {summary}", failures.len())
        };
        CaseReport { failures, summary }
    }

    pub(crate) fn error(e: String) -> CaseReport {
        CaseReport {
            summary: format!("error: {e}"),
            failures: vec![e],
        }
    }
}

/// Runs `case_report` on every case (with its index, the stream of its
/// random inputs), prints each summary after `label`, and returns every
/// failure, case by case (empty when all passed).
pub(crate) fn run_cases(
    cases: &[Case],
    label: &str,
    mut case_report: impl FnMut(u64, &Case) -> CaseReport,
) -> String {
    let mut failures = String::new();
    for (n, case) in cases.iter().enumerate() {
        let report = case_report(n as u64, case);
        eprintln!("boostr: {label}, case {}: {}", case.name, report.summary);
        if !report.failures.is_empty() {
            let _ = writeln!(failures, "case {case}:");
            for f in &report.failures {
                let _ = writeln!(failures, "  {f}");
            }
        }
    }
    failures
}
