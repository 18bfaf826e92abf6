//! Learnable tensors: gradients from several read sites (through `let`, in
//! `score` and in `sink`) against the reference on every backend, and
//! deterministic tensor gradients on the CPU for any thread count.

use boostr_runtime::stock::{CausalSlidingWindowSinks, CausalT5Bias};
use boostr_runtime::testing::{CpuRuntime, TestData};
use boostr_runtime::{
    AttentionGrads, AttentionOptions, Backward, Keys, Problem, attention, attention_backward,
    var_attention,
};
use numr::autograd::Var;
use numr::runtime::Runtime;
use numr::runtime::cpu::CpuDevice;
use numr::tensor::Tensor;

/// One table read at three sites of `score` (one through a `let`, two of
/// them landing on the same elements for `q == kv`), a gain read at a
/// fourth, and the sink reading the table again next to its own tensor.
#[attention(
    score = |s, _b, h, q, kv| {
        let row = self.table[h][q % 5];
        s * self.gain[h] + row - 0.5 * self.table[h][kv % 5] + self.table[h][(q + kv) % 5]
    },
    mask = |_b, _h, q, kv| kv <= q,
    sink = |_b, h, q| self.sinks[h] + self.table[h][q % 5],
    tests = [|data| ManyReads {
        table: data.learnable(&[data.heads_q(), 5], -1.0, 1.0),
        gain: data.learnable(&[data.heads_q()], 0.5, 1.5),
        sinks: data.learnable(&[data.heads_q()], -1.0, 1.0),
    }],
)]
#[derive(Clone, Debug)]
pub struct ManyReads<R: Runtime> {
    #[tensor(f32, [Hq, 5])]
    pub table: Var<R>,
    #[tensor(f32, [Hq])]
    pub gain: Var<R>,
    #[tensor(f32, [Hq])]
    pub sinks: Var<R>,
}

/// A learnable tensor next to a read-only one and a scalar: only the `Var`
/// has a gradient slot.
#[attention(
    score = |s, b, h, _q, _kv| s + self.offset[b] * self.scale[h] * self.k,
    tests = [|data| Mixed {
        offset: data.f32s(&[data.batch()], -1.0, 1.0),
        scale: data.learnable(&[data.heads_q()], -1.0, 1.0),
        k: 0.75,
    }],
)]
#[derive(Clone, Debug)]
pub struct Mixed<R: Runtime> {
    #[tensor(f32, [B])]
    pub offset: Tensor<R>,
    #[tensor(f32, [Hq])]
    pub scale: Var<R>,
    pub k: f32,
}

#[test]
fn only_vars_are_learnable() {
    use boostr_runtime::Variant;
    assert_eq!(<Mixed<CpuRuntime> as Variant>::LEARNABLE, &[1]);
    assert_eq!(<ManyReads<CpuRuntime> as Variant>::LEARNABLE, &[0, 1, 2]);
}

#[test]
fn relative_position_reads_go_by_diagonal() {
    use boostr_runtime::stock::{AlibiSlopes, T5Bias};
    use boostr_runtime::{HostVariant, Variant};
    fn by_difference<V: Variant>() -> bool {
        <V::Host as HostVariant>::SCORE_GRADS_BY_DIFFERENCE
    }
    assert!(by_difference::<T5Bias<CpuRuntime>>());
    assert!(by_difference::<CausalT5Bias<CpuRuntime>>());
    assert!(by_difference::<AlibiSlopes<CpuRuntime>>());
    // No position at all.
    assert!(by_difference::<Mixed<CpuRuntime>>());
    // A read at `q % 5` alone, and a derivative that is the logit.
    assert!(!by_difference::<ManyReads<CpuRuntime>>());
}

fn bits(t: &Tensor<CpuRuntime>) -> Vec<u32> {
    t.to_vec::<f32>().into_iter().map(f32::to_bits).collect()
}

/// Every gradient of one backward, as bits.
fn grads_bits(g: &AttentionGrads<CpuRuntime>) -> Vec<Vec<u32>> {
    let mut out = vec![bits(&g.dq), bits(&g.dk), bits(&g.dv)];
    out.extend(
        g.tensors
            .iter()
            .map(|t| bits(t.as_ref().expect("asked for"))),
    );
    out
}

/// Forward and backward of a causal T5 bias with a learnable table on
/// `threads` rayon threads.
fn t5_backward(threads: usize, p: Problem, seed: u64) -> Vec<Vec<u32>> {
    let device = CpuDevice::new();
    let mut data = TestData::<CpuRuntime>::new(p, &device, seed, 0);
    let variant = CausalT5Bias {
        buckets: data.learnable(&[p.heads_q, 32], -1.0, 1.0),
    };
    let q = data.f32s(&[p.batch, p.heads_q, p.seq_q, p.head_dim], -1.0, 1.0);
    let k = data.f32s(&[p.batch, p.heads_kv, p.seq_k, p.head_dim], -1.0, 1.0);
    let v = data.f32s(&[p.batch, p.heads_kv, p.seq_k, p.head_dim], -1.0, 1.0);
    let dout = data.f32s(&[p.batch, p.heads_q, p.seq_q, p.head_dim], -1.0, 1.0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool");
    pool.install(|| {
        let opts = AttentionOptions::default();
        let (out, lse) = attention(&variant, &q, Keys::dense(&k, &v), &opts)
            .map(|y| (y.out, y.lse))
            .expect("forward");
        let g = attention_backward(
            &variant,
            &q,
            Keys::dense(&k, &v),
            Backward::from_tensors(&out, &lse, &dout),
            &opts,
        )
        .expect("backward");
        grads_bits(&g)
    })
}

#[test]
fn tensor_gradients_have_the_same_bits_for_any_thread_count() {
    // Several key chunks per head and more tasks than threads.
    let p = Problem::new(1, (4, 2), (333, 517), 64).with_scale(0.125);
    let seed = 0x5eed;
    let one = t5_backward(1, p, seed);
    assert!(
        one[3].iter().any(|&b| f32::from_bits(b) != 0.0),
        "a gradient at all"
    );
    for threads in [1, 2, 3] {
        for run in 0..2 {
            assert!(
                t5_backward(threads, p, seed) == one,
                "{threads} threads, run {run}: gradients differ from 1 thread's"
            );
        }
    }
}

/// Forward and backward of gpt-oss sinks on `threads` rayon threads: the
/// sinks' gradient, as bits.
fn sinks_backward(threads: usize, p: Problem, seed: u64) -> Vec<u32> {
    let device = CpuDevice::new();
    let mut data = TestData::<CpuRuntime>::new(p, &device, seed, 0);
    let variant = CausalSlidingWindowSinks {
        window: 40,
        sinks: data.learnable(&[p.heads_q], -2.0, 2.0),
    };
    let q = data.f32s(&[p.batch, p.heads_q, p.seq_q, p.head_dim], -1.0, 1.0);
    let k = data.f32s(&[p.batch, p.heads_kv, p.seq_k, p.head_dim], -1.0, 1.0);
    let v = data.f32s(&[p.batch, p.heads_kv, p.seq_k, p.head_dim], -1.0, 1.0);
    let dout = data.f32s(&[p.batch, p.heads_q, p.seq_q, p.head_dim], -1.0, 1.0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool");
    pool.install(|| {
        let opts = AttentionOptions::default();
        let (out, lse) = attention(&variant, &q, Keys::dense(&k, &v), &opts)
            .map(|y| (y.out, y.lse))
            .expect("forward");
        let g = attention_backward(
            &variant,
            &q,
            Keys::dense(&k, &v),
            Backward::from_tensors(&out, &lse, &dout),
            &opts,
        )
        .expect("backward");
        bits(g.tensors[0].as_ref().expect("asked for"))
    })
}

#[test]
fn sink_gradients_have_the_same_bits_for_any_thread_count() {
    let p = Problem::new(2, (4, 1), (301, 389), 32).with_scale(0.2);
    let one = sinks_backward(1, p, 0x51);
    assert!(
        one.iter().any(|&b| f32::from_bits(b) != 0.0),
        "a gradient at all"
    );
    for threads in [1, 2, 3] {
        assert!(
            sinks_backward(threads, p, 0x51) == one,
            "{threads} threads: the sinks' gradient differs from 1 thread's"
        );
    }
}

#[test]
fn a_var_that_requires_no_grad_is_read_only() {
    let device = CpuDevice::new();
    let p = Problem::new(1, (2, 1), (9, 9), 8).with_scale(0.35);
    let mut data = TestData::<CpuRuntime>::new(p, &device, 3, 0);
    let table = data.f32s(&[2, 32], -1.0, 1.0);
    let variant = CausalT5Bias {
        buckets: Var::new(table, false),
    };
    let q = Var::new(data.f32s(&[1, 2, 9, 8], -1.0, 1.0), false);
    let k = Var::new(data.f32s(&[1, 1, 9, 8], -1.0, 1.0), false);
    let v = Var::new(data.f32s(&[1, 1, 9, 8], -1.0, 1.0), false);
    let out = var_attention(
        &variant,
        &q,
        Keys::dense(&k, &v),
        &AttentionOptions::default(),
    )
    .map(|y| y.out)
    .expect("forward");
    assert!(out.grad_fn().is_none(), "no graph node without grads");
}
