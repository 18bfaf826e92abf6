//! Test data for variants that capture tensors: what a `tests = [|data| ..]`
//! instance builds its tensors from, per case and per backend.

use super::rng::Rng;
use crate::problem::Problem;
use numr::autograd::Var;
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// Salt of the data's random stream, so that it is independent of the
/// case's `q, k, v, dout` (drawn from the same seed and stream).
const DATA_SALT: u64 = 0x6461_7461;

/// What a test instance of a tensor-carrying variant is built from: the
/// case's sizes, a device of the backend under test, and a random stream of
/// its own. The same seed and case give the same tensors on every backend,
/// so two backends can be compared on them.
///
/// ```
/// use boostr_runtime::testing::TestData;
/// use numr::runtime::cpu::{CpuDevice, CpuRuntime};
///
/// let device = CpuDevice::new();
/// let p = boostr_runtime::testing::CASES[1].problem();
/// let mut data = TestData::<CpuRuntime>::new(p, &device, 7, 1);
/// let ids = data.documents();
/// assert_eq!(ids.shape(), &[p.batch, p.seq_k]);
/// let ids: Vec<i32> = ids.to_vec();
/// assert!(ids[..p.seq_k].windows(2).all(|w| w[0] <= w[1]));
/// ```
pub struct TestData<'a, R: Runtime> {
    problem: Problem,
    device: &'a R::Device,
    stream: u64,
    rng: Rng,
}

impl<R: Runtime> std::fmt::Debug for TestData<'_, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestData")
            .field("problem", &self.problem)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl<'a, R: Runtime<DType = DType>> TestData<'a, R> {
    /// The data of case number `stream` of a run with `seed`, for problem
    /// `problem`, on `device`.
    pub fn new(problem: Problem, device: &'a R::Device, seed: u64, stream: u64) -> Self {
        TestData {
            problem,
            device,
            stream,
            rng: Rng::new(seed ^ DATA_SALT, stream),
        }
    }

    /// The case's sizes.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// Batch size `B`.
    pub fn batch(&self) -> usize {
        self.problem.batch
    }

    /// Query heads `Hq`.
    pub fn heads_q(&self) -> usize {
        self.problem.heads_q
    }

    /// Key/value heads `Hkv`.
    pub fn heads_kv(&self) -> usize {
        self.problem.heads_kv
    }

    /// Query length `Sq`.
    pub fn seq_q(&self) -> usize {
        self.problem.seq_q
    }

    /// Key length `Sk`.
    pub fn seq_k(&self) -> usize {
        self.problem.seq_k
    }

    /// The device the tensors go to.
    pub fn device(&self) -> &'a R::Device {
        self.device
    }

    /// A tensor of `shape` holding `values`.
    ///
    /// # Panics
    ///
    /// When `values` does not fill `shape` (a mistake in the test).
    pub fn tensor<T: numr::dtype::Element>(&self, values: &[T], shape: &[usize]) -> Tensor<R> {
        Tensor::<R>::from_slice(values, shape, self.device)
            .unwrap_or_else(|e| panic!("boostr: test data of shape {shape:?}: {e}"))
    }

    /// An integer uniform in `lo ..= hi`.
    fn int(&mut self, lo: i64, hi: i64) -> i64 {
        let span = (hi - lo + 1) as f64;
        lo + ((self.rng.uniform() * span).ceil() as i64 - 1).clamp(0, hi - lo)
    }

    /// Sorted document ids of `n` positions, from 0: documents of random
    /// lengths, about a quarter of them of length 1, and at least one of
    /// length 1 when `n ≥ 2`.
    fn sorted_ids(&mut self, n: usize) -> Vec<i32> {
        let longest = (n as i64 / 3).max(1);
        let mut ids = Vec::with_capacity(n);
        let (mut id, mut singles) = (0, 0);
        while ids.len() < n {
            let len = if self.rng.uniform() < 0.25 {
                1
            } else {
                self.int(1, longest) as usize
            };
            let len = len.min(n - ids.len());
            singles += usize::from(len == 1);
            ids.extend(std::iter::repeat_n(id, len));
            id += 1;
        }
        if singles == 0 && n >= 2 {
            // The last position becomes a document of its own.
            ids[n - 1] = id;
        }
        ids
    }

    /// Document ids of packed sequences, `[B, Sk]` `i32`: per batch, sorted
    /// ids from 0 of documents of random lengths (some of length 1).
    pub fn documents(&mut self) -> Tensor<R> {
        let (b, sk) = (self.problem.batch, self.problem.seq_k);
        let ids: Vec<i32> = (0..b).flat_map(|_| self.sorted_ids(sk)).collect();
        self.tensor(&ids, &[b, sk])
    }

    /// Document ids of unsorted positions, `[B, Sk]` `i32` in `0 .. 4`
    /// (a mask over them is still sound to classify, only never exact).
    pub fn unsorted_documents(&mut self) -> Tensor<R> {
        let (b, sk) = (self.problem.batch, self.problem.seq_k);
        let ids: Vec<i32> = (0..b * sk).map(|_| self.int(0, 3) as i32).collect();
        self.tensor(&ids, &[b, sk])
    }

    /// A random draft tree over the last `min(Sq, Sk)` positions of every
    /// sequence (each draft's parent an earlier draft, or the prefix with
    /// probability 1/4), as [`DraftTree`](crate::stock::DraftTree)'s
    /// intervals.
    pub fn draft_tree(&mut self) -> crate::stock::DraftTree<R> {
        let (b, sq, sk) = (self.problem.batch, self.problem.seq_q, self.problem.seq_k);
        let n = sq.min(sk);
        let parents: Vec<i32> = (0..b * n)
            .map(|at| match at % n {
                0 => -1,
                _ if self.rng.uniform() < 0.25 => -1,
                i => self.int(0, i as i64 - 1) as i32,
            })
            .collect();
        let parents = self.tensor(&parents, &[b, n]);
        let lengths = self.tensor(&vec![sk as i32; b], &[b]);
        crate::stock::DraftTree::from_parents(&parents, &lengths, sk)
            .expect("a random tree is a tree")
    }

    /// Per-sequence key lengths, `[B]` `i32` in `0 ..= Sk`. Batch `b` of
    /// case number `n` gets 0 when `(n + b) % 4 == 0`, `Sk` when it is 1,
    /// else a length drawn in `1 .. Sk`: over the standard cases both ends
    /// occur for every shape of batch.
    pub fn lengths(&mut self) -> Tensor<R> {
        let sk = self.problem.seq_k as i64;
        let lens: Vec<i32> = (0..self.problem.batch)
            .map(|b| match (self.stream + b as u64) % 4 {
                0 => 0,
                1 => sk as i32,
                _ => self.int(1.min(sk - 1).max(0), (sk - 1).max(0)) as i32,
            })
            .collect();
        self.tensor(&lens, &[self.problem.batch])
    }

    /// An `f32` tensor of `shape`, uniform in `[lo, hi]`.
    pub fn f32s(&mut self, shape: &[usize], lo: f32, hi: f32) -> Tensor<R> {
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| lo + (hi - lo) * self.rng.uniform() as f32)
            .collect();
        self.tensor(&values, shape)
    }

    /// A learnable `f32` tensor of `shape`, uniform in `[lo, hi]`: a `Var`
    /// that requires grad.
    pub fn learnable(&mut self, shape: &[usize], lo: f32, hi: f32) -> Var<R> {
        let t = self.f32s(shape, lo, hi);
        Var::new(t, true)
    }

    /// A `bool` tensor (numr's `DType::Bool`) of `shape`, each element
    /// true with probability `p_true`.
    pub fn bools(&mut self, shape: &[usize], p_true: f64) -> Tensor<R>
    where
        R: Runtime<DType = numr::dtype::DType>,
    {
        let n = shape.iter().product();
        let bytes: Vec<u8> = (0..n)
            .map(|_| u8::from(self.rng.uniform() < p_true))
            .collect();
        Tensor::<R>::from_bytes(&bytes, shape, numr::dtype::DType::Bool, self.device)
            .unwrap_or_else(|e| panic!("boostr: test data of shape {shape:?}: {e}"))
    }

    /// An `i64` tensor of `shape`, uniform in `lo ..= hi`.
    pub fn i64s(&mut self, shape: &[usize], lo: i64, hi: i64) -> Tensor<R> {
        let n = shape.iter().product();
        let values: Vec<i64> = (0..n).map(|_| self.int(lo, hi)).collect();
        self.tensor(&values, shape)
    }

    /// An `i32` tensor of `shape`, uniform in `lo ..= hi`.
    pub fn i32s(&mut self, shape: &[usize], lo: i32, hi: i32) -> Tensor<R> {
        let n = shape.iter().product();
        let values: Vec<i32> = (0..n)
            .map(|_| self.int(i64::from(lo), i64::from(hi)) as i32)
            .collect();
        self.tensor(&values, shape)
    }
}

/// Build an instance from `data` with `build`: how the code `tests = [|data|
/// ..]` generates calls a closure instance, so that the closure's argument
/// type is known while its body is checked.
#[doc(hidden)]
pub fn build<R: Runtime, V>(
    data: &mut TestData<'_, R>,
    build: impl FnOnce(&mut TestData<'_, R>) -> V,
) -> V {
    build(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use numr::runtime::cpu::{CpuDevice, CpuRuntime};

    fn data(p: Problem, stream: u64, device: &CpuDevice) -> TestData<'_, CpuRuntime> {
        TestData::new(p, device, 11, stream)
    }

    #[test]
    fn documents_are_sorted_and_have_single_positions() {
        let device = CpuDevice::new();
        for (n, case) in super::super::CASES.iter().enumerate() {
            let p = case.problem();
            let ids: Vec<i32> = data(p, n as u64, &device).documents().to_vec();
            for row in ids.chunks(p.seq_k) {
                assert_eq!(row[0], 0);
                assert!(row.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1));
                let single = (0..row.len()).any(|i| {
                    (i == 0 || row[i - 1] != row[i]) && (i + 1 == row.len() || row[i + 1] != row[i])
                });
                assert!(single || row.len() == 1, "{row:?}");
            }
        }
    }

    #[test]
    fn lengths_cover_both_ends_over_the_cases() {
        let device = CpuDevice::new();
        let (mut zero, mut full) = (false, false);
        for (n, case) in super::super::CASES.iter().enumerate() {
            let p = case.problem();
            let lens: Vec<i32> = data(p, n as u64, &device).lengths().to_vec();
            assert_eq!(lens.len(), p.batch);
            for &l in &lens {
                assert!((0..=p.seq_k as i32).contains(&l), "{l} of {}", p.seq_k);
                zero |= l == 0;
                full |= l == p.seq_k as i32 && p.seq_k > 1;
            }
        }
        assert!(zero && full);
    }

    #[test]
    fn the_same_seed_gives_the_same_data() {
        let device = CpuDevice::new();
        let p = super::super::CASES[3].problem();
        let a: Vec<f32> = data(p, 3, &device).f32s(&[4, 5], -1.0, 1.0).to_vec();
        let b: Vec<f32> = data(p, 3, &device).f32s(&[4, 5], -1.0, 1.0).to_vec();
        let c: Vec<f32> = data(p, 4, &device).f32s(&[4, 5], -1.0, 1.0).to_vec();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|x| (-1.0..=1.0).contains(x)));
        let ints: Vec<i32> = data(p, 3, &device).i32s(&[1000], -2, 2).to_vec();
        for v in -2..=2 {
            assert!(ints.contains(&v));
        }
        assert!(ints.iter().all(|x| (-2..=2).contains(x)));
    }
}
