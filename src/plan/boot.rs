//! The boot ledger: what the engine allocated, beside what the planner projected.
//!
//! Weights, caches, recurrent states and prompt checkpoints are allocated whole at boot, so
//! they must equal their projection to the byte (the planner and the allocator share their
//! rules: `Weights::load` walks the same tensors for both, the caches are reserved for the
//! slot window). Compute is the one term the backend sizes as it runs: it is measured over a
//! warm-up step of the largest shape the scheduler makes (a full ubatch of prompt on one slot,
//! a verify batch on every other) and must stay within its projection.

use std::fmt::Write;

use serde_json::{json, Value};

use super::price::{Ledger, Term};
use super::table::mib;

/// Bytes the engine holds after boot and warm-up, per ledger term.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocated {
    pub weights: u64,
    pub kv: u64,
    pub draft_kv: u64,
    pub recurrent: u64,
    pub checkpoint: u64,
    /// Activations and scratch at the warm-up's peak; `None` when nothing could measure them
    /// (a CPU run without the counting allocator).
    pub compute: Option<u64>,
    /// How `compute` was measured.
    pub compute_how: String,
}

/// One row of the comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct BootRow {
    pub term: &'static str,
    pub projected: u64,
    pub allocated: Option<u64>,
    /// `exact`: must be equal; `bound`: allocated must not exceed projected.
    pub rule: &'static str,
    pub ok: bool,
}

pub fn rows(ledger: &Ledger, a: &Allocated) -> Vec<BootRow> {
    let exact = |term: Term, got: u64| {
        let projected = ledger.bytes(term);
        BootRow {
            term: term.name(),
            projected,
            allocated: Some(got),
            rule: "exact",
            ok: projected == got,
        }
    };
    let mut out = vec![
        exact(Term::Weights, a.weights),
        exact(Term::Kv, a.kv),
        exact(Term::DraftKv, a.draft_kv),
        exact(Term::Recurrent, a.recurrent),
        exact(Term::Checkpoint, a.checkpoint),
    ];
    let projected = ledger.bytes(Term::Compute) + ledger.bytes(Term::DraftCompute);
    out.push(BootRow {
        term: "compute",
        projected,
        allocated: a.compute,
        rule: "bound",
        ok: a.compute.is_none_or(|c| c <= projected),
    });
    out
}

/// Whether every term agrees with its projection.
pub fn agrees(ledger: &Ledger, a: &Allocated) -> bool {
    rows(ledger, a).iter().all(|r| r.ok)
}

/// The comparison as a table (MiB), for the boot log.
pub fn table(ledger: &Ledger, a: &Allocated) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "boot ledger (MiB)  {:>14} {:>14}  check",
        "projected", "allocated"
    );
    for r in rows(ledger, a) {
        let got = r.allocated.map_or("not measured".to_string(), mib);
        let verdict = match (r.ok, r.rule) {
            (true, "exact") => "= projected",
            (true, _) => "within projection",
            (false, "exact") => "DIFFERS",
            (false, _) => "OVER projection",
        };
        let _ = writeln!(
            s,
            "  {:<16} {:>14} {:>14}  {verdict}",
            r.term,
            mib(r.projected),
            got
        );
    }
    let _ = writeln!(s, "  compute measured: {}", a.compute_how);
    s
}

pub fn to_json(ledger: &Ledger, a: &Allocated) -> Value {
    let rows: Vec<Value> = rows(ledger, a)
        .into_iter()
        .map(|r| {
            json!({"term": r.term, "projected": r.projected, "allocated": r.allocated,
                   "rule": r.rule, "ok": r.ok})
        })
        .collect();
    json!({"rows": rows, "agrees": agrees(ledger, a), "compute_how": a.compute_how})
}
