//! Engine-internal phase timers: where a decode step's wall time goes (matmuls by class, the
//! mixer cores, rollback, the draft head, sampling), for `cargo xtask bench --engine`'s phase
//! table. Off unless [`enable`]d: a disabled timer is one relaxed atomic load.
//!
//! Timers do not nest: inside a timed phase (a draft step's MTP block) inner timers are
//! silent, so each nanosecond is counted once. The times are the host's wall time, which is
//! the work's on the CPU backend (every op is synchronous there); on a GPU backend they are
//! launch times.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// What a step's time is split by.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Attention q/k/v/o projections (with their fold transforms and LoRA terms).
    MmAttn,
    /// GDN qkv/gate/beta/alpha and ssm_out projections.
    MmGdn,
    /// FFN gate/up/down.
    MmFfn,
    /// The trunk's output head.
    Head,
    /// The GDN cores of every stream (conv, delta rule, gated norm, rollback cells).
    Gdn,
    /// The attention cores of every stream (norms, rope, cache append, attention).
    Attn,
    /// Norms, residual adds, SwiGLU, embeddings, row gathers.
    Elementwise,
    /// Rolling a rejected suffix back (recurrent state restore, cache truncation).
    Rollback,
    /// MTP draft steps (the MTP block, the draft head, the argmax).
    Draft,
    /// The MTP cache fill over accepted rows.
    MtpFill,
    /// Sampling the rows and verify bookkeeping.
    Sample,
}

impl Phase {
    pub const ALL: [Phase; 11] = [
        Phase::MmAttn,
        Phase::MmGdn,
        Phase::MmFfn,
        Phase::Head,
        Phase::Gdn,
        Phase::Attn,
        Phase::Elementwise,
        Phase::Rollback,
        Phase::Draft,
        Phase::MtpFill,
        Phase::Sample,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::MmAttn => "mm attn",
            Phase::MmGdn => "mm gdn",
            Phase::MmFfn => "mm ffn",
            Phase::Head => "out head",
            Phase::Gdn => "gdn core",
            Phase::Attn => "attn core",
            Phase::Elementwise => "elementwise",
            Phase::Rollback => "rollback",
            Phase::Draft => "draft steps",
            Phase::MtpFill => "mtp fill",
            Phase::Sample => "sample",
        }
    }
}

const N: usize = Phase::ALL.len();

static ENABLED: AtomicBool = AtomicBool::new(false);
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
static NS: [AtomicU64; N] = [ZERO; N];
/// Each recorded step: its rows, wall time and per-phase nanoseconds.
static STEPS: Mutex<Vec<StepPhases>> = Mutex::new(Vec::new());

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
}

/// One recorded step.
#[derive(Clone, Debug)]
pub struct StepPhases {
    /// Rows the trunk ran (a verify batch counts its drafts).
    pub rows: usize,
    /// Draft tokens the step's rounds carried.
    pub drafted: usize,
    pub total_ns: u64,
    pub ns: [u64; N],
}

/// Turns the timers on or off (and clears what they hold).
pub fn enable(on: bool) {
    for a in &NS {
        a.store(0, Ordering::Relaxed);
    }
    STEPS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A running timer; adds its time to its phase when dropped.
pub struct Timer(Option<(Phase, Instant)>);

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some((p, t0)) = self.0.take() {
            NS[p as usize].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            ACTIVE.with(|a| a.set(false));
        }
    }
}

/// Times `phase` until the returned guard drops (nothing when disabled or inside another
/// timed phase).
pub fn time(phase: Phase) -> Timer {
    if !enabled() || ACTIVE.with(Cell::get) {
        return Timer(None);
    }
    ACTIVE.with(|a| a.set(true));
    Timer(Some((phase, Instant::now())))
}

/// Ends a step: its phase times since the last call are recorded with its rows and wall time
/// (when enabled).
pub fn end_step(rows: usize, drafted: usize, total_ns: u64) {
    if !enabled() {
        return;
    }
    let ns = std::array::from_fn(|i| NS[i].swap(0, Ordering::Relaxed));
    STEPS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(StepPhases {
            rows,
            drafted,
            total_ns,
            ns,
        });
}

/// Drops the phase times accumulated since the last step ended (a step that is not recorded).
pub fn discard() {
    for a in &NS {
        a.store(0, Ordering::Relaxed);
    }
}

/// Takes the recorded steps.
pub fn take_steps() -> Vec<StepPhases> {
    std::mem::take(&mut *STEPS.lock().unwrap_or_else(|e| e.into_inner()))
}
