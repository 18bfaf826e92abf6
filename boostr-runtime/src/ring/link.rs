//! The ring's traffic over a numr [`Communicator`]: the header the ranks
//! agree on, the exchange of blocks with the ring's neighbours, and the
//! status every rank reports at the end.
//!
//! Every operation runs on a helper thread that owns what it sends and
//! receives, and the caller waits for it at most the ring's timeout. A
//! peer that never answers (a crashed process, a rank that returned
//! early) then makes the call an `Err` instead of a hang; the helper is
//! left behind with its buffers, so nothing it may still write is freed.
//! After such an error the communicator's state is unknown and the group
//! must be built again (as after an NCCL abort).
//!
//! A communicator that reads the runtime's tensors where they are (any
//! with CPU tensors, NCCL with CUDA's: [`AttentionRuntime::communicator_reads_tensors`](crate::AttentionRuntime::communicator_reads_tensors))
//! is handed them; for any other, every buffer is staged through host
//! memory ([`Wire`]): device → host before a send, host → device after a
//! receive.

use crate::error::{Error, Result};
use numr::dtype::DType;
use numr::runtime::cpu::{CpuDevice, CpuRuntime};
use numr::runtime::{Communicator, ReduceOp, Runtime, RuntimeClient};
use numr::tensor::Tensor;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// One rank's end of the ring.
#[derive(Clone)]
pub(crate) struct Link {
    pub comm: Arc<dyn Communicator>,
    pub rank: usize,
    pub world: usize,
    pub timeout: Duration,
    /// The communicator reads the runtime's tensors where they are; else
    /// they are staged through host memory.
    pub direct: bool,
}

/// A buffer as the communicator reads it: a contiguous tensor of the
/// runtime, or (staged) a copy in host memory.
pub(crate) enum Wire<R: Runtime> {
    Tensor(Tensor<R>),
    Host(Tensor<CpuRuntime>),
}

impl<R: Runtime<DType = DType>> Wire<R> {
    fn ptr(&self) -> u64 {
        match self {
            Wire::Tensor(t) => t.ptr(),
            Wire::Host(t) => t.ptr(),
        }
    }

    fn numel(&self) -> usize {
        match self {
            Wire::Tensor(t) => t.numel(),
            Wire::Host(t) => t.numel(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Wire::Tensor(t) => t.dtype(),
            Wire::Host(t) => t.dtype(),
        }
    }

    /// Its elements (`u64`), on the host.
    fn words(&self) -> Vec<u64> {
        match self {
            Wire::Tensor(t) => t.to_vec(),
            Wire::Host(t) => t.to_vec(),
        }
    }

    /// The buffer as a tensor of the runtime on `device`.
    fn into_tensor(self, device: &R::Device) -> Result<Tensor<R>> {
        Ok(match self {
            Wire::Tensor(t) => t,
            Wire::Host(t) => Tensor::<R>::from_bytes(&t.to_bytes()?, t.shape(), t.dtype(), device)?,
        })
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Where the time of a rank's last ring call went (see
/// [`last_ring_times`](crate::last_ring_times)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RingTimes {
    /// Communications run (exchanges and collectives).
    pub ops: u32,
    /// Their time on the helper threads, start to finish.
    pub comm: Duration,
    /// The time the rank's own thread spent waiting for them; `comm −
    /// waited` was hidden behind compute.
    pub waited: Duration,
}

thread_local! {
    static TIMES: std::cell::Cell<RingTimes> = const {
        std::cell::Cell::new(RingTimes {
            ops: 0,
            comm: Duration::ZERO,
            waited: Duration::ZERO,
        })
    };
}

/// Start counting the calling thread's ring times afresh.
pub(crate) fn reset_times() {
    TIMES.with(|t| t.set(RingTimes::default()));
}

/// The calling thread's ring times since its last ring call began.
pub(crate) fn times() -> RingTimes {
    TIMES.with(std::cell::Cell::get)
}

/// An operation running on its helper thread.
pub(crate) struct Pending<T> {
    what: &'static str,
    rx: mpsc::Receiver<(Result<T>, Duration)>,
}

impl<T> Pending<T> {
    /// Its result, or [`Error::RingTimeout`] once `link`'s timeout has
    /// passed without one.
    pub fn wait(self, link: &Link) -> Result<T> {
        let started = Instant::now();
        let got = self.rx.recv_timeout(link.timeout);
        let waited = started.elapsed();
        TIMES.with(|t| {
            let mut x = t.get();
            x.ops += 1;
            x.waited += waited;
            if let Ok((_, busy)) = &got {
                x.comm += *busy;
            }
            t.set(x);
        });
        match got {
            Ok((result, _)) => result,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(Error::RingTimeout {
                op: self.what,
                rank: link.rank,
                timeout: link.timeout,
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Error::Ring {
                rule: "a communication thread ends with a result",
                got: format!("{} ended without one (it panicked)", self.what),
            }),
        }
    }
}

/// Tensors sent to the next rank and received from the previous one, in
/// one order on both ends (NCCL matches by order, not by tag).
pub(crate) struct Exchange<R: Runtime> {
    /// Sent to `rank + 1`.
    pub send: Vec<Tensor<R>>,
    /// Received from `rank − 1`: each slot's shape and dtype.
    pub recv: Vec<(Vec<usize>, DType)>,
}

impl Link {
    pub fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    pub fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// `ts` as the communicator reads them: contiguous, copied to the host
    /// where they are staged.
    pub fn put<R: Runtime<DType = DType>>(&self, ts: &[Tensor<R>]) -> Result<Vec<Wire<R>>> {
        if self.direct {
            let wires = ts
                .iter()
                .map(|t| Ok(Wire::Tensor(t.contiguous()?)))
                .collect::<Result<Vec<_>>>()?;
            // The communicator may read on a stream of its own: the
            // kernels that wrote them finish first.
            if let Some(t) = ts.first() {
                R::default_client(t.device()).synchronize();
            }
            return Ok(wires);
        }
        ts.iter()
            .map(|t| {
                let host = Tensor::<CpuRuntime>::from_bytes(
                    &t.to_bytes()?,
                    t.shape(),
                    t.dtype(),
                    &CpuDevice::new(),
                )?;
                Ok(Wire::Host(host))
            })
            .collect()
    }

    /// `t` alone, as [`put`](Self::put).
    fn put_one<R: Runtime<DType = DType>>(&self, t: &Tensor<R>) -> Result<Wire<R>> {
        let mut wires = self.put(std::slice::from_ref(t))?;
        Ok(wires.pop().expect("one tensor, one wire"))
    }

    /// A buffer to receive `shape` elements of `dtype` into, where the
    /// communicator writes.
    pub fn slot<R: Runtime<DType = DType>>(
        &self,
        shape: &[usize],
        dtype: DType,
        device: &R::Device,
    ) -> Result<Wire<R>> {
        Ok(if self.direct {
            Wire::Tensor(Tensor::<R>::empty(shape, dtype, device)?)
        } else {
            Wire::Host(Tensor::<CpuRuntime>::empty(
                shape,
                dtype,
                &CpuDevice::new(),
            )?)
        })
    }

    /// Start `f` on a helper thread.
    pub fn spawn<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&dyn Communicator) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let (tx, rx) = mpsc::channel();
        let comm = Arc::clone(&self.comm);
        std::thread::spawn(move || {
            let started = Instant::now();
            let result = f(&*comm);
            // The receiver may be gone (the caller timed out); then the
            // result has nobody to go to.
            let _ = tx.send((result, started.elapsed()));
        });
        Pending { what, rx }
    }

    /// Start an exchange with the ring's neighbours: every tensor of
    /// `x.send` to the next rank, as many to receive from the previous one.
    /// Even ranks send first and odd ranks receive first, so that a
    /// transport whose sends wait for their receives cannot deadlock.
    pub fn exchange<R: Runtime<DType = DType>>(
        &self,
        x: Exchange<R>,
        device: &R::Device,
        tag: u32,
    ) -> Result<Pending<Vec<Tensor<R>>>> {
        let send = self.put(&x.send)?;
        let recv = x
            .recv
            .iter()
            .map(|(shape, dtype)| self.slot::<R>(shape, *dtype, device))
            .collect::<Result<Vec<_>>>()?;
        let (next, prev, even) = (self.next(), self.prev(), self.rank.is_multiple_of(2));
        let device = device.clone();
        Ok(self.spawn("the ring's exchange of blocks", move |comm| {
            let send_all = |comm: &dyn Communicator| -> Result<()> {
                for (i, t) in send.iter().enumerate() {
                    // SAFETY: `t` is a contiguous buffer where the
                    // communicator reads, owned by this thread until
                    // `sync` below returns.
                    unsafe { comm.send(t.ptr(), t.numel(), t.dtype(), next, tag + i as u32)? };
                }
                Ok(())
            };
            let recv_all = |comm: &dyn Communicator| -> Result<()> {
                for (i, t) in recv.iter().enumerate() {
                    // SAFETY: `t` was allocated above with its shape and
                    // dtype, and is owned by this thread until `sync`.
                    unsafe { comm.recv(t.ptr(), t.numel(), t.dtype(), prev, tag + i as u32)? };
                }
                Ok(())
            };
            if even {
                send_all(comm)?;
                recv_all(comm)?;
            } else {
                recv_all(comm)?;
                send_all(comm)?;
            }
            comm.sync()?;
            drop(send);
            recv.into_iter().map(|t| t.into_tensor(&device)).collect()
        }))
    }

    /// Every rank's `words`, in rank order (one all-gather). Staged, they
    /// never leave the host.
    pub fn gather_words<R: Runtime<DType = DType>>(
        &self,
        words: &[u64],
        device: &R::Device,
        what: &'static str,
    ) -> Result<Vec<Vec<u64>>> {
        let n = words.len();
        let send = if self.direct {
            Wire::Tensor(Tensor::<R>::from_slice(words, &[n], device)?)
        } else {
            Wire::Host(Tensor::<CpuRuntime>::from_slice(
                words,
                &[n],
                &CpuDevice::new(),
            )?)
        };
        let all: Vec<u64> = self.all_gather(send, &[n], device, what)?.words();
        Ok(all.chunks(n).map(<[u64]>::to_vec).collect())
    }

    /// Every rank's `tensor` (each of the same shape and dtype), stacked in
    /// rank order: `[world, ..shape]` (one all-gather).
    pub fn gather<R: Runtime<DType = DType>>(
        &self,
        tensor: &Tensor<R>,
        what: &'static str,
    ) -> Result<Tensor<R>> {
        let send = self.put_one(tensor)?;
        let device = tensor.device();
        self.all_gather(send, tensor.shape(), device, what)?
            .into_tensor(device)
    }

    /// Every rank's `send` of `shape`, stacked in rank order where the
    /// communicator writes.
    fn all_gather<R: Runtime<DType = DType>>(
        &self,
        send: Wire<R>,
        shape: &[usize],
        device: &R::Device,
        what: &'static str,
    ) -> Result<Wire<R>> {
        let (n, dtype) = (send.numel(), send.dtype());
        let mut all = vec![self.world];
        all.extend_from_slice(shape);
        let recv = self.slot::<R>(&all, dtype, device)?;
        self.spawn(what, move |comm| {
            // SAFETY: `send` holds `n` elements of `dtype` and `recv`
            // `world · n`, both contiguous where the communicator reads,
            // and owned by this thread.
            unsafe { comm.all_gather(send.ptr(), recv.ptr(), n, dtype)? };
            comm.sync()?;
            Ok(recv)
        })
        .wait(self)
    }

    /// The sum over the ranks of their `parts [world, ..shape]` (f32) at
    /// this rank's index: `[..shape]` (one reduce-scatter; summed in the
    /// communicator's order, rank order on numr's `LocalCommunicator`).
    pub fn reduce_scatter<R: Runtime<DType = DType>>(
        &self,
        parts: Tensor<R>,
        what: &'static str,
    ) -> Result<Tensor<R>> {
        let shape = parts.shape()[1..].to_vec();
        let n: usize = shape.iter().product();
        let device = parts.device().clone();
        let send = self.put_one(&parts)?;
        let recv = self.slot::<R>(&shape, DType::F32, &device)?;
        self.spawn(what, move |comm| {
            // SAFETY: `send` holds `world · n` f32 and `recv` `n`, both
            // contiguous where the communicator reads, owned by this
            // thread.
            unsafe { comm.reduce_scatter(send.ptr(), recv.ptr(), n, DType::F32, ReduceOp::Sum)? };
            comm.sync()?;
            recv.into_tensor(&device)
        })
        .wait(self)
    }

    /// Check that every rank sent the same header; on every rank the same
    /// `Err` naming the first field that differs.
    pub fn agree<R: Runtime<DType = DType>>(
        &self,
        header: &[(&'static str, u64)],
        device: &R::Device,
    ) -> Result<()> {
        let words: Vec<u64> = header.iter().map(|&(_, w)| w).collect();
        let all = self.gather_words::<R>(&words, device, "the ranks' header")?;
        for (i, &(field, _)) in header.iter().enumerate() {
            let values: Vec<u64> = all.iter().map(|w| w[i]).collect();
            if values.iter().any(|&v| v != values[0]) {
                return Err(Error::RingDisagree {
                    field,
                    values: values
                        .iter()
                        .enumerate()
                        .map(|(r, v)| format!("rank {r}: {v:#x}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        Ok(())
    }

    /// After the ring: `Ok` only if no rank failed; else every rank's
    /// `Err` names the ranks that did (`own` is this rank's error).
    pub fn settle<R: Runtime<DType = DType>>(
        &self,
        own: Option<Error>,
        device: &R::Device,
    ) -> Result<()> {
        let all =
            self.gather_words::<R>(&[u64::from(own.is_some())], device, "the ring's status")?;
        let failed: Vec<usize> = (0..self.world).filter(|&r| all[r][0] != 0).collect();
        match own {
            Some(e) => Err(e),
            None if failed.is_empty() => Ok(()),
            None => Err(Error::RingPeerFailed { ranks: failed }),
        }
    }
}
