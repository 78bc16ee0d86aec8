//! A forward step on the rayon pool, its threads kept hot until it ends.
//!
//! A step is ~140 parallel regions (a matmul each, the mixers' cores) with short serial gaps
//! between them. Entered from a thread outside the pool, every region parks that thread and
//! wakes it again; and a worker that finds no work parks after ~32 `sched_yield`s, so the
//! next region waits for its wake-up (an IPI to a halted vCPU on a VM: tens of µs). ggml's
//! threadpool spins its threads on a barrier between the ops of a graph instead. Here the step
//! runs on a worker, and every other worker runs a `keep_hot` job for the length of the step:
//! it takes the step's jobs as they appear (`rayon::yield_now`) and yields the core while
//! there are none, so it never parks mid-step. Between steps nothing spins: the jobs end with
//! the step.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

thread_local! {
    /// Set while this thread runs a step: a step inside it (the engine's step, then the
    /// forward inside it) runs in place.
    static IN_STEP: Cell<bool> = const { Cell::new(false) };
}

/// A `keep_hot` job that found no work for this long parks as rayon would: bounds what a job
/// that ran nested under one of the step's own jobs (its thread stole it while waiting) can
/// hold that job up.
const MAX_IDLE: Duration = Duration::from_millis(1);

/// Whether a step of this process runs hot now. One at a time: a step that several callers
/// run at once (tests, a second engine) would otherwise run whole inside another's
/// `keep_hot` job (it takes injected jobs too) and hold that step up until it ends.
static HOT: AtomicBool = AtomicBool::new(false);

/// Runs `f` as one step on a worker of the current pool, the pool's other workers hot; while
/// another step runs hot, on this thread as before.
pub(super) fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if IN_STEP.get() || HOT.swap(true, Ordering::Acquire) {
        return f();
    }
    // Released even when `f` panics.
    struct Cool;
    impl Drop for Cool {
        fn drop(&mut self) {
            HOT.store(false, Ordering::Release);
        }
    }
    let _cool = Cool;
    run_hot(f)
}

/// `run` without the one-at-a-time rule.
fn run_hot<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    rayon::scope(|s| {
        let step_thread = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            let done = &done;
            s.spawn(move |_| keep_hot(done, step_thread));
        }
        // Undone even when `f` panics: the thread goes back to the pool.
        struct Leave<'a>(&'a AtomicBool, bool);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                IN_STEP.set(self.1);
                self.0.store(true, Ordering::Release);
            }
        }
        let _leave = Leave(&done, IN_STEP.replace(true));
        f()
    })
}

/// Runs the pool's jobs until `done`. On the step's own thread (which popped it while
/// waiting for a join inside the step) it returns at once: it would block the step under it.
fn keep_hot(done: &AtomicBool, step_thread: Option<usize>) {
    if rayon::current_thread_index() == step_thread {
        return;
    }
    let mut idle_since: Option<Instant> = None;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle_since = None,
            _ => {
                if idle_since.get_or_insert_with(Instant::now).elapsed() > MAX_IDLE {
                    return;
                }
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn a_step_runs_on_a_worker_and_a_step_inside_it_in_place() {
        let (outer, inner) = run_hot(|| {
            let outer = rayon::current_thread_index();
            assert!(IN_STEP.get(), "the step's thread is marked");
            (outer, run(rayon::current_thread_index))
        });
        assert!(outer.is_some(), "the step runs on a worker of the pool");
        assert_eq!(inner, outer, "a nested step stays on the step's thread");
        assert!(!IN_STEP.get(), "the caller is not left marked as in a step");
    }

    #[test]
    fn steps_of_parallel_regions_give_the_serial_sums() {
        // Many short steps of nested regions, as a decode loop runs them: no job is lost to
        // the kept-hot workers and none deadlocks.
        let x: Vec<u64> = (0..10_000).collect();
        for step in 0..500u64 {
            // Both ways a step can run (another test may hold the hot one).
            let sums = || {
                (0..4u64)
                    .map(|r| {
                        x.par_chunks(64)
                            .map(|c| c.iter().sum::<u64>() * (r + step))
                            .sum::<u64>()
                    })
                    .sum::<u64>()
            };
            let got = if step % 2 == 0 {
                run_hot(sums)
            } else {
                run(sums)
            };
            let want: u64 = (0..4u64).map(|r| x.iter().sum::<u64>() * (r + step)).sum();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn a_panicking_step_reaches_the_caller_and_the_pool_goes_on() {
        let r = std::panic::catch_unwind(|| run_hot(|| panic!("bug in a step")));
        assert!(r.is_err());
        assert!(!IN_STEP.get());
        assert_eq!(run_hot(|| (0..100u32).into_par_iter().sum::<u32>()), 4950);
    }
}
