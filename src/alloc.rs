//! A counting global allocator: the CPU backend's activations live on the heap, so the boot
//! ledger measures its compute term as the heap's peak growth over the warm-up step. The
//! binary installs it (`#[global_allocator]`); a program that does not gets `None` from
//! [`peak_since`].
//!
//! Also [`Lines`], a buffer that starts on a cache line.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn grew(n: usize) {
    let now = CURRENT.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

impl Counting {
    /// Call once from `main` (or a test) after declaring the allocator, so the counters are
    /// trusted.
    pub fn mark_installed(&self) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
}

/// Has the C allocator keep the heap memory a program frees for its next allocations, rather
/// than hand it back to the kernel and fault it in again, zeroed, page by page: call once at the
/// start of `main` (glibc on Linux; elsewhere a no-op).
///
/// glibc maps an allocation above its mmap threshold (128 KiB at first, raised to the size of
/// each such block freed, up to 32 MiB) on its own and unmaps it when freed, and gives the top
/// of the heap back once more than twice that threshold is free there. The CPU backend's
/// activations are such blocks, a set per layer, so every layer of a warm-up step or a prompt
/// batch faulted its buffers in afresh. Fixed thresholds (32 MiB for mapping, the most glibc
/// takes; no trimming) stop that. On bench-0.8b PQ2_0 (Zen 4, 2 threads, the builds alternated):
/// - `tern generate -n 1` (a boot): 356 thousand page faults → 92 thousand, wall 2.77-2.98 →
///   1.93-2.16 s, peak RSS 537 MB either way;
/// - a 3,819-token prompt: 2.15 million faults → 111 thousand, 4.9 → 0.6 s in the kernel,
///   prefill 241 / 243 → 316 / 307 tokens/s, peak RSS 582 → 610-613 MB.
///
/// The memory kept is at most the heap's high-water mark, which the boot ledger measures and
/// prices as the compute term (34 MiB measured, 51 projected there), so a shape that fits still
/// fits.
pub fn keep_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's thresholds; glibc takes it at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
}

/// A point to measure from: the heap now, with the peak reset to it.
#[derive(Clone, Copy, Debug)]
pub struct Mark(usize);

pub fn mark() -> Mark {
    let now = CURRENT.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    Mark(now)
}

/// The heap's highest growth above `m` since it was taken, when the counting allocator is
/// installed.
pub fn peak_since(m: Mark) -> Option<u64> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| PEAK.load(Ordering::Relaxed).saturating_sub(m.0) as u64)
}

/// Plain values from a 64-byte boundary on: a packed matrix (`Lines<u8>`, so that rows whose
/// length is a multiple of 64 start each group on a cache line) or a GDN state (`Lines<f32>`,
/// so that each head and each of its rows start a line).
///
/// A buffer of [`HUGE`] bytes or more starts on a 2 MiB boundary, and on Linux is a mapping of
/// its own whose whole 2 MiB pages are advised as transparent huge pages before their first
/// touch ([`map_huge`]): a decode step streams every packed matrix once (and every GDN state,
/// which on a large model is a layer's `Lines` of 2 MiB or more), and with 4 KiB pages each
/// page is a TLB miss on the way. Where the kernel grants no huge page (THP `never`, or no
/// contiguous memory) the advice is a no-op and the buffer is an ordinary one.
pub struct Lines<T> {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    of: std::marker::PhantomData<T>,
}

// SAFETY: a `Lines<T>` owns its buffer as a `Vec<T>` would.
unsafe impl<T: Send> Send for Lines<T> {}
// SAFETY: shared access only reads, as a `&[T]`.
unsafe impl<T: Sync> Sync for Lines<T> {}

/// From this many bytes on, a [`Lines`] is laid out for 2 MiB pages.
pub const HUGE: usize = 2 << 20;

impl<T> Lines<T> {
    /// The allocation of `len` values: whole lines (never zero bytes, which `alloc` does not
    /// take), on a 2 MiB boundary for a large buffer.
    fn layout(len: usize) -> Layout {
        let bytes = len.saturating_mul(std::mem::size_of::<T>()).max(1);
        let align = if bytes >= HUGE { HUGE } else { 64 };
        // An absurd `len` (past isize::MAX bytes) reaches `handle_alloc_error` in `zeroed`.
        Layout::from_size_align(bytes.next_multiple_of(64), align).unwrap_or(Layout::new::<u8>())
    }
}

impl<T: bytemuck::Pod> Lines<T> {
    /// `len` zero values.
    pub fn zeroed(len: usize) -> Lines<T> {
        const { assert!(std::mem::align_of::<T>() <= 64) };
        let layout = Self::layout(len);
        if layout.size() < len.saturating_mul(std::mem::size_of::<T>()) {
            std::alloc::handle_alloc_error(layout);
        }
        let ptr = if layout.align() == HUGE {
            map_huge(layout.size())
        } else {
            // SAFETY: the layout's size is non-zero.
            unsafe { std::alloc::alloc_zeroed(layout) }
        };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        Lines {
            ptr,
            len,
            of: std::marker::PhantomData,
        }
    }
}

/// `size` zero bytes from a 2 MiB boundary, in a mapping of their own (Linux): the kernel's
/// zero pages, so nothing is written until the buffer is (a large GDN rollback cell, which the
/// CPU never writes, stays unbacked), and whose whole 2 MiB pages are advised as transparent huge
/// pages before their first touch. Only the whole 2 MiB pages: a huge page over the tail would
/// make its first touch back up to 2 MiB the buffer does not hold. Advice only: a kernel that
/// refuses it leaves ordinary pages. Such buffers bypass the counting allocator, as a file
/// mapping does. Null when the mapping fails.
#[cfg(target_os = "linux")]
fn map_huge(size: usize) -> *mut u8 {
    let len = size.next_multiple_of(PAGE);
    let span = len + HUGE;
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    let b = base as usize;
    let p = b.next_multiple_of(HUGE);
    // SAFETY: the slack before `p` and after `p + len` lies inside the mapping made above and
    // holds nothing; `p..p + len` is the buffer, and MADV_HUGEPAGE changes how its pages are
    // backed, never their contents.
    unsafe {
        if p > b {
            libc::munmap(base, p - b);
        }
        if b + span > p + len {
            libc::munmap((p + len) as *mut libc::c_void, b + span - (p + len));
        }
        libc::madvise(
            p as *mut libc::c_void,
            len / HUGE * HUGE,
            libc::MADV_HUGEPAGE,
        );
    }
    p as *mut u8
}

/// Unmaps a [`map_huge`] buffer of `size` bytes.
#[cfg(target_os = "linux")]
fn unmap_huge(p: *mut u8, size: usize) {
    // SAFETY: `p..p + size` (whole pages) is what `map_huge(size)` left mapped.
    unsafe { libc::munmap(p.cast(), size.next_multiple_of(PAGE)) };
}

#[cfg(target_os = "linux")]
const PAGE: usize = 4096;

/// Elsewhere a large buffer is an ordinary zeroed allocation on a 2 MiB boundary.
#[cfg(not(target_os = "linux"))]
fn map_huge(size: usize) -> *mut u8 {
    // SAFETY: the layout's size is non-zero and HUGE a power of two.
    unsafe { std::alloc::alloc_zeroed(Layout::from_size_align_unchecked(size, HUGE)) }
}

#[cfg(not(target_os = "linux"))]
fn unmap_huge(p: *mut u8, size: usize) {
    // SAFETY: `p` came from `map_huge(size)`, that layout.
    unsafe { std::alloc::dealloc(p, Layout::from_size_align_unchecked(size, HUGE)) };
}

impl<T> Drop for Lines<T> {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        if layout.align() == HUGE {
            unmap_huge(self.ptr.as_ptr(), layout.size());
        } else {
            // SAFETY: `ptr` came from `alloc_zeroed` with this same layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl<T: bytemuck::Pod> Clone for Lines<T> {
    fn clone(&self) -> Lines<T> {
        let mut l = Lines::zeroed(self.len);
        l.copy_from_slice(self);
        l
    }
}

impl<T: bytemuck::Pod> From<Vec<T>> for Lines<T> {
    fn from(v: Vec<T>) -> Lines<T> {
        let mut l = Lines::zeroed(v.len());
        l.copy_from_slice(&v);
        l
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the buffer holds at least `len` values' bytes, initialized, on a 64-byte
        // boundary (T's alignment divides 64); T is Pod, so any bytes are a T.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: bytemuck::Pod + PartialEq> PartialEq for Lines<T> {
    fn eq(&self, other: &Lines<T>) -> bool {
        self[..] == other[..]
    }
}

impl<T: bytemuck::Pod + std::fmt::Debug> std::fmt::Debug for Lines<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self[..].fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::{Lines, HUGE};

    #[test]
    fn lines_start_on_their_boundary_and_hold_zeros_then_what_is_written() {
        for (len, align) in [
            (0usize, 64usize),
            (1, 64),
            (1000, 64),
            (HUGE / 4 - 1, 64),
            (HUGE / 4, HUGE),
            (HUGE / 4 * 3 + 5, HUGE),
        ] {
            let mut l = Lines::<f32>::zeroed(len);
            assert_eq!(l.len(), len);
            assert_eq!(l.as_ptr() as usize % align, 0, "{len} values");
            assert!(l.iter().all(|&v| v == 0.0), "{len} values");
            for (i, v) in l.iter_mut().enumerate() {
                *v = i as f32;
            }
            let c = l.clone();
            assert_ne!(c.as_ptr(), l.as_ptr());
            assert_eq!(c, l);
            assert_eq!(c.last().copied(), len.checked_sub(1).map(|i| i as f32));
        }
        let v: Vec<u8> = (0..=255).cycle().take(HUGE + 7).collect();
        assert_eq!(&Lines::from(v.clone())[..], &v[..]);
    }

    /// How many of the 4 KiB pages of `l` are resident (`mincore`): exact for the range,
    /// whatever mapping the kernel merged it into.
    #[cfg(target_os = "linux")]
    fn resident_pages(l: &Lines<u8>) -> usize {
        let pages = l.len().div_ceil(4096);
        let mut v = vec![0u8; pages];
        // SAFETY: `l` is page-aligned (2 MiB) and `v` holds a byte per page of its length.
        let rc = unsafe { libc::mincore(l.as_ptr() as *mut _, l.len(), v.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore");
        v.iter().filter(|&&b| b & 1 == 1).count()
    }

    /// A large buffer is the kernel's zero pages until written (a GDN rollback cell the CPU
    /// never writes costs no memory), and its first write backs only the pages written.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_buffer_is_backed_only_where_written() {
        let mut l = Lines::<u8>::zeroed(8 * HUGE + 100);
        assert_eq!(resident_pages(&l), 0);
        l[3 * HUGE + 5] = 1;
        let n = resident_pages(&l);
        // One page: 4 KiB, or 2 MiB where the kernel grants the huge page.
        assert!((1..=512).contains(&n), "{n} pages resident after one write");
        assert_eq!(l.iter().map(|&b| u32::from(b)).sum::<u32>(), 1);
    }
}
