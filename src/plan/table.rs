//! The ledger as a table and as JSON.

use std::fmt::Write;

use serde_json::{json, Value};

use super::fit::Fit;
use super::price::Ledger;
use super::Shape;

/// Bytes as MiB with two decimals and thousands separators: `14,406.00`.
pub fn mib(bytes: u64) -> String {
    let hundredths = (bytes as u128 * 100 + (1 << 19)) >> 20;
    format!(
        "{}.{:02}",
        count_u128(hundredths / 100),
        (hundredths % 100) as u32
    )
}

/// Signed MiB (headroom).
pub(crate) fn mib_signed(bytes: i128) -> String {
    if bytes < 0 {
        format!(
            "-{}",
            mib(bytes.unsigned_abs().min(u64::MAX as u128) as u64)
        )
    } else {
        mib(bytes.min(u64::MAX as i128) as u64)
    }
}

/// An integer with thousands separators: `602,112`.
pub fn count(n: u64) -> String {
    count_u128(n as u128)
}

fn count_u128(n: u128) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn mib_f64(bytes: u64) -> f64 {
    ((bytes as u128 * 100 + (1 << 19)) >> 20) as f64 / 100.0
}

impl Shape {
    /// One line: slots, pool, dtypes, drafting, ubatch, backend.
    pub fn summary(&self) -> String {
        let draft = if self.drafting() {
            format!(
                "draft-mtp depth {} (K {} / V {})",
                self.draft_n_max, self.spec_draft_type_k, self.spec_draft_type_v
            )
        } else {
            "no drafting".into()
        };
        let vision = match &self.mmproj {
            Some(_) => {
                use crate::model::vision::{DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS};
                format!(
                    "; projector, images of {}..{} tokens",
                    self.image_min_tokens.unwrap_or(DEFAULT_MIN_TOKENS as u64),
                    count(self.image_max_tokens.unwrap_or(DEFAULT_MAX_TOKENS as u64))
                )
            }
            None => String::new(),
        };
        format!(
            "{} slot{} × {} = pool {}; K {} / V {}; flash-attn {}; {}; ubatch {} (batch {}); backend {}{vision}",
            self.parallel,
            if self.parallel == 1 { "" } else { "s" },
            count(self.n_ctx_slot()),
            count(self.ctx_size),
            self.cache_type_k,
            self.cache_type_v,
            self.flash_attn.name(),
            draft,
            self.effective_ubatch(),
            self.batch_size,
            self.backend.name(),
        )
    }
}

impl Ledger {
    /// The model line of the table.
    pub fn model_summary(&self) -> String {
        let g = &self.geometry;
        let mtp = if g.n_nextn > 0 {
            format!(" + {} MTP", g.n_nextn)
        } else {
            String::new()
        };
        format!(
            "{}{}: {} layers ({} full-attention + {} GDN){mtp}, trained context {}",
            self.model.display(),
            g.name
                .as_deref()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default(),
            g.n_layer,
            g.n_full_attn,
            g.n_gdn,
            count(g.context_length),
        )
    }

    /// The terms as rows of `term, MiB, detail`.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{:<15} {:>10}  detail", "term", "MiB");
        for l in &self.lines {
            let name = if l.estimated {
                format!("{}*", l.term.name())
            } else {
                l.term.name().to_string()
            };
            let _ = writeln!(s, "{:<15} {:>10}  {}", name, mib(l.bytes), l.detail);
        }
        s
    }
}

impl Fit {
    /// The full report: model, shape, terms, margin, budget and the verdict, then the cheapest
    /// changes when refused.
    pub fn table(&self) -> String {
        let l = &self.ledger;
        let v = &self.verdict;
        let mut s = String::new();
        let _ = writeln!(s, "model   {}", l.model_summary());
        let _ = writeln!(s, "shape   {}", l.shape.summary());
        let _ = writeln!(s);
        s.push_str(&l.table());
        let rule = format!("{:-<15} {:->10}", "", "");
        let _ = writeln!(s, "{rule}");
        let _ = writeln!(s, "{:<15} {:>10}", "total", mib(v.total));
        let _ = writeln!(
            s,
            "{:<15} {:>10}  --margin-mib {}",
            "margin",
            mib(v.margin),
            l.shape.margin_mib
        );
        let _ = writeln!(s, "{:<15} {:>10}  total + margin", "needed", mib(v.needed));
        let _ = writeln!(
            s,
            "{:<15} {:>10}  {}",
            "budget",
            mib(v.budget),
            self.budget.source
        );
        let _ = writeln!(s, "{:<15} {:>10}", "headroom", mib_signed(v.headroom));
        let _ = writeln!(s);
        if v.fits {
            let _ = writeln!(
                s,
                "FITS: needs {} of {} MiB, {} MiB to spare",
                mib(v.needed),
                mib(v.budget),
                mib_signed(v.headroom)
            );
        } else {
            let _ = writeln!(
                s,
                "REFUSED: needs {} MiB against a budget of {} MiB: {} MiB short",
                mib(v.needed),
                mib(v.budget),
                mib_signed(-v.headroom)
            );
            let (fit, short): (Vec<_>, Vec<_>) = self.suggestions.iter().partition(|x| x.fits);
            if fit.is_empty() {
                let _ = writeln!(s, "no single change fits; combine these:");
            } else {
                let _ = writeln!(s, "cheapest changes that would fit:");
                for x in &fit {
                    let _ = writeln!(
                        s,
                        "  {:<28} {:<50} saves {:>10} MiB (needs {})",
                        x.change,
                        x.flags,
                        mib(x.saving),
                        mib(x.needed)
                    );
                }
                if !short.is_empty() {
                    let _ = writeln!(s, "not enough alone:");
                }
            }
            for x in &short {
                let _ = writeln!(
                    s,
                    "  {:<28} {:<50} saves {:>10} MiB (needs {})",
                    x.change,
                    x.flags,
                    mib(x.saving),
                    mib(x.needed)
                );
            }
        }
        if l.lines.iter().any(|x| x.estimated) {
            let _ = writeln!(
                s,
                "* estimated by formula (plan::compute); the boot ledger measures it after a warm-up step"
            );
        }
        s
    }

    /// A machine-readable object with the same content as [`Fit::table`].
    pub fn to_json(&self) -> Value {
        let l = &self.ledger;
        let v = &self.verdict;
        let sh = &l.shape;
        let lines: Vec<Value> = l
            .lines
            .iter()
            .map(|x| {
                json!({
                    "term": x.term,
                    "bytes": x.bytes,
                    "mib": mib_f64(x.bytes),
                    "estimated": x.estimated,
                    "detail": x.detail,
                    "parts": x.parts.iter().map(|(n, b)| json!({"name": n, "bytes": b, "mib": mib_f64(*b)})).collect::<Vec<_>>(),
                })
            })
            .collect();
        let suggestions: Vec<Value> = self
            .suggestions
            .iter()
            .map(|x| {
                json!({
                    "change": x.change,
                    "flags": x.flags,
                    "saving_bytes": x.saving,
                    "saving_mib": mib_f64(x.saving),
                    "needed_bytes": x.needed,
                    "needed_mib": mib_f64(x.needed),
                    "fits": x.fits,
                })
            })
            .collect();
        json!({
            "model": l.model.display().to_string(),
            "geometry": l.geometry,
            "shape": {
                "ctx_size": sh.ctx_size,
                "parallel": sh.parallel,
                "n_ctx_slot": l.n_ctx_slot,
                "cache_type_k": sh.cache_type_k,
                "cache_type_v": sh.cache_type_v,
                "flash_attn": sh.flash_attn,
                "spec_type": sh.spec,
                "spec_draft_n_max": sh.draft_n_max,
                "spec_draft_type_k": sh.spec_draft_type_k,
                "spec_draft_type_v": sh.spec_draft_type_v,
                "ubatch_size": sh.ubatch_size,
                "batch_size": sh.batch_size,
                "mmproj": sh.mmproj.as_ref().map(|p| p.display().to_string()),
                "image_min_tokens": sh.image_min_tokens,
                "image_max_tokens": sh.image_max_tokens,
                "lora": sh.lora.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
                "backend": sh.backend,
                "margin_mib": sh.margin_mib,
            },
            "lines": lines,
            "total_bytes": v.total,
            "total_mib": mib_f64(v.total),
            "margin_bytes": v.margin,
            "needed_bytes": v.needed,
            "needed_mib": mib_f64(v.needed),
            "budget_bytes": v.budget,
            "budget_mib": mib_f64(v.budget),
            "budget_source": self.budget.source,
            "headroom_bytes": v.headroom.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
            "fits": v.fits,
            "suggestions": suggestions,
        })
    }
}
