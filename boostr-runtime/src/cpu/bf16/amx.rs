//! Intel AMX (Advanced Matrix Extensions) bf16 tile products: eight tile
//! registers `tmm0..7` of 16 rows × 64 bytes, and `tdpbf16ps`, which adds
//! the product of a 16 × 32 bf16 tile and a 32 × 16 bf16 tile (stored as 16
//! rows of 16 bf16 pairs, "VNNI" order) into a 16 × 16 f32 tile: 16 384
//! flops per instruction, sixteen times an AVX-512 FMA's 1 024 per 16
//! cycles on a Sapphire Rapids core.
//!
//! The instructions are written as inline assembly (the tile registers take
//! `const` operands), so they need no unstable intrinsics; the tile state is
//! the process's once Linux has granted it (`arch_prctl`), see
//! [`available`].
//!
//! Every tile here is configured as 16 rows × 64 bytes (palette 1); a
//! product's operands are read from and written to memory with a row stride.

use std::arch::asm;
use std::sync::OnceLock;

/// Rows of every tile, and f32 columns of an accumulator tile.
pub(in crate::cpu) const TILE: usize = 16;
/// bf16 elements of an operand tile's row: the reduction depth of one
/// `tdpbf16ps`.
pub(in crate::cpu) const DEPTH: usize = 32;

/// Whether this CPU has AMX-TILE and AMX-BF16 and the OS lets this process
/// use them: CPUID says so, XCR0 enables the tile state, and Linux granted
/// tile data on request (once per process, for all its threads).
pub(in crate::cpu) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cpu_has_amx() && os_grants_amx())
}

fn cpu_has_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid_count;
        let (max, leaf1, leaf7) = (
            __cpuid_count(0, 0).eax,
            __cpuid_count(1, 0),
            __cpuid_count(7, 0),
        );
        let osxsave = leaf1.ecx & (1 << 27) != 0;
        let amx_bf16 = leaf7.edx & (1 << 22) != 0;
        let amx_tile = leaf7.edx & (1 << 24) != 0;
        if max < 7 || !osxsave || !amx_bf16 || !amx_tile {
            return false;
        }
        // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves tiles.
        let xcr0: u64;
        // SAFETY: XGETBV with ECX = 0 is allowed where OSXSAVE is set.
        unsafe {
            let (lo, hi): (u32, u32);
            asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack));
            xcr0 = u64::from(lo) | (u64::from(hi) << 32);
        }
        xcr0 & (0b11 << 17) == (0b11 << 17)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn os_grants_amx() -> bool {
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only changes which state
        // components the kernel lets this process use.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// The 64-byte tile configuration: palette 1, every tile 16 × 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1; // palette
    let mut t = 0;
    while t < 8 {
        // Bytes per row of tile t (u16 at 16 + 2t), rows (u8 at 48 + t).
        c[16 + 2 * t] = 64;
        c[48 + t] = TILE as u8;
        t += 1;
    }
    Config(c)
};

/// The tile registers configured for the products here, until dropped.
#[derive(Debug)]
pub(in crate::cpu) struct Tiles(());

impl Tiles {
    /// Configures the tiles on this thread.
    ///
    /// # Safety
    /// [`available`] returned true.
    pub(in crate::cpu) unsafe fn configure() -> Tiles {
        // SAFETY: AMX is available (the caller's contract); CONFIG is a
        // valid palette-1 configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
        Tiles(())
    }

    /// `tmm{T} = 0`.
    #[inline(always)]
    pub(in crate::cpu) fn zero<const T: u8>(&self) {
        // SAFETY: the tiles are configured (`self` exists).
        unsafe { asm!("tilezero tmm{t}", t = const T, options(nomem, nostack)) };
    }

    /// Loads `tmm{T}`: 16 rows of 64 bytes, row `r` at `p + r·stride`
    /// (bytes).
    ///
    /// # Safety
    /// Those 16 × 64 bytes are readable.
    #[inline(always)]
    pub(in crate::cpu) unsafe fn load<const T: u8>(&self, p: *const u8, stride: usize) {
        // SAFETY: the tiles are configured; the caller vouches for memory.
        unsafe {
            asm!("tileloadd tmm{t}, [{p} + {s} * 1]", t = const T, p = in(reg) p, s = in(reg) stride,
                 options(nostack, readonly))
        };
    }

    /// Stores `tmm{T}` as [`load`](Self::load) reads it.
    ///
    /// # Safety
    /// Those 16 × 64 bytes are writable.
    #[inline(always)]
    pub(in crate::cpu) unsafe fn store<const T: u8>(&self, p: *mut u8, stride: usize) {
        // SAFETY: the tiles are configured; the caller vouches for memory.
        unsafe {
            asm!("tilestored [{p} + {s} * 1], tmm{t}", t = const T, p = in(reg) p, s = in(reg) stride,
                 options(nostack))
        };
    }

    /// `tmm{C} += tmm{A} · tmm{B}`: A 16 × 32 bf16, B 16 rows of 16 bf16
    /// pairs (B[k][n] at row k/2, pair n, half k%2), C 16 × 16 f32. Each
    /// element of C adds its 32 products in f32 (pairs fused, see Intel's
    /// description of TDPBF16PS).
    #[inline(always)]
    pub(in crate::cpu) fn dot<const C: u8, const A: u8, const B: u8>(&self) {
        // SAFETY: the tiles are configured.
        unsafe {
            asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                 options(nomem, nostack))
        };
    }
}

/// `C (=|+=) A · B` on tile registers, for `m × n` of C in blocks of 32 ×
/// 32 (four accumulator tiles, each A and B tile loaded once per block and
/// used twice), over `k` (a multiple of [`DEPTH`]):
/// - `A`: `m × k` bf16, row-major, rows `a_stride` elements apart;
/// - `B`: `k × n` bf16 in VNNI pairs: `k/2` rows of `n` u32, each holding
///   `(B[2r][j], B[2r + 1][j])`, rows `b_stride` u32 apart;
/// - `C`: `m × n` f32, rows `c_stride` apart; loaded and added to where
///   `accumulate`, else overwritten.
///
/// # Safety
/// `m` and `n` are multiples of 32 and `k` of [`DEPTH`]; the tiles are
/// configured on this thread; every element named above is in bounds.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(in crate::cpu) unsafe fn product(
    t: &Tiles,
    (a, a_stride): (*const u16, usize),
    (b, b_stride): (*const u32, usize),
    (c, c_stride): (*mut f32, usize),
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    let (sa, sb, sc) = (2 * a_stride, 4 * b_stride, 4 * c_stride);
    // SAFETY (whole body): every tile read or written lies in the m × k,
    // k/2 × n and m × n blocks the caller vouches for.
    unsafe {
        for i in (0..m).step_by(2 * TILE) {
            for j in (0..n).step_by(2 * TILE) {
                let c = c.add(i * c_stride + j);
                let c1 = c.add(TILE * c_stride);
                if accumulate {
                    t.load::<0>(c.cast(), sc);
                    t.load::<1>(c.add(TILE).cast(), sc);
                    t.load::<2>(c1.cast(), sc);
                    t.load::<3>(c1.add(TILE).cast(), sc);
                } else {
                    t.zero::<0>();
                    t.zero::<1>();
                    t.zero::<2>();
                    t.zero::<3>();
                }
                for kc in (0..k).step_by(DEPTH) {
                    let a = a.add(i * a_stride + kc);
                    let b = b.add(kc / 2 * b_stride + j);
                    t.load::<4>(a.cast(), sa);
                    t.load::<5>(a.add(TILE * a_stride).cast(), sa);
                    t.load::<6>(b.cast(), sb);
                    t.load::<7>(b.add(TILE).cast(), sb);
                    t.dot::<0, 4, 6>();
                    t.dot::<1, 4, 7>();
                    t.dot::<2, 5, 6>();
                    t.dot::<3, 5, 7>();
                }
                t.store::<0>(c.cast(), sc);
                t.store::<1>(c.add(TILE).cast(), sc);
                t.store::<2>(c1.cast(), sc);
                t.store::<3>(c1.add(TILE).cast(), sc);
            }
        }
    }
}

/// Which bf16 products the bf16 kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::cpu) enum Kind {
    /// AMX tiles ([`product`]).
    Amx,
    /// AVX512-BF16's `vdpbf16ps` (`bf16_dot::product`).
    Dot,
}

/// The bf16 products this thread may run, best first: AMX where the CPU
/// and OS allow it, else `vdpbf16ps` where it beats the f32 kernels (see
/// `bf16_dot::pays`), else none (the inputs are widened for the f32
/// kernels).
pub(in crate::cpu) fn kind() -> Option<Kind> {
    use crate::cpu::{bf16_dot, simd};
    if simd::amx_allowed() && simd::avx512() && available() {
        Some(Kind::Amx)
    } else if simd::bf16_dot_allowed()
        && simd::avx512()
        && bf16_dot::present()
        && (bf16_dot::pays() || simd::bf16_dot_forced())
    {
        Some(Kind::Dot)
    } else {
        None
    }
}

/// One thread's bf16 products of a [`Kind`], from [`Products::start`] to
/// drop (the AMX tiles configured for that long).
#[derive(Debug)]
pub(in crate::cpu) enum Products {
    Amx(Tiles),
    Dot,
}

impl Products {
    /// Readies `kind`'s products on this thread.
    ///
    /// # Safety
    /// [`kind`] returned `kind` (on this thread or one capped alike).
    pub(in crate::cpu) unsafe fn start(kind: Kind) -> Self {
        match kind {
            // SAFETY: AMX is available (the caller's contract).
            Kind::Amx => Products::Amx(unsafe { Tiles::configure() }),
            Kind::Dot => Products::Dot,
        }
    }

    /// [`product`] (AMX) or `bf16_dot::product`: the same operands,
    /// layouts and result (up to the order of the f32 sums).
    ///
    /// # Safety
    /// As [`product`].
    #[inline(always)]
    pub(in crate::cpu) unsafe fn product(
        &self,
        a: (*const u16, usize),
        b: (*const u32, usize),
        c: (*mut f32, usize),
        mnk: (usize, usize, usize),
        accumulate: bool,
    ) {
        match self {
            // SAFETY: the caller's contract, as `product` states it.
            Products::Amx(t) => unsafe { product(t, a, b, c, mnk, accumulate) },
            // SAFETY: `start(Dot)` means `vdpbf16ps` is present; the
            // multiples of 32 cover those `bf16_dot::product` needs.
            Products::Dot => unsafe { crate::cpu::bf16_dot::product(a, b, c, mnk, accumulate) },
        }
    }
}

/// Seconds for `iters` rounds of four independent `tdpbf16ps` on tile
/// registers only (no loads), on the calling thread: `iters · 4 · 16384`
/// flops at the core's bf16 tile peak. `None` without AMX.
pub(in crate::cpu) fn time_peak(iters: usize) -> Option<f64> {
    if !available() {
        return None;
    }
    // SAFETY: AMX is available.
    let tiles = unsafe { Tiles::configure() };
    tiles.zero::<0>();
    tiles.zero::<1>();
    tiles.zero::<2>();
    tiles.zero::<3>();
    tiles.zero::<4>();
    tiles.zero::<5>();
    tiles.zero::<6>();
    tiles.zero::<7>();
    let start = std::time::Instant::now();
    for _ in 0..iters {
        tiles.dot::<0, 4, 6>();
        tiles.dot::<1, 4, 7>();
        tiles.dot::<2, 5, 6>();
        tiles.dot::<3, 5, 7>();
    }
    Some(start.elapsed().as_secs_f64())
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: releases the state `configure` set up on this thread.
        unsafe { asm!("tilerelease", options(nomem, nostack)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// One `tdpbf16ps` against the f64 sum of the same bf16 products.
    #[test]
    fn a_tile_product_is_the_sum_of_its_products() {
        if !available() {
            eprintln!("boostr: skipping: no AMX-BF16 on this CPU or OS");
            return;
        }
        let mut rng = crate::testing::Rng::new(3, 0);
        let a: Vec<bf16> = rng
            .normal_f32(16 * 32, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let b: Vec<bf16> = rng
            .normal_f32(32 * 16, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        // B in VNNI order: row k/2, pair n, half k%2.
        let mut bp = vec![bf16::ZERO; 32 * 16];
        for k in 0..32 {
            for n in 0..16 {
                bp[(k / 2) * 32 + 2 * n + k % 2] = b[k * 16 + n];
            }
        }
        let mut c = vec![0.0f32; 16 * 16];
        // SAFETY: AMX is available; every tile is 16 rows of 64 bytes.
        unsafe {
            let t = Tiles::configure();
            t.zero::<0>();
            t.load::<1>(a.as_ptr().cast(), 64);
            t.load::<2>(bp.as_ptr().cast(), 64);
            t.dot::<0, 1, 2>();
            t.store::<0>(c.as_mut_ptr().cast(), 64);
        }
        for i in 0..16 {
            for j in 0..16 {
                let want: f64 = (0..32)
                    .map(|k| f64::from(a[i * 32 + k].to_f32()) * f64::from(b[k * 16 + j].to_f32()))
                    .sum();
                let got = f64::from(c[i * 16 + j]);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "c[{i}][{j}] = {got}, want {want}"
                );
            }
        }
    }
}
