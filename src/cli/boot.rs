//! The planner at boot, shared by `tern serve` and `tern generate`: price the shape before
//! anything is allocated, refuse one that does not fit, and after the engine has booted print
//! what it allocated beside the projection.

use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::backend::KvTypes;
use crate::gguf::Gguf;
use crate::plan::{self, BackendKind, Budget, KvType, Ledger, PlanError, Shape, SpecType};
use crate::runtime::engine::EngineConfig;

/// The shape an engine configuration allocates, for the planner.
pub fn shape_of(cfg: &EngineConfig, backend: BackendKind, ubatch_size: u64) -> Result<Shape> {
    let kv = |which: &str, t: KvTypes| -> Result<(KvType, KvType)> {
        let one = |ty: crate::tensor::GgmlType| {
            KvType::parse(ty.name())
                .with_context(|| format!("{which}: {ty} is not a cache type the planner prices"))
        };
        Ok((one(t.k)?, one(t.v)?))
    };
    let (k, v) = kv("cache", cfg.kv_types)?;
    let (dk, dv) = kv("draft cache", cfg.draft_kv_types)?;
    Ok(Shape {
        ctx_size: cfg.ctx_size as u64,
        parallel: cfg.parallel as u64,
        cache_type_k: k,
        cache_type_v: v,
        spec: if cfg.spec.is_some() {
            SpecType::DraftMtp
        } else {
            SpecType::None
        },
        draft_n_max: cfg.spec.as_ref().map_or(0, |s| s.n_max as u64),
        spec_draft_type_k: dk,
        spec_draft_type_v: dv,
        ubatch_size,
        batch_size: ubatch_size,
        backend,
        ..Shape::default()
    })
}

/// Prices `shape` against the device's budget (or `device_mib`), printing the ledger to
/// stderr; a shape that does not fit is an error naming what it needs. Without a known budget
/// the ledger is printed and the fit is not checked.
pub fn plan(
    file: &Arc<Gguf>,
    shape: &Shape,
    device_mib: Option<u64>,
    what: &str,
) -> Result<Ledger> {
    match Budget::resolve(shape.backend, device_mib) {
        Ok(budget) => {
            let fit =
                plan::fit(file, shape, &budget).with_context(|| format!("cannot price {what}"))?;
            eprint!("{}", fit.table());
            if !fit.verdict.fits {
                bail!(
                    "the shape does not fit: it needs {} MiB and the budget is {} MiB (see the ledger above for the cheapest changes)",
                    plan::mib(fit.verdict.needed),
                    plan::mib(fit.verdict.budget)
                );
            }
            Ok(fit.ledger)
        }
        Err(e @ PlanError::BudgetUnknown { .. }) => {
            let l = Ledger::price(file, shape).with_context(|| format!("cannot price {what}"))?;
            eprintln!("model   {}", l.model_summary());
            eprintln!("shape   {}", l.shape.summary());
            eprint!("{}", l.table());
            eprintln!("W the fit is not checked: {e}");
            Ok(l)
        }
        Err(e) => Err(e.into()),
    }
}

/// Prints the boot ledger (projected beside allocated); a term that disagrees is a warning
/// that names it (the shape is already running, so refusing now would only lose it).
pub fn report(ledger: &Ledger, allocated: &plan::Allocated) {
    eprint!("{}", plan::boot::table(ledger, allocated));
    for r in plan::boot::rows(ledger, allocated).iter().filter(|r| !r.ok) {
        eprintln!(
            "W boot ledger: {} allocated {} B against a projection of {} B ({})",
            r.term,
            r.allocated.unwrap_or(0),
            r.projected,
            r.rule
        );
    }
}
