//! Pinning the CPU kernels' threads: one rayon worker per CPU, each bound
//! to its own.
//!
//! The CPU kernels run on rayon's global pool. Left to the scheduler, two
//! workers woken together after an idle spell can share one CPU for tens
//! of milliseconds before the load balancer moves one of them: on a 2-core
//! VM, `bench/cpu_vs_torch.py`'s bf16 forward at S = 1024 (Hq = Hkv = 8,
//! D = 64, bursts after a 100 ms pause) took 3.5–10.5 ms unpinned and
//! 3.3–5.0 ms pinned. A program that makes many short calls, or wants
//! them timed, calls [`pin_threads`] once, before anything else uses
//! rayon.

use crate::error::{Error, Result};

/// Builds rayon's global pool with `threads` workers (`None`: as many as
/// `RAYON_NUM_THREADS` asks, as rayon would, else one per CPU this
/// process may run on, its affinity mask), worker `i` bound to the `i`-th
/// CPU of that mask. Returns the number of workers.
///
/// # Errors
/// [`Error::Threads`] where `threads` is zero or more than the CPUs in
/// the mask, where the pool already exists (rayon builds it on first
/// use), where the mask cannot be read, or on systems other than Linux.
pub fn pin_threads(threads: Option<usize>) -> Result<usize> {
    let mut cpus = allowed_cpus()?;
    let from_env = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|t| t.parse::<usize>().ok())
        .filter(|&t| t > 0);
    let n = threads.or(from_env).unwrap_or(cpus.len());
    if n == 0 || n > cpus.len() {
        return Err(Error::Threads {
            reason: format!(
                "asked for {n} threads; the process may run on {} CPUs, and each thread needs its own",
                cpus.len()
            ),
        });
    }
    cpus.truncate(n);
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .start_handler(move |i| bind(cpus[i]))
        .build_global()
        .map_err(|e| Error::Threads {
            reason: format!("rayon's global pool: {e}"),
        })?;
    Ok(n)
}

/// The CPUs in this process's affinity mask, in order.
#[cfg(target_os = "linux")]
fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: `set` is a plain bit set that sched_getaffinity fills; the
    // size passed is its own.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(Error::Threads {
                reason: format!("sched_getaffinity: {}", std::io::Error::last_os_error()),
            });
        }
        set
    };
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE, the set's size in bits.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    if cpus.is_empty() {
        return Err(Error::Threads {
            reason: "the affinity mask names no CPU".into(),
        });
    }
    Ok(cpus)
}

#[cfg(not(target_os = "linux"))]
fn allowed_cpus() -> Result<Vec<usize>> {
    Err(Error::Threads {
        reason: "pinning threads is implemented on Linux only".into(),
    })
}

/// Binds the calling thread to `cpu`. A failure leaves the thread unbound
/// (it still runs, only unpinned), since a start handler cannot fail.
#[cfg(target_os = "linux")]
fn bind(cpu: usize) {
    // SAFETY: as in `allowed_cpus`; `cpu` came from the process's own mask.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(not(target_os = "linux"))]
fn bind(_cpu: usize) {}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_thread_count_the_mask_cannot_hold_is_an_error() {
        let cpus = allowed_cpus().expect("the mask").len();
        for n in [0, cpus + 1] {
            let e = pin_threads(Some(n)).expect_err("no pool for that count");
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("asked for {n} threads")) && msg.contains(&cpus.to_string()),
                "{msg}"
            );
        }
    }
}
