//! Row-wise work: the softmax weights and their math, dropout, stored
//! elements and their widening, and the key addressing of caches and pages.

pub(super) mod dropout;
pub(super) mod elem;
pub(super) mod keys;
#[doc(hidden)] // public for the code `#[attention]` generates (`score` in f32)
pub mod math;
pub(crate) mod weights;
