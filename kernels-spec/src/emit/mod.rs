//! Stage 5, emit: one module per target, each lowering the validated
//! [`Program`](crate::ir::Program) to that target's text or tokens. Emitters
//! never see syn, and target-specific choices live in their own module.

pub mod cpu;
pub mod cuda;
pub mod wgsl;
