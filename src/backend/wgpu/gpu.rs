//! The wgpu device, a cache of compute pipelines, a pool of storage buffers, and the pending
//! command encoder that every op records into.
//!
//! Ops never wait: they record a dispatch into the pending encoder. The encoder is submitted
//! only when the host needs data (`read`) or when the uniform arena fills up, so one decode step
//! is one command buffer and the only readback is what the caller asks for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::backend::BackendError;

/// Bytes of uniforms one submission can carry; each dispatch takes one aligned slot.
const ARENA_BYTES: u64 = 1 << 20;

/// A storage buffer on loan from the pool; it goes back when dropped. Dropping one that a
/// pending dispatch still reads is fine: wgpu keeps the memory alive until the work is done, and
/// a later dispatch that reuses it is ordered after the earlier one in the same queue.
pub struct PBuf {
    buf: Option<wgpu::Buffer>,
    pub size: u64,
    pool: Arc<Mutex<Pool>>,
}

impl PBuf {
    pub fn buffer(&self) -> &wgpu::Buffer {
        self.buf.as_ref().expect("live buffer")
    }
}

impl Drop for PBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            if let Ok(mut p) = self.pool.lock() {
                p.free.entry(self.size).or_default().push(b);
            }
        }
    }
}

#[derive(Default)]
pub struct Pool {
    free: HashMap<u64, Vec<wgpu::Buffer>>,
    pub allocated_bytes: u64,
}

/// One storage binding: a buffer and a byte range of it.
#[derive(Clone, Copy)]
pub struct Bind<'a> {
    pub buf: &'a wgpu::Buffer,
    pub offset: u64,
    /// `None` = to the end of the buffer.
    pub size: Option<u64>,
}

impl<'a> Bind<'a> {
    pub fn all(buf: &'a wgpu::Buffer) -> Bind<'a> {
        Bind {
            buf,
            offset: 0,
            size: None,
        }
    }
}

impl<'a> From<&'a PBuf> for Bind<'a> {
    fn from(b: &'a PBuf) -> Bind<'a> {
        Bind::all(b.buffer())
    }
}

impl<'a> From<&'a wgpu::Buffer> for Bind<'a> {
    fn from(b: &'a wgpu::Buffer) -> Bind<'a> {
        Bind::all(b)
    }
}

struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    uniforms: Vec<u8>,
    arena: wgpu::Buffer,
    dispatches: usize,
}

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// SHADER_F16 is present: shaders with `enable f16;` may be used.
    pub has_f16: bool,
    pub has_subgroups: bool,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    pending: Mutex<Pending>,
    pool: Arc<Mutex<Pool>>,
    uniform_align: u64,
}

impl Gpu {
    /// Opens the first adapter (honouring `WGPU_BACKEND` / `WGPU_ADAPTER_NAME`), or says why
    /// there is none.
    pub fn new() -> Result<Gpu, BackendError> {
        let unavailable = |why: String| BackendError::Unavailable("wgpu".into(), why);
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        // GL (the only non-primary backend on Linux) has no f16 or subgroups and probing it
        // without a display prints errors; it is used only when asked for by WGPU_BACKEND.
        if std::env::var_os("WGPU_BACKEND").is_none() {
            desc.backends = wgpu::Backends::PRIMARY;
        }
        let instance = wgpu::Instance::new(desc);
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
            apply_limit_buckets: false,
        }))
        .map_err(|e| unavailable(format!("no GPU adapter found ({e})")))?;
        let info = adapter.get_info();
        let feats = adapter.features();
        let has_f16 = feats.contains(wgpu::Features::SHADER_F16);
        let has_subgroups = feats.contains(wgpu::Features::SUBGROUP);
        let mut required = wgpu::Features::empty();
        if has_f16 {
            required |= wgpu::Features::SHADER_F16;
        }
        if has_subgroups {
            required |= wgpu::Features::SUBGROUP;
        }
        let alimits = adapter.limits();
        // Ask for what the adapter has: the defaults cap storage bindings at 128 MiB and
        // buffers at 256 MiB, below what real weights need.
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: alimits.max_storage_buffer_binding_size,
            max_buffer_size: alimits.max_buffer_size,
            max_storage_buffers_per_shader_stage: alimits
                .max_storage_buffers_per_shader_stage
                .min(16),
            max_compute_workgroup_storage_size: alimits.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: alimits.max_compute_invocations_per_workgroup,
            max_compute_workgroup_size_x: alimits.max_compute_workgroup_size_x,
            max_compute_workgroups_per_dimension: alimits.max_compute_workgroups_per_dimension,
            ..wgpu::Limits::default()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("tern"),
            required_features: required,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| unavailable(format!("adapter {:?} refused a device ({e})", info.name)))?;
        let uniform_align = limits.min_uniform_buffer_offset_alignment as u64;
        let arena = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("uniform arena"),
            size: ARENA_BYTES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(Gpu {
            device,
            queue,
            info,
            limits,
            has_f16,
            has_subgroups,
            pipelines: Mutex::new(HashMap::new()),
            pending: Mutex::new(Pending {
                encoder: None,
                uniforms: Vec::new(),
                arena,
                dispatches: 0,
            }),
            pool: Arc::new(Mutex::new(Pool::default())),
            uniform_align,
        })
    }

    /// One line for start-up logs: adapter, driver, backend and the limits that shape kernels.
    pub fn describe(&self) -> String {
        format!(
            "wgpu adapter {:?} ({:?}, {:?}, driver {} {}), f16 {}, subgroups {}, max storage binding {} MiB, max buffer {} MiB, workgroup storage {} KiB",
            self.info.name,
            self.info.device_type,
            self.info.backend,
            self.info.driver,
            self.info.driver_info,
            self.has_f16,
            self.has_subgroups,
            self.limits.max_storage_buffer_binding_size >> 20,
            self.limits.max_buffer_size >> 20,
            self.limits.max_compute_workgroup_storage_size >> 10
        )
    }

    /// The compute pipeline for a WGSL source, compiled once and cached under `key`.
    /// `key` must name the source and any specialisation folded into it.
    pub fn pipeline(&self, key: &str, source: &str) -> Arc<wgpu::ComputePipeline> {
        if let Some(p) = self.pipelines.lock().unwrap().get(key) {
            return p.clone();
        }
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(key),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let p = Arc::new(
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(key),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                }),
        );
        self.pipelines
            .lock()
            .unwrap()
            .insert(key.to_string(), p.clone());
        p
    }

    /// A pooled storage buffer of at least `bytes` (rounded up to a power of two, min 256).
    pub fn alloc(&self, bytes: u64) -> PBuf {
        let size = bytes.max(256).next_power_of_two();
        let mut pool = self.pool.lock().unwrap();
        let buf = match pool.free.get_mut(&size).and_then(Vec::pop) {
            Some(b) => b,
            None => {
                pool.allocated_bytes += size;
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("tensor"),
                    size,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            }
        };
        PBuf {
            buf: Some(buf),
            size,
            pool: self.pool.clone(),
        }
    }

    /// Bytes held by the pool (in use or free), for the memory ledger.
    pub fn pooled_bytes(&self) -> u64 {
        self.pool.lock().unwrap().allocated_bytes
    }

    /// A new (unpooled) storage buffer holding `data`, padded to 4 bytes. Created mapped, so it
    /// is ordered before any dispatch recorded later and needs no queue write.
    pub fn upload(&self, label: &str, data: &[u8]) -> wgpu::Buffer {
        let size = (data.len() as u64).div_ceil(4).max(1) * 4;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: true,
        });
        buf.slice(..)
            .get_mapped_range_mut()
            .expect("mapped at creation")
            .slice(..data.len())
            .copy_from_slice(data);
        buf.unmap();
        buf
    }

    /// A pooled buffer filled with `data` (f32 activations from the host).
    pub fn upload_pooled(&self, data: &[u8]) -> PBuf {
        let staging = self.upload("staging", data);
        let out = self.alloc(data.len() as u64);
        self.copy(
            &staging,
            0,
            out.buffer(),
            0,
            (data.len() as u64).div_ceil(4) * 4,
        );
        out
    }

    fn with_encoder<R>(
        &self,
        f: impl FnOnce(&mut wgpu::CommandEncoder, &mut Vec<u8>, &wgpu::Buffer) -> R,
    ) -> R {
        let mut p = self.pending.lock().unwrap();
        let p = &mut *p;
        let enc = p.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("step"),
                })
        });
        f(enc, &mut p.uniforms, &p.arena)
    }

    pub fn copy(
        &self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        bytes: u64,
    ) {
        if bytes == 0 {
            return;
        }
        self.with_encoder(|enc, _, _| enc.copy_buffer_to_buffer(src, src_off, dst, dst_off, bytes));
    }

    /// Records one dispatch: `params` go to `@binding(0)` as a uniform, `binds` to bindings
    /// 1.. in order, all in `@group(0)`. Every binding the shader declares must be used by it
    /// (the layout is derived from the shader).
    pub fn dispatch(
        &self,
        pipeline: &wgpu::ComputePipeline,
        params: &[u8],
        binds: &[Bind<'_>],
        groups: [u32; 3],
    ) {
        let slot = (params.len().max(16) as u64).div_ceil(self.uniform_align) * self.uniform_align;
        {
            let used = self.pending.lock().unwrap().uniforms.len() as u64;
            if used + slot > ARENA_BYTES {
                self.flush();
            }
        }
        let max = self.limits.max_compute_workgroups_per_dimension;
        assert!(
            groups.iter().all(|&g| g <= max),
            "dispatch of {groups:?} workgroups exceeds {max} per dimension"
        );
        self.with_encoder(|enc, uniforms, arena| {
            let offset = uniforms.len() as u64;
            uniforms.extend_from_slice(params);
            uniforms.resize((offset + slot) as usize, 0);
            let layout = pipeline.get_bind_group_layout(0);
            let mut entries = Vec::with_capacity(binds.len() + 1);
            entries.push(wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: arena,
                    offset,
                    size: std::num::NonZeroU64::new(params.len().max(16) as u64),
                }),
            });
            for (i, b) in binds.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: b.buf,
                        offset: b.offset,
                        size: b.size.and_then(std::num::NonZeroU64::new),
                    }),
                });
            }
            let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &layout,
                entries: &entries,
            });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        });
        self.pending.lock().unwrap().dispatches += 1;
    }

    /// Submits everything recorded so far (uniforms first).
    pub fn flush(&self) {
        let mut p = self.pending.lock().unwrap();
        if let Some(enc) = p.encoder.take() {
            if !p.uniforms.is_empty() {
                self.queue.write_buffer(&p.arena, 0, &p.uniforms);
            }
            self.queue.submit(Some(enc.finish()));
        }
        p.uniforms.clear();
        p.dispatches = 0;
    }

    /// Copies `bytes` from `src` at `offset` back to the host, submitting pending work first.
    pub fn read(&self, src: &wgpu::Buffer, offset: u64, bytes: u64) -> Vec<u8> {
        let padded = bytes.div_ceil(4) * 4;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: padded.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.copy(src, offset, &staging, 0, padded);
        self.flush();
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .expect("device poll");
        rx.recv()
            .expect("map callback")
            .expect("map readback buffer");
        let out = staging.get_mapped_range(..).expect("mapped range")[..bytes as usize].to_vec();
        staging.unmap();
        out
    }

    pub fn read_f32(&self, src: &wgpu::Buffer, offset: u64, n: usize) -> Vec<f32> {
        let b = self.read(src, offset, n as u64 * 4);
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

/// Workgroup count for `n` items at `per_group` items each.
pub fn groups(n: usize, per_group: usize) -> u32 {
    n.div_ceil(per_group) as u32
}

/// Splits a 1-D dispatch of `n` workgroups over x and y so neither exceeds the 65,535 limit;
/// shaders recover the index as `gid.x + gid.y * nwg.x` (nwg = num_workgroups).
pub fn groups_2d(n: u32) -> [u32; 3] {
    if n <= 65535 {
        [n.max(1), 1, 1]
    } else {
        let y = n.div_ceil(65535);
        [n.div_ceil(y), y, 1]
    }
}
