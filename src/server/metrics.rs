//! `/metrics`: llama-server's 15 `llamacpp:*` families in Prometheus text (plus the labelled
//! per-position acceptance counter), and tern's own `tern:*` families (the boot ledger, the
//! backend, the memory budget and margin, the resident set, the drain).

use std::fmt::Write;

use super::state::{AppState, Bucket};
use crate::runtime::engine::Metrics;

struct Item {
    name: &'static str,
    help: &'static str,
    value: f64,
}

/// A number as Prometheus reads it (integers without a fraction).
fn num(v: f64) -> String {
    if v.is_finite() && v == v.trunc() && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else if v.is_finite() {
        format!("{v}")
    } else {
        "0".into()
    }
}

/// Renders the text and moves the gauges' window to now.
pub fn render(state: &AppState, m: &Metrics) -> String {
    let prev = {
        let mut b = state.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let prev = b.clone();
        *b = Bucket {
            prompt_tokens: m.prompt_tokens_total,
            prompt_seconds: m.prompt_seconds_total,
            predicted_tokens: m.tokens_predicted_total,
            predicted_seconds: m.tokens_predicted_seconds_total,
        };
        prev
    };
    let rate = |dn: u64, ds: f64| if ds > 0.0 { dn as f64 / ds } else { 0.0 };
    let counters = [
        Item {
            name: "prompt_tokens_total",
            help: "Number of prompt tokens processed, excluding cached tokens",
            value: m.prompt_tokens_total as f64,
        },
        Item {
            name: "prompt_tokens_cached_total",
            help: "Number of prompt tokens reused from the cache",
            value: m.prompt_tokens_cached_total as f64,
        },
        Item {
            name: "prompt_seconds_total",
            help: "Total time spent processing prompts",
            value: m.prompt_seconds_total,
        },
        Item {
            name: "tokens_predicted_total",
            help: "Number of generation tokens processed",
            value: m.tokens_predicted_total as f64,
        },
        Item {
            name: "tokens_predicted_seconds_total",
            help: "Total time spent generating tokens",
            value: m.tokens_predicted_seconds_total,
        },
        Item {
            name: "n_decode_total",
            help: "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
            value: m.n_decode_total as f64,
        },
        Item {
            name: "n_tokens_max",
            help: "Largest observed sequence length (prompt + generation)",
            value: m.n_tokens_max as f64,
        },
        Item {
            name: "spec_decode_num_draft_tokens_total",
            help: "Speculative: Total draft tokens generated",
            value: m.spec.drafted as f64,
        },
        Item {
            name: "spec_decode_num_accepted_tokens_total",
            help: "Speculative: Total draft tokens accepted by the target model",
            value: m.spec.accepted as f64,
        },
        Item {
            name: "spec_decode_num_drafts_total",
            help: "Speculative: Total speculative decoding verification steps",
            value: m.spec.drafts as f64,
        },
    ];
    let gauges = [
        Item {
            name: "prompt_tokens_seconds",
            help: "Average prompt throughput in tokens/s",
            value: rate(
                m.prompt_tokens_total.saturating_sub(prev.prompt_tokens),
                m.prompt_seconds_total - prev.prompt_seconds,
            ),
        },
        Item {
            name: "predicted_tokens_seconds",
            help: "Average generation throughput in tokens/s",
            value: rate(
                m.tokens_predicted_total
                    .saturating_sub(prev.predicted_tokens),
                m.tokens_predicted_seconds_total - prev.predicted_seconds,
            ),
        },
        Item {
            name: "requests_processing",
            help: "Number of requests processing",
            value: m.requests_processing as f64,
        },
        Item {
            name: "requests_deferred",
            help: "Number of requests deferred",
            value: m.requests_deferred as f64,
        },
        Item {
            name: "n_busy_slots_per_decode",
            help: "Average number of busy slots per llama_decode() call",
            value: m.n_busy_slots_total as f64 / (m.n_decode_total.max(1)) as f64,
        },
    ];
    let mut s = String::new();
    for (ty, items) in [("counter", &counters[..]), ("gauge", &gauges[..])] {
        for it in items {
            let _ = writeln!(s, "# HELP llamacpp:{} {}", it.name, it.help);
            let _ = writeln!(s, "# TYPE llamacpp:{} {ty}", it.name);
            let _ = writeln!(s, "llamacpp:{} {}", it.name, num(it.value));
        }
    }
    let name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total";
    let _ = writeln!(s, "# HELP {name} Accepted tokens per draft position");
    let _ = writeln!(s, "# TYPE {name} counter");
    let n_pos = m
        .spec
        .accepted_per_pos
        .len()
        .max(state.cfg.spec.as_ref().map(|c| c.n_max).unwrap_or(0));
    for i in 0..n_pos {
        let v = m.spec.accepted_per_pos.get(i).copied().unwrap_or(0);
        let _ = writeln!(s, "{name}{{position=\"{i}\"}} {v}");
    }
    // tern's own families.
    let _ = writeln!(
        s,
        "# HELP tern:memory_ledger_bytes The projected memory ledger, bytes per term (tern fit)"
    );
    let _ = writeln!(s, "# TYPE tern:memory_ledger_bytes gauge");
    for (term, bytes) in &state.cfg.ledger {
        let _ = writeln!(s, "tern:memory_ledger_bytes{{term=\"{term}\"}} {bytes}");
    }
    if let Some(e) = state.engine.get() {
        let a = &e.allocated;
        let _ = writeln!(
            s,
            "# HELP tern:memory_allocated_bytes What boot allocated, bytes per ledger term (compute: the warm-up's peak)"
        );
        let _ = writeln!(s, "# TYPE tern:memory_allocated_bytes gauge");
        let terms = [
            ("weights", Some(a.weights)),
            ("kv", Some(a.kv)),
            ("draft_kv", Some(a.draft_kv)),
            ("recurrent", Some(a.recurrent)),
            ("checkpoint", Some(a.checkpoint)),
            ("compute", a.compute),
        ];
        for (term, bytes) in terms {
            if let Some(b) = bytes {
                let _ = writeln!(s, "tern:memory_allocated_bytes{{term=\"{term}\"}} {b}");
            }
        }
    }
    if state.cfg.spec.is_some() {
        // What drafting's parts cost here: the adaptive depth's inputs.
        let c = &m.round_costs;
        let name = "tern:draft_step_seconds";
        let _ = writeln!(
            s,
            "# HELP {name} One MTP draft step, the median of the latest 64"
        );
        let _ = writeln!(s, "# TYPE {name} gauge");
        let _ = writeln!(s, "{name} {}", num(c.draft_step_s.unwrap_or(0.0)));
        let name = "tern:decode_step_seconds";
        let _ = writeln!(
            s,
            "# HELP {name} A decode step (forward, sampling, MTP cache fill) by its rows, the median of the latest 64"
        );
        let _ = writeln!(s, "# TYPE {name} gauge");
        for (rows, v) in &c.forward_s {
            let _ = writeln!(s, "{name}{{rows=\"{rows}\"}} {}", num(*v));
        }
    }
    let _ = writeln!(s, "# HELP tern:backend_info The backend the model runs on");
    let _ = writeln!(s, "# TYPE tern:backend_info gauge");
    let _ = writeln!(
        s,
        "tern:backend_info{{backend=\"{}\"}} 1",
        state.cfg.backend
    );
    let _ = writeln!(s, "# HELP tern:slots_total Slots (--parallel)");
    let _ = writeln!(s, "# TYPE tern:slots_total gauge");
    let _ = writeln!(s, "tern:slots_total {}", state.cfg.total_slots);
    let mut gauge = |name: &str, help: &str, v: u64| {
        let _ = writeln!(s, "# HELP tern:{name} {help}");
        let _ = writeln!(s, "# TYPE tern:{name} gauge");
        let _ = writeln!(s, "tern:{name} {v}");
    };
    if let Some(b) = state.cfg.memory_budget {
        gauge(
            "memory_budget_bytes",
            "The memory budget the shape was priced against (--device-mib, or the host's available memory)",
            b,
        );
    }
    gauge(
        "memory_margin_bytes",
        "The memory kept free beyond the priced total (--margin-mib)",
        state.cfg.memory_margin,
    );
    if let Some(r) = resident_bytes() {
        gauge(
            "process_resident_bytes",
            "Resident memory of the tern process",
            r,
        );
    }
    gauge(
        "draining",
        "1 while a stop signal drains the server (--drain-timeout)",
        state.drain.is_on() as u64,
    );
    let name = "tern:requests_refused_draining_total";
    let _ = writeln!(
        s,
        "# HELP {name} Requests answered 503 by the drain before they started"
    );
    let _ = writeln!(s, "# TYPE {name} counter");
    let _ = writeln!(
        s,
        "{name} {}",
        state
            .drain
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
    );
    s
}

/// The process's resident set, from /proc/self/statm (Linux).
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}
