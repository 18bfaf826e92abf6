//! The kernels: the tile forward and backward, the learnable tensors'
//! gradients, the decode kernel, and the tile sizes and bands they share.

pub(super) mod backward;
pub(super) mod decode;
pub(super) mod forward;
pub(super) mod grads;
pub(super) mod tile;
