//! systemd's service notifications for `Type=notify` (`deploy/systemd/tern.service`):
//! `READY=1` once the model is loaded and the warm-up step has checked the boot ledger,
//! `STATUS=` lines with the shape and the busy slots, `STOPPING=1` when the drain begins.
//! Without `NOTIFY_SOCKET` (not under systemd) each call does nothing.

use std::sync::atomic::Ordering;

use sd_notify::NotifyState;

use super::state::AppState;

/// Whether systemd listens (the unit is `Type=notify`).
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

fn send(states: &[NotifyState]) {
    if enabled() {
        if let Err(e) = sd_notify::notify(states) {
            tracing::warn!(target: "tern::server", "cannot notify systemd: {e}");
        }
    }
}

/// The shape and the busy slots, as `systemctl status` shows them.
pub fn status_line(state: &AppState) -> String {
    let c = &state.cfg;
    let busy = super::busy_slots(state);
    let what = if state.drain.is_on() {
        format!(
            "draining: {busy} running, {} refused",
            state.drain.refused.load(Ordering::Relaxed)
        )
    } else if state.ready().is_some() {
        format!("serving: {busy}/{} slots busy", c.total_slots)
    } else {
        "loading the model".to_string()
    };
    format!(
        "{what}; {} on {}, {} slot(s) x {} tokens",
        c.alias, c.backend, c.total_slots, c.n_ctx_slot
    )
}

pub fn ready(state: &AppState) {
    send(&[NotifyState::Ready, NotifyState::Status(&status_line(state))]);
}

pub fn status(state: &AppState) {
    send(&[NotifyState::Status(&status_line(state))]);
}

pub fn stopping(state: &AppState) {
    send(&[
        NotifyState::Stopping,
        NotifyState::Status(&status_line(state)),
    ]);
}
