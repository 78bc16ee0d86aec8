//! `alloc::keep_freed_heap`: a block the program frees is there for its next allocation,
//! resident, instead of going back to the kernel and faulting in again page by page. A file of
//! its own, so the allocator starts from a fresh process's state.

/// Minor page faults of the calling thread so far.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn faults() -> i64 {
    // SAFETY: rusage is plain integers, for which all zeros is a value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid rusage for the call to fill.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
    ru.ru_minflt
}

/// A 16 MiB buffer allocated, written whole (so every page is touched) and freed, as a CPU
/// step's activations are: glibc's default maps a block that size on its own and unmaps it when
/// freed, and the next one comes from new heap pages, 4,096 faults each time.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_freed_block_is_reused_without_faulting_its_pages_in_again() {
    tern::alloc::keep_freed_heap();
    const N: usize = 16 << 20;
    let round = || {
        let mut v: Vec<u8> = Vec::with_capacity(N);
        v.resize(N, 1);
        std::hint::black_box(&v);
    };
    let f0 = faults();
    round();
    let f1 = faults();
    round();
    let f2 = faults();
    // The first buffer's pages are new: the counter sees them (so the check below can fail).
    assert!(f1 - f0 >= 2048, "first buffer: {} faults", f1 - f0);
    assert!(
        f2 - f1 < 64,
        "the second buffer faulted {} pages in again (the first took {})",
        f2 - f1,
        f1 - f0
    );
}
