//! Errors of the attention ops. Every variant names the rule that was broken
//! and the values that broke it.

use kernels_spec::emit::{Target, TilingError};
use numr::dtype::DType;

/// Result of a boostr attention call.
pub type Result<T> = std::result::Result<T, Error>;

/// Why an attention call was refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor's rank is not its layout's.
    #[error("{name} must have rank {rank} {layout}, got shape {shape:?}")]
    Rank {
        /// Which tensor.
        name: &'static str,
        /// The rank it must have.
        rank: usize,
        /// The layout of its dimensions.
        layout: &'static str,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A dimension is zero.
    #[error(
        "{name} has a zero-size dimension: shape {shape:?}; every dimension must be at least 1"
    )]
    ZeroSize {
        /// Which tensor.
        name: &'static str,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// Shapes of the inputs disagree.
    #[error("shape mismatch: {rule} (q {q:?}, k {k:?}, v {v:?})")]
    Shapes {
        /// The rule that does not hold.
        rule: &'static str,
        /// Shape of q.
        q: Vec<usize>,
        /// Shape of k.
        k: Vec<usize>,
        /// Shape of v.
        v: Vec<usize>,
    },
    /// A tensor that must match another's shape does not.
    #[error("{name} must have shape {expected:?}, got {got:?}")]
    ShapeOf {
        /// Which tensor.
        name: &'static str,
        /// The shape it must have.
        expected: Vec<usize>,
        /// The shape it has.
        got: Vec<usize>,
    },
    /// A view whose elements are not all inside its storage (a tensor
    /// built from raw parts, such as V as a view of K's storage with a
    /// shape or offset that runs off its end).
    #[error(
        "{name} is a view (shape {shape:?}, strides {strides:?}, offset {offset}) that reaches \
         element {reach} of a storage of {storage} elements; a view must lie inside its storage"
    )]
    ViewPastStorage {
        /// Which tensor.
        name: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// Its strides, in elements.
        strides: Vec<isize>,
        /// Its first element's offset in the storage.
        offset: usize,
        /// The farthest element it reaches (or -1 below the start).
        reach: i64,
        /// Elements in the storage.
        storage: usize,
    },
    /// An fp8 KV cache's scales break a rule: missing for fp8 keys, given
    /// for others, of the wrong dtype, shape or layout, or not positive
    /// and finite.
    #[error("kv cache scales: {rule}; got {got}")]
    CacheScales {
        /// The rule broken.
        rule: &'static str,
        /// What was given.
        got: String,
    },
    /// A write of new keys and values into a cache breaks a rule: a full
    /// cache, a slot out of range or written twice, new rows that do not
    /// match the cache.
    #[error("kv cache write: {rule}; got {got}")]
    CacheWrite {
        /// The rule broken.
        rule: &'static str,
        /// What was given.
        got: String,
    },
    /// A draft tree ([`DraftTree`](crate::stock::DraftTree)) breaks a
    /// rule: a parent after its child, a mask that is no tree, drafts
    /// longer than their sequence.
    #[error("draft tree: {rule}; got {got}")]
    DraftTree {
        /// The rule broken.
        rule: &'static str,
        /// What was given.
        got: String,
    },
    /// A per-sequence length or offset (a cache's or padded batch's
    /// lengths, `cu_seqlens`) breaks its rule.
    #[error("{name}[{at}] = {value}; {rule} {bound}")]
    Lengths {
        /// The tensor (`lengths`, `q_lengths`, `cu_seqlens_k`, ...).
        name: &'static str,
        /// The rule, which the bound completes.
        rule: &'static str,
        /// The entry.
        at: usize,
        /// Its value.
        value: i64,
        /// The bound the rule names.
        bound: usize,
    },
    /// An index tensor (lengths, a page table, `cu_seqlens`) is not `i32`.
    #[error("{name} must have dtype I32, got {got:?}")]
    CacheIndexDType {
        /// `lengths` or `page_table`.
        name: &'static str,
        /// Their dtype.
        got: DType,
    },
    /// A page table entry that a sequence's length reaches is no page.
    #[error(
        "page table entry [{batch}, {page}] is {index}; the entries a sequence's length reaches \
         must be page indices in 0..{pages}"
    )]
    PageIndex {
        /// The sequence.
        batch: usize,
        /// The logical page.
        page: usize,
        /// The entry.
        index: i64,
        /// The pages there are.
        pages: usize,
    },
    /// `Hq` is not a multiple of `Hkv`.
    #[error("query heads must be a multiple of kv heads (GQA): Hq = {heads_q}, Hkv = {heads_kv}")]
    Heads {
        /// Query heads.
        heads_q: usize,
        /// Key/value heads.
        heads_kv: usize,
    },
    /// An explicit argument disagrees with the tensors' shapes.
    #[error("argument {name} = {given} disagrees with the tensors, which have {actual}")]
    Argument {
        /// Argument name.
        name: &'static str,
        /// The value passed.
        given: usize,
        /// The value the shapes imply.
        actual: usize,
    },
    /// A dtype that this backend does not support (yet).
    #[error("{name} has dtype {dtype:?}; the {backend} backend supports {supported}")]
    DType {
        /// Which tensor.
        name: &'static str,
        /// Its dtype.
        dtype: DType,
        /// The backend.
        backend: &'static str,
        /// What it supports.
        supported: &'static str,
    },
    /// A size that does not fit the kernels' index type.
    #[error("{name} = {value} exceeds the largest supported size {max}")]
    TooLarge {
        /// Which size.
        name: &'static str,
        /// Its value.
        value: usize,
        /// The bound.
        max: usize,
    },
    /// `scale` is not a finite number.
    #[error("scale must be finite, got {0}")]
    Scale(f32),
    /// A dropout variant's probability is outside `[0, 1)`.
    #[error("dropout probability must lie in [0, 1), got {0}")]
    Dropout(f32),
    /// A captured tensor has another dtype than its declared element type.
    #[error("captured tensor `{field}` must have dtype {expected:?}, got {got:?}")]
    CaptureDType {
        /// The field.
        field: &'static str,
        /// The declared element type's dtype.
        expected: DType,
        /// The tensor's.
        got: DType,
    },
    /// An element of a captured tensor the kernels cannot hold (an `i64`
    /// tensor's value outside i32).
    #[error("captured tensor `{field}` holds {value} at element {at}; {rule}")]
    CaptureValue {
        /// The field.
        field: &'static str,
        /// The element's linear position.
        at: usize,
        /// Its value.
        value: i64,
        /// What the value must satisfy.
        rule: &'static str,
    },
    /// A captured tensor's shape does not match its declaration.
    #[error("captured tensor `{field}` must have shape {expected} (as declared), got {got:?}")]
    CaptureShape {
        /// The field.
        field: &'static str,
        /// The declared shape with the problem's sizes.
        expected: String,
        /// The tensor's shape.
        got: Vec<usize>,
    },
    /// A captured tensor lives on another runtime than the call's.
    #[error("captured tensor `{field}` is a tensor of {got}, but the call runs on {expected}")]
    CaptureRuntime {
        /// The field.
        field: &'static str,
        /// The call's runtime.
        expected: &'static str,
        /// The tensor's.
        got: &'static str,
    },
    /// A tensor read's index was out of range (the read read nothing).
    #[error("captured tensor `{field}` was read at index {index:?}, outside its shape {shape:?}")]
    IndexOutOfRange {
        /// The field.
        field: &'static str,
        /// The index.
        index: Vec<i64>,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// A contribution to a learnable tensor's gradient on a GPU backend was
    /// beyond the range of its fixed-point accumulators (see
    /// `kernels_spec::params`, "Gradient accumulators"), or a sum came near
    /// the end of it.
    #[error(
        "a gradient of learnable tensor `{field}` on {backend} is out of the range of its \
         deterministic fixed-point accumulators: {rule} (got {value:e})"
    )]
    TensorGradRange {
        /// The backend.
        backend: &'static str,
        /// The learnable field.
        field: &'static str,
        /// The rule broken.
        rule: &'static str,
        /// The magnitude seen (a lower bound where a contribution was
        /// dropped).
        value: f64,
    },
    /// A GPU backend could not build or launch a kernel.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// An error from numr (allocation, device).
    #[error(transparent)]
    Numr(#[from] numr::error::Error),
    /// An error from boostr's modules around the attention
    /// ([`model`](crate::model), feature `boostr`).
    #[cfg(feature = "boostr")]
    #[error("boostr: {0}")]
    Boostr(#[from] boostr::error::Error),
    /// The CPU kernels' threads could not be pinned (see `cpu::pin_threads`).
    #[error("pinning the CPU threads: {reason}")]
    Threads {
        /// Why.
        reason: String,
    },
    /// A ring attention call broke a rule of its layout or transport.
    #[error("ring attention: {rule}; got {got}")]
    Ring {
        /// The rule.
        rule: &'static str,
        /// What broke it.
        got: String,
    },
    /// The ranks of a ring attention call disagree on what they compute
    /// (every rank gets this error).
    #[error("ring attention: the ranks disagree on {field} ({values})")]
    RingDisagree {
        /// What they disagree on.
        field: &'static str,
        /// Each rank's value.
        values: String,
    },
    /// Another rank failed during a ring attention call, so no rank's
    /// result is valid (the failed ranks return their own error).
    #[error("ring attention: rank(s) {ranks:?} failed during the ring")]
    RingPeerFailed {
        /// The ranks that failed.
        ranks: Vec<usize>,
    },
    /// A communication of a ring attention call did not finish in time:
    /// a peer is gone or stuck. The communicator must be built again.
    #[error("ring attention: rank {rank}: {op} did not finish within {timeout:?}")]
    RingTimeout {
        /// What was waited for.
        op: &'static str,
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        timeout: std::time::Duration,
    },
}

/// Why a GPU backend could not build or launch a kernel. `Clone`, so a
/// kernel cache keeps a failed build as its error and every caller gets it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The variant has no lowering for the target: a hand-written
    /// [`Variant`](crate::Variant) impl runs on the CPU only.
    #[error(
        "variant `{variant}` has no {target} lowering; only variants declared with \
         #[attention] run on the GPU targets"
    )]
    NoLowering {
        /// The variant.
        variant: &'static str,
        /// The target.
        target: Target,
    },
    /// No tile configuration of the target fits these head dims and dtype.
    #[error("{target}: head dims {head_dim}/{value_dim} ({dtype:?}) have no tiling: {error}")]
    Tiling {
        /// The target.
        target: Target,
        /// The query/key head dim.
        head_dim: usize,
        /// The value head dim.
        value_dim: usize,
        /// The element type.
        dtype: DType,
        /// The rule the defaults break.
        error: TilingError,
    },
    /// The target's compiler refused a generated source.
    #[error("{target}: {source_name} failed to compile:\n{log}")]
    Compile {
        /// The target.
        target: Target,
        /// The source's name (variant, kernels, head dim, dtype).
        source_name: String,
        /// What the compiler said.
        log: String,
    },
    /// A kernel could not be launched.
    #[error("{target}: launching {kernel}: {reason}")]
    Launch {
        /// The target.
        target: Target,
        /// The kernel's entry point.
        kernel: &'static str,
        /// Why.
        reason: String,
    },
    /// The device cannot run the target's kernels.
    #[error("{target}: {reason}")]
    Device {
        /// The target.
        target: Target,
        /// Why.
        reason: String,
    },
}

impl From<Error> for numr::error::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Numr(inner) => inner,
            other => numr::error::Error::InvalidArgument {
                arg: "attention",
                reason: other.to_string(),
            },
        }
    }
}
