//! The integration tests, as one test binary: each file below is a module.
//! One binary links the runtime once and instantiates each variant's
//! kernels once for all of them.

mod cuda_append;
mod cuda_compile;
mod dtypes;
mod errors;
mod fixtures;
mod key_sources;
mod kv_cache;
mod layouts;
mod learnable;
mod snapshots;
mod tool_cache;
mod variants;
mod wgsl_validate;
