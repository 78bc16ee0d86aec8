//! The CUDA device under the GPU op layer (`backend::gpu::Device`): one context and one stream,
//! the module cache (NVRTC at first use, one module per `Kernel`), a pinned upload ring, and
//! kernel launches.
//!
//! Everything is ordered by the one stream: ops enqueue launches and copies and never wait.
//! The host waits only where it reads (`read`: sampled ids, requested logits). A pooled buffer
//! dropped while a launch that reads it is still queued goes back to the pool at once; whoever
//! takes it next writes it from a later launch on the same stream, so the queue orders the two.
//! Host data goes up through a pinned ring, so an upload is an asynchronous copy too (a copy
//! from pageable memory would wait for the stream); a slot of the ring is reused only after the
//! event recorded behind its copy has passed.
//!
//! `Device::emulated` runs the same kernels on the CPU instead (`emu.rs`): memory is host
//! memory, every launch runs to completion before it returns. It exists so that the backend,
//! host code and kernels together, can be checked against the CPU reference where there is no
//! GPU.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    result as dres, sys as dsys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice,
    CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::emu::{Emu, EmuFn, HostMem};
use super::kernels::{self, Target};
use crate::backend::gpu::{self, AllocRule, Caps, Grid, Kernel as GpuKernel, Scalar, View};
use crate::backend::BackendError;

/// Bytes of the pinned upload ring.
const RING_BYTES: usize = 8 << 20;
/// Alignment of ring slots.
const ALIGN: usize = 256;
/// Static shared memory a block may use without opting in to more.
const STATIC_SHARED_BYTES: u32 = 48 << 10;

fn unavailable(why: impl Into<String>) -> BackendError {
    BackendError::Unavailable("cuda".into(), why.into())
}

fn driver_error(what: &str, e: dres::DriverError) -> BackendError {
    unavailable(format!("{what}: {e}"))
}

/// Device memory: a CUDA allocation, or host memory in the emulator.
enum Mem {
    Cuda(CudaSlice<u8>),
    Host(HostMem),
}

impl Mem {
    fn len(&self) -> usize {
        match self {
            Mem::Cuda(m) => m.len(),
            Mem::Host(m) => m.len(),
        }
    }
}

/// A device allocation of its own (weights, caches, recurrent states): freed, in stream order,
/// when dropped.
pub struct DBuf {
    mem: Mem,
    ptr: u64,
}

impl DBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Bytes allocated.
    pub fn size(&self) -> usize {
        self.mem.len()
    }
}

/// Pinned host memory copies go up from, used as a ring.
struct Ring {
    host: *mut u8,
    cap: usize,
    head: usize,
    /// Slots whose copy may still be queued: (start, end, event recorded after the copy),
    /// oldest first.
    inflight: VecDeque<(usize, usize, CudaEvent)>,
}

// SAFETY: the pointer is to pinned host memory owned by the ring and only touched under the
// device's mutex.
unsafe impl Send for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        for (_, _, ev) in self.inflight.drain(..) {
            let _ = ev.synchronize();
        }
        // SAFETY: allocated by malloc_host in Device::new and no copy from it is pending.
        unsafe {
            let _ = dres::free_host(self.host as *mut std::ffi::c_void);
        }
    }
}

/// One kernel argument as the driver and the emulator take it.
#[derive(Copy, Clone, Debug)]
pub enum Arg {
    /// A device pointer (0 for an unused one).
    P(u64),
    U(u32),
    F(f32),
}

/// A compiled kernel, ready to launch.
#[derive(Clone)]
pub enum Kernel {
    Cuda(CudaFunction),
    Emu(EmuFn),
}

/// The CUDA side of a device: context, stream, loaded modules, the upload ring.
struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Mutex<HashMap<GpuKernel, Arc<CudaModule>>>,
    ring: Mutex<Ring>,
}

impl Cuda {
    /// Makes the context current on the calling thread (the engine may drive the backend from
    /// any thread); needed before the driver calls made here directly, which cudarc's wrappers
    /// would otherwise make for us.
    fn bound(&self) -> &Cuda {
        self.ctx
            .bind_to_thread()
            .expect("cuda: making the context current");
        self
    }
}

enum Engine {
    Cuda(Cuda),
    Emu(Emu),
}

pub struct Device {
    engine: Engine,
    pub name: String,
    /// (major, minor) compute capability ((0, 0) in the emulator).
    pub cc: (i32, i32),
    pub total_mem: u64,
    /// cuDriverGetVersion: 1000 * major + 10 * minor (0 in the emulator).
    pub driver_version: i32,
    pub nvrtc_version: (i32, i32),
    /// What NVRTC compiles the kernels to on this device (`None` in the emulator).
    pub target: Option<Target>,
    functions: Mutex<HashMap<GpuKernel, Kernel>>,
    caps: Caps,
}

/// Whether a CUDA device can be opened here; the reason when not. Never panics: the driver
/// library is probed before cudarc touches it (`CudaContext::new` panics without it).
pub fn probe() -> Result<i32, BackendError> {
    // SAFETY: only tries to dlopen libcuda by its names.
    if !unsafe { dsys::is_culib_present() } {
        return Err(unavailable(
            "no CUDA driver on this machine (libcuda.so not found)",
        ));
    }
    let n = CudaContext::device_count().map_err(|e| driver_error("cuInit", e))?;
    if n < 1 {
        return Err(unavailable("the CUDA driver reports no device"));
    }
    Ok(n)
}

/// `(free, total)` bytes of device memory (cuMemGetInfo) on device `ordinal`, without keeping
/// a backend open: the planner's budget.
pub fn memory(ordinal: usize) -> Result<(u64, u64), BackendError> {
    probe()?;
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("context", e))?;
    let (free, total) = ctx
        .mem_get_info()
        .map_err(|e| driver_error("cuMemGetInfo", e))?;
    Ok((free as u64, total as u64))
}

/// The NVRTC target for a device of compute capability `sm` when NVRTC supports `archs`.
pub fn pick_target(sm: u32, archs: &[u32]) -> Option<Target> {
    if archs.contains(&sm) {
        return Some(Target::Cubin(sm));
    }
    // A device newer than this NVRTC: PTX for the newest architecture below it, which the
    // driver compiles at load.
    archs
        .iter()
        .copied()
        .filter(|&a| a < sm)
        .max()
        .map(Target::Ptx)
}

impl Device {
    /// Opens device `ordinal`, or says why it cannot.
    pub fn new(ordinal: usize) -> Result<Device, BackendError> {
        let n = probe()?;
        if ordinal as i32 >= n {
            return Err(unavailable(format!(
                "device {ordinal} asked for, the driver reports {n}"
            )));
        }
        if let Some(why) = kernels::nvrtc_missing() {
            return Err(unavailable(why));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("context", e))?;
        // One stream orders everything: no per-buffer events.
        // SAFETY: nothing has been allocated in this context through cudarc yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| driver_error("stream", e))?;
        let name = ctx.name().unwrap_or_else(|_| "?".into());
        let cc = ctx
            .compute_capability()
            .map_err(|e| driver_error("compute capability", e))?;
        let total_mem = ctx.total_mem().map_err(|e| driver_error("memory", e))? as u64;
        let mut driver_version = 0;
        // SAFETY: an out-parameter.
        unsafe { dsys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| driver_error("driver version", e))?;
        let nvrtc_version = kernels::nvrtc_version();
        let sm = (cc.0 * 10 + cc.1) as u32;
        let target = pick_target(sm, &kernels::supported_archs()).ok_or_else(|| {
            unavailable(format!(
                "NVRTC {}.{} compiles for no architecture up to sm_{sm}",
                nvrtc_version.0, nvrtc_version.1
            ))
        })?;
        ctx.bind_to_thread()
            .map_err(|e| driver_error("context", e))?;
        // SAFETY: a plain pinned allocation, freed by Ring::drop.
        let host = unsafe { dres::malloc_host(RING_BYTES, 0) }
            .map_err(|e| driver_error("pinned upload ring", e))? as *mut u8;
        Ok(Device {
            engine: Engine::Cuda(Cuda {
                ctx,
                stream,
                modules: Mutex::new(HashMap::new()),
                ring: Mutex::new(Ring {
                    host,
                    cap: RING_BYTES,
                    head: 0,
                    inflight: VecDeque::new(),
                }),
            }),
            name,
            cc,
            total_mem,
            driver_version,
            nvrtc_version,
            target: Some(target),
            functions: Mutex::new(HashMap::new()),
            caps: Caps {
                max_binding: u64::MAX,
                shared_bytes: STATIC_SHARED_BYTES,
                native_f16: false,
            },
        })
    }

    /// The CPU emulator of a device (`emu.rs`): the same kernels built with the host C++
    /// compiler, for checking the backend without a GPU. Slow.
    pub fn emulated() -> Result<Device, BackendError> {
        let emu = Emu::new()?;
        Ok(Device {
            name: format!("CPU emulation ({})", emu.compiler()),
            engine: Engine::Emu(emu),
            cc: (0, 0),
            total_mem: 0,
            driver_version: 0,
            nvrtc_version: (0, 0),
            target: None,
            functions: Mutex::new(HashMap::new()),
            caps: Caps {
                max_binding: u64::MAX,
                shared_bytes: STATIC_SHARED_BYTES,
                native_f16: false,
            },
        })
    }

    /// Whether this is the CPU emulator.
    pub fn is_emulated(&self) -> bool {
        matches!(self.engine, Engine::Emu(_))
    }

    fn cuda(&self) -> Option<&Cuda> {
        match &self.engine {
            Engine::Cuda(c) => Some(c),
            Engine::Emu(_) => None,
        }
    }

    /// One line for start-up logs.
    pub fn describe(&self) -> String {
        let Some(target) = self.target else {
            return format!("cuda backend on the {} (no GPU)", self.name);
        };
        let free = self
            .mem_info()
            .map(|(f, _)| format!("{} MiB free", f >> 20))
            .unwrap_or_else(|e| format!("free memory unknown ({e})"));
        format!(
            "cuda device {:?} (sm_{}{}, {} MiB, {free}), driver {}.{}, kernels by NVRTC {}.{} as {}",
            self.name,
            self.cc.0,
            self.cc.1,
            self.total_mem >> 20,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10,
            self.nvrtc_version.0,
            self.nvrtc_version.1,
            target
        )
    }

    /// `(free, total)` device memory in bytes (cuMemGetInfo).
    pub fn mem_info(&self) -> Result<(u64, u64), BackendError> {
        let Some(c) = self.cuda() else {
            return Err(unavailable("the emulator has no device memory figure"));
        };
        let (f, t) = c
            .ctx
            .mem_get_info()
            .map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok((f as u64, t as u64))
    }

    /// The compiled `kernel`, built and loaded the first time: its module is its file with its
    /// constants, its one entry point is named after the file.
    fn function(&self, kernel: GpuKernel) -> Kernel {
        if let Some(f) = self.functions.lock().unwrap().get(&kernel) {
            return f.clone();
        }
        let entry = kernel.spec().file;
        let f = match &self.engine {
            Engine::Emu(e) => Kernel::Emu(e.function(kernel)),
            Engine::Cuda(c) => {
                let target = self.target.expect("a CUDA device has a target");
                let module = {
                    let mut modules = c.modules.lock().unwrap();
                    match modules.get(&kernel) {
                        Some(m) => m.clone(),
                        None => {
                            let k = kernels::compile(kernel, target)
                                .unwrap_or_else(|e| panic!("cuda: compiling {kernel}: {e}"));
                            let image = match k.target {
                                Target::Cubin(_) => Ptx::from_binary(k.image),
                                Target::Ptx(_) => Ptx::from_src(
                                    String::from_utf8(k.image).expect("PTX is ASCII text"),
                                ),
                            };
                            let m = c.ctx.load_module(image).unwrap_or_else(|e| {
                                panic!("cuda: loading {kernel} ({}): {e}", k.target)
                            });
                            modules.insert(kernel, m.clone());
                            m
                        }
                    }
                };
                Kernel::Cuda(
                    module
                        .load_function(entry)
                        .unwrap_or_else(|e| panic!("cuda: {kernel} has no kernel {entry}: {e}")),
                )
            }
        };
        self.functions.lock().unwrap().insert(kernel, f.clone());
        f
    }

    /// Enqueues one launch: `grid` blocks of `block` threads, static shared memory only.
    fn launch_raw(&self, f: &Kernel, grid: (u32, u32, u32), block: u32, args: &[Arg]) {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return;
        }
        match (f, &self.engine) {
            (Kernel::Emu(f), Engine::Emu(e)) => e.launch(f, grid, block, args),
            (Kernel::Cuda(f), Engine::Cuda(c)) => {
                let mut b = c.stream.launch_builder(f);
                for a in args {
                    match a {
                        Arg::P(p) => b.arg(p),
                        Arg::U(u) => b.arg(u),
                        Arg::F(x) => b.arg(x),
                    };
                }
                let cfg = LaunchConfig {
                    grid_dim: grid,
                    block_dim: (block, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the argument list matches the kernel's signature (each op passes the
                // buffers and then the scalars of its .cu entry point in order) and every
                // pointer is a live device allocation of the sizes the op checked.
                unsafe { b.launch(cfg) }.expect("cuda: kernel launch");
            }
            _ => unreachable!("a kernel runs on the device that built it"),
        }
    }

    fn try_raw_alloc(&self, bytes: usize, zeroed: bool) -> Result<(Mem, u64), BackendError> {
        let refused = |e: String| BackendError::BadWeight {
            name: "device memory".into(),
            what: format!("allocating {bytes} bytes on {:?}: {e}", self.name),
        };
        match &self.engine {
            Engine::Emu(_) => {
                let m = HostMem::new(bytes, zeroed).map_err(refused)?;
                let ptr = m.addr();
                Ok((Mem::Host(m), ptr))
            }
            Engine::Cuda(c) => {
                // SAFETY: device memory, written before it is read by every op that allocates
                // it (or zeroed below).
                let mem =
                    unsafe { c.stream.alloc::<u8>(bytes) }.map_err(|e| refused(e.to_string()))?;
                let (ptr, _) = mem.device_ptr(&c.stream);
                if zeroed {
                    let c = c.bound();
                    // SAFETY: the whole allocation, on our stream.
                    unsafe { dres::memset_d8_async(ptr, 0, bytes, c.stream.cu_stream()) }
                        .expect("cuda: memset");
                }
                Ok((Mem::Cuda(mem), ptr))
            }
        }
    }

    /// A device allocation of exactly `bytes` (at least 4), outside the pool, or the driver's
    /// refusal.
    pub fn try_alloc_exact(&self, bytes: usize) -> Result<DBuf, BackendError> {
        let (mem, ptr) = self.try_raw_alloc(bytes.max(4), false)?;
        Ok(DBuf { mem, ptr })
    }

    /// Copies `data` to device address `dst`, in stream order and without waiting: through
    /// the pinned ring when it fits half of it, else synchronously from `data` (weights at load
    /// time, very large host tensors).
    pub fn write_ptr(&self, dst: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let c = match &self.engine {
            Engine::Emu(_) => {
                // SAFETY: `dst` is a live host allocation of at least data.len() bytes.
                unsafe { std::ptr::copy(data.as_ptr(), dst as *mut u8, data.len()) };
                return;
            }
            Engine::Cuda(c) => c.bound(),
        };
        let stream = c.stream.cu_stream();
        let mut ring = c.ring.lock().unwrap();
        if data.len() > ring.cap / 2 {
            drop(ring);
            // SAFETY: `dst` holds at least data.len() bytes (the callers allocate it so).
            unsafe { dres::memcpy_htod_async(dst, data, stream) }.expect("cuda: upload");
            c.stream.synchronize().expect("cuda: upload");
            return;
        }
        let n = data.len().div_ceil(ALIGN) * ALIGN;
        if ring.head + n > ring.cap {
            ring.head = 0;
        }
        let (start, end) = (ring.head, ring.head + n);
        // A slot is free once the copy behind the last overlapping one has run (copies run
        // in the order they were queued).
        if let Some(last) = ring
            .inflight
            .iter()
            .rposition(|&(s, e, _)| s < end && start < e)
        {
            ring.inflight[last]
                .2
                .synchronize()
                .expect("cuda: upload ring event");
            ring.inflight.drain(..=last);
        }
        // SAFETY: [start, start + len) lies in the ring's allocation and no queued copy reads it.
        let slot = unsafe { std::slice::from_raw_parts_mut(ring.host.add(start), data.len()) };
        slot.copy_from_slice(data);
        // SAFETY: pinned source, device destination of at least data.len() bytes.
        unsafe { dres::memcpy_htod_async(dst, &*slot, stream) }.expect("cuda: upload");
        let ev = c
            .ctx
            .new_event(Some(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .expect("cuda: event");
        ev.record(&c.stream).expect("cuda: event record");
        ring.inflight.push_back((start, end, ev));
        ring.head = end;
    }

    /// A buffer of its own holding `data` (weights), copied synchronously; `Err` when the
    /// device cannot hold it.
    pub fn upload_exact(&self, data: &[u8]) -> Result<DBuf, BackendError> {
        let b = self.try_alloc_exact(data.len())?;
        if data.is_empty() {
            return Ok(b);
        }
        match &self.engine {
            Engine::Emu(_) => self.write_ptr(b.ptr, data),
            Engine::Cuda(c) => {
                let c = c.bound();
                // SAFETY: the allocation holds data.len() bytes.
                unsafe { dres::memcpy_htod_async(b.ptr, data, c.stream.cu_stream()) }
                    .expect("cuda: upload");
                c.stream.synchronize().expect("cuda: upload");
            }
        }
        Ok(b)
    }

    /// Device-to-device copy, in stream order.
    pub fn copy_ptr(&self, src: u64, dst: u64, bytes: usize) {
        if bytes == 0 {
            return;
        }
        match &self.engine {
            // SAFETY: both ranges are live host allocations of at least `bytes`.
            Engine::Emu(_) => unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) },
            // SAFETY: both ranges are live allocations of at least `bytes` (the callers check).
            Engine::Cuda(c) => {
                let c = c.bound();
                unsafe { dres::memcpy_dtod_async(dst, src, bytes, c.stream.cu_stream()) }
                    .expect("cuda: device copy")
            }
        }
    }

    /// Copies `bytes` at device address `src` back to the host once the queued work is done:
    /// the only place the host waits for the device.
    pub fn read_ptr(&self, src: u64, bytes: usize) -> Vec<u8> {
        let mut out = vec![0u8; bytes];
        if bytes == 0 {
            return out;
        }
        match &self.engine {
            // SAFETY: `src` is a live host allocation of at least `bytes`.
            Engine::Emu(_) => unsafe { std::ptr::copy(src as *const u8, out.as_mut_ptr(), bytes) },
            Engine::Cuda(c) => {
                let c = c.bound();
                // SAFETY: `src` holds at least `bytes` bytes; the stream is synchronised
                // before `out` is used.
                unsafe { dres::memcpy_dtoh_async(&mut out[..], src, c.stream.cu_stream()) }
                    .expect("cuda: readback");
                c.stream.synchronize().expect("cuda: readback");
            }
        }
        out
    }

    /// Waits for everything queued (benchmarks).
    pub fn synchronize(&self) {
        if let Some(c) = self.cuda() {
            c.stream.synchronize().expect("cuda: synchronize");
        }
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus bytes written per second),
    /// measured with events over `reps` copies of `bytes`: the bench's roofline.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> f64 {
        let a = self.try_alloc_exact(bytes).expect("cuda: bandwidth buffer");
        let b = self.try_alloc_exact(bytes).expect("cuda: bandwidth buffer");
        self.copy_ptr(a.ptr, b.ptr, bytes);
        let Some(c) = self.cuda() else {
            let t = std::time::Instant::now();
            for i in 0..reps {
                let (s, d) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
                self.copy_ptr(s.ptr, d.ptr, bytes);
            }
            return (2 * bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        };
        let start = c
            .ctx
            .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .expect("cuda: event");
        let end = c
            .ctx
            .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .expect("cuda: event");
        start.record(&c.stream).expect("cuda: event record");
        for i in 0..reps {
            let (s, d) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
            self.copy_ptr(s.ptr, d.ptr, bytes);
        }
        end.record(&c.stream).expect("cuda: event record");
        end.synchronize().expect("cuda: event");
        let ms = start.elapsed_ms(&end).expect("cuda: elapsed") as f64;
        (2 * bytes * reps) as f64 / (ms / 1e3) / 1e9
    }
}

/// Blocks needed for `n` items at `per` items each.
pub fn blocks(n: usize, per: usize) -> u32 {
    u32::try_from(n.div_ceil(per)).expect("grid larger than 2^32 blocks")
}

/// Threads per block and logical workgroups per block of a kernel's launch. Every kernel runs
/// its WGSL twin's workgroup as one block, except `matmul_vec`, which gives each (row, token
/// group) one warp and packs `VEC_WARPS` of them into a block.
fn launch_shape(kernel: GpuKernel) -> (u32, usize) {
    match kernel {
        GpuKernel::MatmulVec { .. } => (32 * VEC_WARPS, VEC_WARPS as usize),
        k => (k.spec().wg, 1),
    }
}

/// Warps, each one output row and token group, per `matmul_vec` block (`WARPS` in the .cu).
pub const VEC_WARPS: u32 = 4;

fn view_ptr(v: &View<'_, DBuf>) -> u64 {
    v.mem.ptr + v.offset
}

impl gpu::Device for Device {
    type Mem = DBuf;
    const NAME: &'static str = "cuda";

    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn alloc_rule(&self) -> AllocRule {
        gpu::cuda_alloc_rule()
    }

    fn describe(&self) -> String {
        Device::describe(self)
    }

    fn alloc(&self, bytes: u64) -> Result<DBuf, BackendError> {
        self.try_alloc_exact(bytes as usize)
    }

    fn upload_new(&self, data: &[u8]) -> Result<DBuf, BackendError> {
        self.upload_exact(data)
    }

    fn write(&self, dst: &DBuf, data: &[u8]) {
        assert!(data.len() <= dst.size(), "cuda: write past an allocation");
        self.write_ptr(dst.ptr, data);
    }

    fn zero(&self, dst: &DBuf) {
        match &self.engine {
            // SAFETY: the whole live host allocation.
            Engine::Emu(_) => unsafe { std::ptr::write_bytes(dst.ptr as *mut u8, 0, dst.size()) },
            Engine::Cuda(c) => {
                let c = c.bound();
                // SAFETY: the whole allocation, on our stream.
                unsafe { dres::memset_d8_async(dst.ptr, 0, dst.size(), c.stream.cu_stream()) }
                    .expect("cuda: memset");
            }
        }
    }

    fn size(&self, mem: &DBuf) -> u64 {
        mem.size() as u64
    }

    fn copy(&self, src: &DBuf, src_off: u64, dst: &DBuf, dst_off: u64, bytes: u64) {
        assert!(
            src_off + bytes <= src.size() as u64 && dst_off + bytes <= dst.size() as u64,
            "cuda: copy past an allocation"
        );
        self.copy_ptr(src.ptr + src_off, dst.ptr + dst_off, bytes as usize);
    }

    fn read(&self, src: &DBuf, offset: u64, bytes: u64) -> Vec<u8> {
        assert!(
            offset + bytes <= src.size() as u64,
            "cuda: read past an allocation"
        );
        self.read_ptr(src.ptr + offset, bytes as usize)
    }

    fn launch(&self, kernel: GpuKernel, grid: Grid, bufs: &[View<'_, DBuf>], scalars: &[Scalar]) {
        let (block, per_block) = launch_shape(kernel);
        let grid = match grid {
            Grid::Linear(n) => (blocks(n, per_block), 1, 1),
            Grid::Dims([x, y, z]) => (x, y, z),
        };
        let f = self.function(kernel);
        let args: Vec<Arg> = bufs
            .iter()
            .map(|v| Arg::P(view_ptr(v)))
            .chain(scalars.iter().map(|s| match *s {
                Scalar::U(u) => Arg::U(u),
                Scalar::F(x) => Arg::F(x),
            }))
            .collect();
        self.launch_raw(&f, grid, block, &args);
    }
}
