//! `var_flash_attention`: the original boostr entry point, with its signature,
//! as one stock variant ([`FlashMask`]).

use crate::backend::AttentionRuntime;
use crate::error::{Error, Result};
use crate::keys::Keys;
use crate::op::var_attention;
use crate::options::AttentionOptions;
use crate::stock::FlashMask;
use numr::autograd::Var;

/// Flash attention with autograd: `q [B, num_heads, Sq, head_dim]`,
/// `k, v [B, num_kv_heads, Sk, head_dim]`, scale `1/sqrt(head_dim)`.
///
/// `causal` hides keys after the query (bottom-right aligned positions);
/// `window_size > 0` hides keys with `q_idx - kv_idx >= window_size`. The
/// explicit sizes must agree with the tensors' shapes.
#[allow(clippy::too_many_arguments)]
pub fn var_flash_attention<R: AttentionRuntime>(
    q: &Var<R>,
    k: &Var<R>,
    v: &Var<R>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    causal: bool,
    window_size: usize,
) -> Result<Var<R>> {
    let problem = crate::validate::problem(q.tensor(), k.tensor(), v.tensor(), None)?;
    for (name, given, actual) in [
        ("num_heads", num_heads, problem.heads_q),
        ("num_kv_heads", num_kv_heads, problem.heads_kv),
        ("head_dim", head_dim, problem.head_dim),
    ] {
        if given != actual {
            return Err(Error::Argument {
                name,
                given,
                actual,
            });
        }
    }
    // A window longer than any sequence hides nothing; i32::MAX stands for it.
    let window = i32::try_from(window_size).unwrap_or(i32::MAX);
    let variant = FlashMask { causal, window };
    let y = var_attention(&variant, q, Keys::dense(k, v), &AttentionOptions::default())?;
    Ok(y.out)
}
