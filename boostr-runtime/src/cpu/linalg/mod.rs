//! Products and instruction sets: the tile products (`gemm`, the AVX-512
//! `microkernel`), the decode's matrix-vector products (`gemv`, `gemv_i8`),
//! strided operands, and the run-time choice of instruction set (`simd`).

pub(super) mod gemm;
pub(super) mod gemv;
pub(super) mod gemv_i8;
#[cfg(target_arch = "x86_64")]
pub(super) mod microkernel;
pub(super) mod operand;
pub(super) mod simd;
