//! The wgpu device: a cache of compute pipelines (one per [`Kernel`]) and of bind groups,
//! the uniform arena, and the pending command encoder that every launch records into.
//!
//! Launches never wait: they record a dispatch into the pending encoder. The encoder is
//! submitted only when the host needs data (`read`) or when the uniform arena fills up, so
//! one decode step is one command buffer and the only readback is what the caller asks for.
//!
//! Each kernel's scalars go to a slot of the uniform arena, bound at `@binding(0)` with a
//! dynamic offset, so a bind group depends only on the storage buffers a launch binds: the
//! pooled activation buffers, weights and caches recur step after step, and their bind groups
//! are built once and reused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::shaders;
use crate::backend::gpu::{AllocRule, Caps, Device, Grid, Kernel, Scalar, View};
use crate::backend::BackendError;

/// Bytes of uniforms one submission can carry; each dispatch takes one aligned slot.
const ARENA_BYTES: u64 = 1 << 20;
/// Bind groups kept before the cache starts over (each holds its buffers alive).
const MAX_BIND_GROUPS: usize = 4096;

/// A compiled kernel and the layout its bind groups are made with.
struct Pipeline {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    /// Bytes of the kernel's uniform block as bound (its `Params` struct).
    params_bytes: u64,
}

/// The storage bindings of a launch: what its cached bind group was made from.
#[derive(Clone, PartialEq, Eq, Hash)]
struct BindKey {
    kernel: Kernel,
    bufs: Vec<(wgpu::Buffer, u64, u64)>,
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
    caps: Caps,
    pipelines: Mutex<HashMap<Kernel, Arc<Pipeline>>>,
    bind_groups: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    pending: Mutex<Pending>,
    uniform_align: u64,
}

/// The bind group layout a shader declares, read from its source: the uniform at binding 0
/// with a dynamic offset, then each storage binding read-only or read-write as declared.
fn layout_of(device: &wgpu::Device, kernel: Kernel, source: &str) -> (wgpu::BindGroupLayout, u64) {
    let module = naga::front::wgsl::parse_str(source)
        .unwrap_or_else(|e| panic!("{kernel}: {}", e.emit_to_string(source)));
    let mut entries = Vec::new();
    let mut params_bytes = 16;
    for (_, var) in module.global_variables.iter() {
        let Some(b) = &var.binding else { continue };
        assert_eq!(b.group, 0, "{kernel}: every binding is in group 0");
        let ty = match var.space {
            naga::AddressSpace::Uniform => {
                params_bytes = u64::from(module.types[var.ty].inner.size(module.to_ctx()));
                wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: None,
                }
            }
            naga::AddressSpace::Storage { access } => wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage {
                    read_only: !access.contains(naga::StorageAccess::STORE),
                },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            other => panic!("{kernel}: binding {} in address space {other:?}", b.binding),
        };
        entries.push(wgpu::BindGroupLayoutEntry {
            binding: b.binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty,
            count: None,
        });
    }
    entries.sort_by_key(|e| e.binding);
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("tern kernel"),
        entries: &entries,
    });
    (layout, params_bytes.max(16))
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
            max_dynamic_uniform_buffers_per_pipeline_layout: alimits
                .max_dynamic_uniform_buffers_per_pipeline_layout
                .max(1),
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
        let caps = Caps {
            max_binding: limits
                .max_storage_buffer_binding_size
                .min(limits.max_buffer_size),
            shared_bytes: limits.max_compute_workgroup_storage_size,
            native_f16: has_f16,
        };
        Ok(Gpu {
            device,
            queue,
            info,
            limits,
            has_f16,
            has_subgroups,
            caps,
            pipelines: Mutex::new(HashMap::new()),
            bind_groups: Mutex::new(HashMap::new()),
            pending: Mutex::new(Pending {
                encoder: None,
                uniforms: Vec::new(),
                arena,
                dispatches: 0,
            }),
            uniform_align,
        })
    }

    /// The pipeline of `kernel`, compiled the first time.
    fn pipeline(&self, kernel: Kernel) -> Arc<Pipeline> {
        if let Some(p) = self.pipelines.lock().unwrap().get(&kernel) {
            return p.clone();
        }
        let source = shaders::source(kernel, self.has_subgroups);
        let label = kernel.to_string();
        let (layout, params_bytes) = layout_of(&self.device, kernel, &source);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(&label),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let pl = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(&label),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&label),
                layout: Some(&pl),
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        let p = Arc::new(Pipeline {
            pipeline,
            layout,
            params_bytes,
        });
        self.pipelines.lock().unwrap().insert(kernel, p.clone());
        p
    }

    /// The bind group of a launch's storage buffers, made the first time they are bound
    /// together to this kernel.
    fn bind_group(
        &self,
        kernel: Kernel,
        p: &Pipeline,
        arena: &wgpu::Buffer,
        bufs: &[View<'_, wgpu::Buffer>],
    ) -> wgpu::BindGroup {
        let key = BindKey {
            kernel,
            bufs: bufs
                .iter()
                .map(|v| (v.mem.clone(), v.offset, v.len))
                .collect(),
        };
        let mut cache = self.bind_groups.lock().unwrap();
        if let Some(bg) = cache.get(&key) {
            return bg.clone();
        }
        let mut entries = Vec::with_capacity(bufs.len() + 1);
        entries.push(wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: arena,
                offset: 0,
                size: std::num::NonZeroU64::new(p.params_bytes),
            }),
        });
        for (i, v) in bufs.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: v.mem,
                    offset: v.offset,
                    size: std::num::NonZeroU64::new(v.len.min(v.mem.size() - v.offset)),
                }),
            });
        }
        let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &p.layout,
            entries: &entries,
        });
        if cache.len() >= MAX_BIND_GROUPS {
            cache.clear();
        }
        cache.insert(key, bg.clone());
        bg
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

    /// A new storage buffer holding `data`, padded to 4 bytes. Created mapped, so it is
    /// ordered before any dispatch recorded later and needs no queue write.
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
}

/// Splits `n` workgroups over x and y so neither exceeds the 65,535 limit; shaders recover the
/// index as `wid.x + wid.y * nwg.x` (nwg = num_workgroups).
pub fn groups_2d(n: u32) -> [u32; 3] {
    if n <= 65535 {
        [n.max(1), 1, 1]
    } else {
        let y = n.div_ceil(65535);
        [n.div_ceil(y), y, 1]
    }
}

impl Device for Gpu {
    type Mem = wgpu::Buffer;
    const NAME: &'static str = "wgpu";

    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn alloc_rule(&self) -> AllocRule {
        AllocRule {
            binding_limit: self.caps.max_binding,
            pad_to_word: true,
        }
    }

    /// One line for start-up logs: adapter, driver, backend and the limits that shape kernels.
    fn describe(&self) -> String {
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

    fn alloc(&self, bytes: u64) -> Result<wgpu::Buffer, BackendError> {
        if bytes > self.limits.max_buffer_size {
            return Err(BackendError::BadWeight {
                name: "device memory".into(),
                what: format!(
                    "a buffer of {bytes} bytes exceeds the adapter's {} byte limit",
                    self.limits.max_buffer_size
                ),
            });
        }
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("tern"),
            size: bytes.div_ceil(4).max(1) * 4,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    fn upload_new(&self, data: &[u8]) -> Result<wgpu::Buffer, BackendError> {
        if data.len() as u64 > self.limits.max_buffer_size {
            return Err(BackendError::BadWeight {
                name: "device memory".into(),
                what: format!(
                    "{} bytes exceed the adapter's {} byte buffer limit",
                    data.len(),
                    self.limits.max_buffer_size
                ),
            });
        }
        Ok(self.upload("tern", data))
    }

    fn write(&self, dst: &wgpu::Buffer, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        // Through a mapped staging buffer and a copy recorded in the encoder: a queue write
        // would land before dispatches already recorded that still read `dst`'s old contents.
        let staging = self.upload("staging", data);
        self.copy(&staging, 0, dst, 0, (data.len() as u64).div_ceil(4) * 4);
    }

    fn zero(&self, dst: &wgpu::Buffer) {
        self.with_encoder(|enc, _, _| enc.clear_buffer(dst, 0, None));
    }

    fn size(&self, mem: &wgpu::Buffer) -> u64 {
        mem.size()
    }

    fn copy(&self, src: &wgpu::Buffer, src_off: u64, dst: &wgpu::Buffer, dst_off: u64, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.with_encoder(|enc, _, _| enc.copy_buffer_to_buffer(src, src_off, dst, dst_off, bytes));
    }

    /// Copies `bytes` from `src` at `offset` back to the host, submitting pending work first.
    fn read(&self, src: &wgpu::Buffer, offset: u64, bytes: u64) -> Vec<u8> {
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

    /// Records one dispatch: the scalars go to a slot of the uniform arena (`@binding(0)`),
    /// the buffers to bindings 1.. in order.
    fn launch(
        &self,
        kernel: Kernel,
        grid: Grid,
        bufs: &[View<'_, wgpu::Buffer>],
        scalars: &[Scalar],
    ) {
        let groups = match grid {
            Grid::Linear(0) => return,
            Grid::Linear(n) => groups_2d(
                u32::try_from(n).unwrap_or_else(|_| panic!("{kernel}: {n} workgroups exceed u32")),
            ),
            Grid::Dims(d) => {
                if d.contains(&0) {
                    return;
                }
                d
            }
        };
        let max = self.limits.max_compute_workgroups_per_dimension;
        assert!(
            groups.iter().all(|&g| g <= max),
            "{kernel}: dispatch of {groups:?} workgroups exceeds {max} per dimension"
        );
        let p = self.pipeline(kernel);
        let mut words: Vec<u32> = scalars.iter().map(|s| s.bits()).collect();
        words.resize((p.params_bytes / 4) as usize, 0);
        let params: &[u8] = bytemuck::cast_slice(&words);
        let slot = (params.len() as u64).div_ceil(self.uniform_align) * self.uniform_align;
        {
            let used = self.pending.lock().unwrap().uniforms.len() as u64;
            if used + slot > ARENA_BYTES {
                self.flush();
            }
        }
        self.with_encoder(|enc, uniforms, arena| {
            let offset = uniforms.len() as u64;
            uniforms.extend_from_slice(params);
            uniforms.resize((offset + slot) as usize, 0);
            let bg = self.bind_group(kernel, &p, arena, bufs);
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            pass.set_pipeline(&p.pipeline);
            pass.set_bind_group(0, &bg, &[offset as u32]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        });
        self.pending.lock().unwrap().dispatches += 1;
    }

    fn forget_bindings(&self) {
        self.bind_groups.lock().unwrap().clear();
    }
}
