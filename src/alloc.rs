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
#[derive(Clone)]
pub struct Lines<T> {
    buf: Vec<Line>,
    len: usize,
    of: std::marker::PhantomData<T>,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl<T: bytemuck::Pod> Lines<T> {
    /// `len` zero values.
    pub fn zeroed(len: usize) -> Lines<T> {
        const { assert!(std::mem::align_of::<T>() <= 64) };
        Lines {
            buf: vec![Line([0; 64]); (len * std::mem::size_of::<T>()).div_ceil(64)],
            len,
            of: std::marker::PhantomData,
        }
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
        // SAFETY: `buf` holds at least `len` values' bytes, initialized, on a 64-byte boundary
        // (T's alignment divides 64); T is Pod, so any bytes are a T.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().cast::<T>(), self.len) }
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
