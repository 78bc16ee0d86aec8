//! The verdict: a ledger against a budget, and the cheapest single changes when it does not fit.

use super::price::Ledger;
use super::table::{count, mib};
use super::{BackendKind, KvType, PlanError, Shape, SpecType, MIB};
use std::sync::Arc;

use crate::gguf::Gguf;
use crate::model::Config;

/// Pools shrink in steps of this many tokens per slot (the granularity llama.cpp pads to).
pub const POOL_GRAIN: u64 = 256;

/// Device memory the shape may use.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    pub bytes: u64,
    /// Where the figure came from (`--device-mib`, `MemAvailable`).
    pub source: String,
}

impl Budget {
    pub fn mib(n: u64) -> Budget {
        Budget {
            bytes: n.saturating_mul(MIB),
            source: "--device-mib".into(),
        }
    }

    /// `--device-mib` when given; otherwise the backend's free memory as it reports it: the
    /// CPU's MemAvailable, a CUDA device's cuMemGetInfo (in a `--features cuda` build with a
    /// device). wgpu has no portable free-memory query, so it and auto need `--device-mib`.
    pub fn resolve(backend: BackendKind, device_mib: Option<u64>) -> Result<Budget, PlanError> {
        if let Some(n) = device_mib {
            return Ok(Budget::mib(n));
        }
        match backend {
            BackendKind::Cpu => {
                let text = std::fs::read_to_string("/proc/meminfo")
                    .map_err(|e| PlanError::MemInfo { why: e.to_string() })?;
                let bytes = parse_mem_available(&text).ok_or_else(|| PlanError::MemInfo {
                    why: "no MemAvailable line".into(),
                })?;
                Ok(Budget {
                    bytes,
                    source: "cpu: MemAvailable from /proc/meminfo".into(),
                })
            }
            BackendKind::Cuda => match crate::backend::pick::device_memory("cuda") {
                Some(Ok((free, total))) => Ok(Budget {
                    bytes: free,
                    source: format!(
                        "cuda: cuMemGetInfo free {} of {} MiB",
                        super::mib(free),
                        super::mib(total)
                    ),
                }),
                _ => Err(PlanError::BudgetUnknown { backend: "cuda" }),
            },
            b => Err(PlanError::BudgetUnknown { backend: b.name() }),
        }
    }
}

/// The `MemAvailable:  N kB` line of /proc/meminfo, in bytes.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut it = line["MemAvailable:".len()..].split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some("kB") | None => n.checked_mul(1024),
        _ => None,
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// The sum of the ledger's terms.
    pub total: u64,
    pub margin: u64,
    /// `total + margin`.
    pub needed: u64,
    pub budget: u64,
    pub fits: bool,
    /// `budget − needed` (negative when the shape does not fit).
    pub headroom: i128,
}

impl Verdict {
    pub fn of(ledger: &Ledger, budget: &Budget) -> Verdict {
        let total = ledger.total();
        let margin = ledger.shape.margin_mib.saturating_mul(MIB);
        let needed = total.saturating_add(margin);
        Verdict {
            total,
            margin,
            needed,
            budget: budget.bytes,
            fits: needed <= budget.bytes,
            headroom: budget.bytes as i128 - needed as i128,
        }
    }
}

/// One change to a refused shape, re-priced.
#[derive(Clone, Debug)]
pub struct Suggestion {
    /// In words: "one slot fewer".
    pub change: String,
    /// The flags that make it: "--parallel 2 --ctx-size 401408".
    pub flags: String,
    pub shape: Shape,
    /// The changed shape's `total + margin`.
    pub needed: u64,
    /// How much less it needs than the refused shape.
    pub saving: u64,
    pub fits: bool,
}

#[derive(Clone, Debug)]
pub struct Fit {
    pub ledger: Ledger,
    pub budget: Budget,
    pub verdict: Verdict,
    /// Empty when the shape fits. Otherwise the single changes that fit, smallest saving
    /// first (the least given up), then those that are not enough alone, largest first.
    pub suggestions: Vec<Suggestion>,
}

/// Prices `shape` for `g` and sets it against `budget`.
pub fn fit(g: &Arc<Gguf>, shape: &Shape, budget: &Budget) -> Result<Fit, PlanError> {
    let cfg = Config::from_gguf(g)?;
    let ledger = Ledger::price_with(g, &cfg, shape)?;
    let verdict = Verdict::of(&ledger, budget);
    let suggestions = if verdict.fits {
        Vec::new()
    } else {
        suggest(g, &cfg, shape, budget, verdict.needed)
    };
    Ok(Fit {
        ledger,
        budget: budget.clone(),
        verdict,
        suggestions,
    })
}

fn needed(g: &Arc<Gguf>, cfg: &Config, s: &Shape, budget: &Budget) -> Option<(u64, bool)> {
    let l = Ledger::price_with(g, cfg, s).ok()?;
    let v = Verdict::of(&l, budget);
    Some((v.needed, v.fits))
}

fn suggest(
    g: &Arc<Gguf>,
    cfg: &Config,
    shape: &Shape,
    budget: &Budget,
    before: u64,
) -> Vec<Suggestion> {
    let slot = shape.n_ctx_slot();
    let mut cands: Vec<(String, String, Shape)> = Vec::new();

    if shape.parallel > 1 {
        let mut s = shape.clone();
        s.parallel -= 1;
        s.ctx_size = slot.saturating_mul(s.parallel);
        cands.push((
            format!("one slot fewer ({} × {})", s.parallel, count(slot)),
            format!("--parallel {} --ctx-size {}", s.parallel, s.ctx_size),
            s,
        ));
    }

    // The largest per-slot window (a multiple of POOL_GRAIN) that fits at this slot count.
    let with_slot = |k: u64| {
        let mut s = shape.clone();
        s.ctx_size = (k * POOL_GRAIN).saturating_mul(shape.parallel);
        s
    };
    let fits_at = |k: u64| needed(g, cfg, &with_slot(k), budget).is_some_and(|(_, f)| f);
    let hi = slot / POOL_GRAIN;
    if hi >= 1 && fits_at(1) {
        let (mut lo, mut hi) = (1u64, hi);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits_at(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let s = with_slot(lo);
        if s.ctx_size < shape.ctx_size {
            cands.push((
                format!(
                    "a smaller pool ({} × {})",
                    shape.parallel,
                    count(s.n_ctx_slot())
                ),
                format!("--ctx-size {}", s.ctx_size),
                s,
            ));
        }
    }

    let fa_flag = |s: &mut Shape| {
        if s.flash_attn == super::FlashAttn::Off {
            s.flash_attn = super::FlashAttn::On;
            " --flash-attn on"
        } else {
            ""
        }
    };
    if !shape.cache_type_v.is_quantized() {
        let mut s = shape.clone();
        s.cache_type_v = KvType::Q8_0;
        let fa = fa_flag(&mut s);
        cands.push(("q8_0 V".into(), format!("--cache-type-v q8_0{fa}"), s));
    }
    if !shape.cache_type_k.is_quantized() {
        let mut s = shape.clone();
        s.cache_type_k = KvType::Q8_0;
        cands.push(("q8_0 K".into(), "--cache-type-k q8_0".into(), s));
    }
    if shape.drafting() {
        let mut s = shape.clone();
        s.spec = SpecType::None;
        cands.push(("drafting off".into(), "--spec-type none".into(), s));
        if !shape.spec_draft_type_k.is_quantized() || !shape.spec_draft_type_v.is_quantized() {
            let mut s = shape.clone();
            s.spec_draft_type_k = KvType::Q8_0;
            s.spec_draft_type_v = KvType::Q8_0;
            let fa = fa_flag(&mut s);
            cands.push((
                "q8_0 draft cache".into(),
                format!("--spec-draft-type-k q8_0 --spec-draft-type-v q8_0{fa}"),
                s,
            ));
        }
    }
    let ub = shape.effective_ubatch();
    if ub >= 64 {
        let mut s = shape.clone();
        s.ubatch_size = ub / 2;
        cands.push((
            format!("a smaller ubatch ({})", ub / 2),
            format!("--ubatch-size {}", ub / 2),
            s,
        ));
    }
    if shape.mmproj.is_some() {
        let mut s = shape.clone();
        s.mmproj = None;
        cands.push(("no projector".into(), "drop --mmproj".into(), s));
        // The largest image-token limit that fits (the encoder's worst case shrinks with it),
        // or the smallest the minimum allows when none does.
        use crate::model::vision::{DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS};
        let lo = shape.image_min_tokens.unwrap_or(DEFAULT_MIN_TOKENS as u64);
        let cur = shape.image_max_tokens.unwrap_or(DEFAULT_MAX_TOKENS as u64);
        let with_max = |t: u64| {
            let mut s = shape.clone();
            s.image_max_tokens = Some(t);
            s
        };
        let fits_at = |t: u64| needed(g, cfg, &with_max(t), budget).is_some_and(|(_, f)| f);
        if lo < cur {
            let best = if fits_at(lo) {
                let (mut a, mut b) = (lo, cur - 1);
                while a < b {
                    let mid = a + (b - a).div_ceil(2);
                    if fits_at(mid) {
                        a = mid;
                    } else {
                        b = mid - 1;
                    }
                }
                a
            } else {
                lo
            };
            cands.push((
                format!("smaller images (at most {} tokens each)", count(best)),
                format!("--image-max-tokens {best}"),
                with_max(best),
            ));
        }
    }
    if !shape.lora.is_empty() {
        let mut s = shape.clone();
        s.lora.clear();
        cands.push(("no LoRA adapter".into(), "drop --lora-scaled".into(), s));
    }
    // Packed PTQ1_0 matrices take 34 bytes a block for the file's 28 (the others pack into
    // the same bytes, so this saves nothing for them and is dropped below).
    if shape.packs_weights() {
        let mut s = shape.clone();
        s.repack = false;
        cands.push(("weights read in place".into(), "--no-repack".into(), s));
    }

    let mut out: Vec<Suggestion> = cands
        .into_iter()
        .filter_map(|(change, flags, s)| {
            let (n, fits) = needed(g, cfg, &s, budget)?;
            (n < before).then(|| Suggestion {
                change,
                flags,
                shape: s,
                needed: n,
                saving: before - n,
                fits,
            })
        })
        .collect();
    out.sort_by(|a, b| {
        b.fits.cmp(&a.fits).then(if a.fits {
            a.saving.cmp(&b.saving)
        } else {
            b.saving.cmp(&a.saving)
        })
    });
    out
}

impl Suggestion {
    pub fn describe(&self) -> String {
        format!(
            "{}: {} saves {} MiB (needs {} MiB)",
            self.change,
            self.flags,
            mib(self.saving),
            mib(self.needed)
        )
    }
}
