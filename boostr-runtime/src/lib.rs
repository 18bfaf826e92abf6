//! Fused attention kernels compiled from `#[attention]` variant declarations,
//! exposed as tensor ops and as one autograd op on numr's [`Var`](numr::autograd::Var).
#![doc = include_str!("../../README.md")]

extern crate self as boostr_runtime;

pub mod backend;
pub mod cpu;
mod error;
mod flash;
mod op;
mod problem;
pub mod stock;
pub mod testing;
mod validate;
mod variant;

pub use backend::AttentionRuntime;
pub use boostr_macros::attention;
pub use error::{Error, Result};
pub use flash::var_flash_attention;
pub use op::{AttentionOptions, attention_bwd, attention_fwd, var_attention};
pub use problem::Problem;
pub use variant::{CompiledStages, TileClass, Variant};

/// Generated per-variant tests on every backend compiled in; used by the code
/// that `#[attention(tests = [..])]` expands to.
#[doc(hidden)]
#[macro_export]
macro_rules! __backend_tests {
    ($($name:ident => $instance:expr,)*) => {
        mod cpu {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    $crate::testing::check_variant::<$crate::testing::Cpu, _>(&$instance);
                }
            )*
        }
    };
}
