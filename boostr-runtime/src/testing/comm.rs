//! Ranks as threads of one process, with point-to-point messages, and a
//! count of every message: what ring attention is tested and measured on.
//!
//! numr's [`LocalCommunicator`] runs collectives between threads but
//! refuses `send` and `recv`. [`ThreadComm`] is one rank of a
//! `LocalCommunicator` group, its collectives passed through, with
//! `send`/`recv` through in-process mailboxes (host pointers only, as for
//! `LocalCommunicator`) and a [`MessageCount`] of its traffic.

use numr::dtype::DType;
use numr::error::{Error, Result};
use numr::runtime::{Communicator, LocalCommunicator, ReduceOp};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What one rank sent and called, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MessageCount {
    /// Point-to-point sends.
    pub sends: u64,
    /// Point-to-point receives.
    pub recvs: u64,
    /// Bytes sent point to point.
    pub bytes_sent: u64,
    /// All-gathers.
    pub all_gathers: u64,
    /// Bytes this rank contributed to all-gathers.
    pub bytes_gathered: u64,
    /// All-reduces, broadcasts, reduce-scatters and barriers.
    pub other_collectives: u64,
}

#[derive(Default)]
struct Counters {
    sends: AtomicU64,
    recvs: AtomicU64,
    bytes_sent: AtomicU64,
    all_gathers: AtomicU64,
    bytes_gathered: AtomicU64,
    other: AtomicU64,
}

/// Messages in flight, by `(from, to, tag)`.
type Mail = HashMap<(usize, usize, u32), VecDeque<Vec<u8>>>;

struct Mailboxes {
    mail: Mutex<Mail>,
    arrived: Condvar,
}

/// One rank of an in-process group with point-to-point messages (see the
/// module docs). Sends complete at once (the bytes are copied); a receive
/// waits for its message up to the group's timeout, or until the group is
/// aborted (a rank dropped, or [`abort`](ThreadComm::abort)).
pub struct ThreadComm {
    local: LocalCommunicator,
    boxes: Arc<Mailboxes>,
    counters: Counters,
    timeout: Duration,
}

impl std::fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.local.rank())
            .field("count", &self.count())
            .finish()
    }
}

impl ThreadComm {
    /// A group of `world` ranks (rank `i` at index `i`) whose waits give
    /// up after `timeout`.
    pub fn group(world: usize, timeout: Duration) -> Vec<Arc<ThreadComm>> {
        let boxes = Arc::new(Mailboxes {
            mail: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        });
        LocalCommunicator::with_timeout(world, timeout)
            .into_iter()
            .map(|local| {
                Arc::new(ThreadComm {
                    local,
                    boxes: Arc::clone(&boxes),
                    counters: Counters::default(),
                    timeout,
                })
            })
            .collect()
    }

    /// What this rank has sent and called so far.
    pub fn count(&self) -> MessageCount {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MessageCount {
            sends: get(&c.sends),
            recvs: get(&c.recvs),
            bytes_sent: get(&c.bytes_sent),
            all_gathers: get(&c.all_gathers),
            bytes_gathered: get(&c.bytes_gathered),
            other_collectives: get(&c.other),
        }
    }

    /// Abort the group: every pending and later call of every rank fails.
    pub fn abort(&self) {
        self.local.abort();
        self.boxes.arrived.notify_all();
    }

    fn bump(&self, a: &AtomicU64, by: u64) {
        a.fetch_add(by, Ordering::Relaxed);
    }
}

fn bytes(count: usize, dtype: DType) -> usize {
    count * dtype.size_in_bytes()
}

impl Communicator for ThreadComm {
    fn world_size(&self) -> usize {
        self.local.world_size()
    }

    fn rank(&self) -> usize {
        self.local.rank()
    }

    unsafe fn all_reduce(&self, ptr: u64, count: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        self.bump(&self.counters.other, 1);
        // SAFETY: forwarded from the caller.
        unsafe { self.local.all_reduce(ptr, count, dtype, op) }
    }

    unsafe fn broadcast(&self, ptr: u64, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.bump(&self.counters.other, 1);
        // SAFETY: forwarded from the caller.
        unsafe { self.local.broadcast(ptr, count, dtype, root) }
    }

    unsafe fn all_gather(
        &self,
        send_ptr: u64,
        recv_ptr: u64,
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        self.bump(&self.counters.all_gathers, 1);
        self.bump(&self.counters.bytes_gathered, bytes(count, dtype) as u64);
        // SAFETY: forwarded from the caller.
        unsafe { self.local.all_gather(send_ptr, recv_ptr, count, dtype) }
    }

    unsafe fn reduce_scatter(
        &self,
        send_ptr: u64,
        recv_ptr: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.bump(&self.counters.other, 1);
        // SAFETY: forwarded from the caller.
        unsafe {
            self.local
                .reduce_scatter(send_ptr, recv_ptr, count, dtype, op)
        }
    }

    unsafe fn send(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        dest: usize,
        tag: u32,
    ) -> Result<()> {
        if dest >= self.world_size() || self.local.is_aborted() {
            return Err(Error::Backend(format!(
                "ThreadComm: send to rank {dest} of {} (aborted: {})",
                self.world_size(),
                self.local.is_aborted()
            )));
        }
        let n = bytes(count, dtype);
        // SAFETY: the caller passes a live host buffer of `count` elements
        // of `dtype`.
        let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, n) }.to_vec();
        let key = (self.rank(), dest, tag);
        let mut mail = self.boxes.mail.lock().unwrap_or_else(|e| e.into_inner());
        mail.entry(key).or_default().push_back(data);
        drop(mail);
        self.boxes.arrived.notify_all();
        self.bump(&self.counters.sends, 1);
        self.bump(&self.counters.bytes_sent, n as u64);
        Ok(())
    }

    unsafe fn recv(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        src: usize,
        tag: u32,
    ) -> Result<()> {
        let n = bytes(count, dtype);
        let key = (src, self.rank(), tag);
        let deadline = Instant::now() + self.timeout;
        let mut mail = self.boxes.mail.lock().unwrap_or_else(|e| e.into_inner());
        let data = loop {
            if let Some(data) = mail.get_mut(&key).and_then(VecDeque::pop_front) {
                break data;
            }
            let now = Instant::now();
            if self.local.is_aborted() || now >= deadline {
                return Err(Error::Backend(format!(
                    "ThreadComm: rank {} waited for rank {src}'s message {tag} in vain (aborted: {})",
                    self.rank(),
                    self.local.is_aborted()
                )));
            }
            // Wake at least every 50 ms to notice an abort.
            let wait = (deadline - now).min(Duration::from_millis(50));
            mail = self
                .boxes
                .arrived
                .wait_timeout(mail, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(mail);
        if data.len() != n {
            return Err(Error::Backend(format!(
                "ThreadComm: rank {src}'s message {tag} has {} bytes, the receive wants {n}",
                data.len()
            )));
        }
        // SAFETY: the caller passes a live host buffer of `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, n) };
        self.bump(&self.counters.recvs, 1);
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.bump(&self.counters.other, 1);
        self.local.barrier()
    }
}
