//! Embedding lookup and matmul for every weight dtype (being written).

use super::{Tensor, Weight, WgpuBackend};

pub fn embed(_be: &WgpuBackend, _table: &Weight, _ids: &[u32]) -> Tensor {
    unimplemented!("wgpu embed")
}

pub fn matmul(_be: &WgpuBackend, _w: &Weight, _x: &Tensor) -> Tensor {
    unimplemented!("wgpu matmul")
}
