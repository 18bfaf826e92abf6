//! bf16 tile products: AMX tiles (`tdpbf16ps`) and AVX512-BF16 (`vdpbf16ps`),
//! and the bf16 forward and backward built on them.

pub(super) mod amx;
pub(super) mod amx_backward;
pub(super) mod amx_forward;
pub(super) mod bf16_dot;
