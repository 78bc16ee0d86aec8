//! Gated attention over the KV cache, and argmax (being written).

use super::{Tensor, Weight, WgpuBackend};
use crate::backend::{AttnParams, BackendError, KvTypes};

pub struct Kv {
    pub len: usize,
}

pub fn new_kv(_be: &WgpuBackend, _p: &AttnParams, _types: KvTypes) -> Result<Kv, BackendError> {
    unimplemented!("wgpu kv")
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    _be: &WgpuBackend,
    _p: &AttnParams,
    _qg: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _q_norm: &Weight,
    _k_norm: &Weight,
    _kv: &mut Kv,
    _pos0: usize,
) -> Tensor {
    unimplemented!("wgpu attention")
}

pub fn argmax_rows(_be: &WgpuBackend, _x: &Tensor) -> Vec<u32> {
    unimplemented!("wgpu argmax")
}
