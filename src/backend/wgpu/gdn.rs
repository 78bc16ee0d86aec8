//! Gated DeltaNet on the device (being written).

use super::{Tensor, Weight, WgpuBackend};
use crate::backend::{GdnParams, GdnWeights};

pub struct Recurrent {}

pub fn new_recurrent(_be: &WgpuBackend, _p: &GdnParams) -> Recurrent {
    unimplemented!("wgpu recurrent state")
}

pub fn recurrent_copy(_be: &WgpuBackend, _from: &Recurrent, _to: &mut Recurrent) {
    unimplemented!("wgpu recurrent copy")
}

#[allow(clippy::too_many_arguments)]
pub fn gdn(
    _be: &WgpuBackend,
    _p: &GdnParams,
    _mixed: &Tensor,
    _z: &Tensor,
    _b: &Tensor,
    _a: &Tensor,
    _w: &GdnWeights<'_, Weight>,
    _state: &mut Recurrent,
) -> Tensor {
    unimplemented!("wgpu gdn")
}
