//! The decode kernel, KV caches and pages, values of their own head dim,
//! the cache backward, and 16-bit caches read as their widened copies.

use super::*;

/// The decode kernel with `chunks` key chunks, into NaN-poisoned buffers:
/// `out`, `lse` and each row's largest score.
fn decode<V: HostVariant>(
    v: &V,
    p: &Problem,
    t: CpuTiles,
    chunks: usize,
    x: &Inputs,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut out, mut lse) = poisoned(p);
    let mut max = lse.clone();
    let inputs = ForwardInputs::packed(p, &x.q, (&x.k, &x.v), None);
    let outputs = (&mut out[..], &mut lse[..], Some(&mut max[..]));
    entry::forward_inputs(v, p, (t, Some(chunks)), inputs, outputs);
    (out, lse, max)
}

#[track_caller]
fn check_decode<V: HostVariant>(v: &V, p: &Problem, t: CpuTiles) {
    let x = Inputs::new(p, 0xdec0de ^ p.seq_k as u64, 1.0);
    let want = reference(v, p, &x);
    let (one, one_lse, _) = decode(v, p, t, 1, &x);
    for chunks in [1, 2, 3, 7, 1000] {
        let (out, lse, max) = decode(v, p, t, chunks, &x);
        let ctx = format!("{} {p:?} {t:?} chunks {chunks}", V::NAME);
        assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
        assert_close(&format!("lse {ctx}"), &lse, &want.lse, 2e-5);
        assert_close(&format!("max {ctx}"), &max, &want.max_scores, 2e-5);
        // Split against unsplit: the same rows, merged by their lse.
        assert_close(
            &format!("out {ctx} vs 1 chunk"),
            &out,
            &one.iter().map(|&y| y as f64).collect::<Vec<_>>(),
            1e-5,
        );
        assert_close(
            &format!("lse {ctx} vs 1 chunk"),
            &lse,
            &one_lse.iter().map(|&y| y as f64).collect::<Vec<_>>(),
            1e-5,
        );
        // Run to run: the same bits.
        let (again, again_lse, _) = decode(v, p, t, chunks, &x);
        assert!(
            out.iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && lse
                    .iter()
                    .zip(&again_lse)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ctx}: two runs differ"
        );
    }
}

#[test]
fn decode_matches_reference_for_every_chunking() {
    let t = CpuTiles::new(64, 64);
    // Decode, speculative rows and a short append; GQA 8:1 and MQA; key
    // counts that leave a last block and a last chunk short; Sq > Sk (rows
    // that see nothing).
    for (hq, hkv, sq, sk, d) in [
        (8, 1, 1, 1000, 64),
        (16, 2, 4, 777, 128),
        (4, 4, 17, 301, 40),
        (2, 1, 32, 65, 64),
        (4, 2, 9, 5, 32),
    ] {
        let p = problem(2, hq, hkv, sq, sk, d);
        check_decode(&Unmasked, &p, t);
        check_decode(&CausalSoftcap::new(20.0), &p, t);
        check_decode(&SlidingWindow { window: 100 }, &p, t);
        check_decode(&Alibi { slope: 0.01 }, &p, t);
    }
    // Key tiles of another size.
    let p = problem(1, 8, 2, 3, 999, 64);
    check_decode(&SlidingWindow { window: 300 }, &p, CpuTiles::new(64, 48));
}

#[test]
fn decode_splits_only_when_the_heads_leave_threads_idle() {
    let t = CpuTiles::new(64, 64);
    // One sequence, 8 kv heads, 2 threads: 8 tasks already.
    assert_eq!(decode::chunks(&problem(1, 32, 8, 1, 32768, 128), t, 2), 1);
    // One kv head: 8 tasks wanted, and 32k keys allow them.
    assert_eq!(decode::chunks(&problem(1, 8, 1, 1, 32768, 128), t, 2), 8);
    // Short keys cap the chunks at one per 512 keys.
    assert_eq!(decode::chunks(&problem(1, 8, 1, 1, 1000, 128), t, 16), 2);
    assert_eq!(decode::chunks(&problem(1, 8, 1, 1, 100, 128), t, 16), 1);
    assert!(decode::applies(&problem(1, 8, 1, 32, 100, 128)));
    assert!(!decode::applies(&problem(1, 8, 1, 33, 100, 128)));
}

/// The cache forward into NaN-poisoned buffers, against the f64 reference;
/// the spare slots past each length hold NaN and infinities.
#[track_caller]
fn check_cache<V: HostVariant>(v: &V, p: &Problem, t: CpuTiles, lens: &[usize]) {
    let mut x = Inputs::new(p, 0xcac4e ^ p.seq_k as u64, 1.0);
    let (cap, d, d_v) = (p.seq_k, p.head_dim, p.head_dim_v);
    for (row, (k, v)) in x.k.chunks_mut(d).zip(x.v.chunks_mut(d_v)).enumerate() {
        let b = row / (p.heads_kv * cap);
        if row % cap >= lens[b] {
            k.fill(f32::NAN);
            v.iter_mut()
                .enumerate()
                .for_each(|(i, y)| *y = [f32::INFINITY, f32::NAN][i % 2]);
        }
    }
    let want = reference_lens(v, p, &x, Some(lens));
    let (out, lse) = cache_forward(v, p, t, lens, &x);
    let ctx = format!("{} {p:?} lens {lens:?}", V::NAME);
    assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
    assert_close(&format!("lse {ctx}"), &lse, &want.lse, 2e-5);
}

/// The tile forward of `x` over a cache of `lens`, into poisoned buffers.
fn cache_forward<V: HostVariant>(
    v: &V,
    p: &Problem,
    t: CpuTiles,
    lens: &[usize],
    x: &Inputs,
) -> (Vec<f32>, Vec<f32>) {
    let (mut out, mut lse) = poisoned(p);
    let cache = CacheLayout::lengths(lens);
    forward_cache_tiled(v, p, t, cache, &x.q, &x.k, &x.v, &mut out, &mut lse);
    (out, lse)
}

#[test]
fn cache_lengths_match_reference_and_spare_slots_stay_out() {
    let t = CpuTiles::new(64, 64);
    // Lengths 0, 1, a key-tile boundary, the capacity and others, mixed in
    // one batch; GQA 8:1; decode, speculative rows, and more rows than
    // some sequences have keys.
    let lens = [0, 1, 64, 200, 129, 17];
    for (hq, hkv, sq) in [(8, 1, 1), (8, 1, 4), (4, 2, 17), (2, 2, 40)] {
        let p = problem(lens.len(), hq, hkv, sq, 200, 64);
        check_cache(&Unmasked, &p, t, &lens);
        check_cache(&CausalSoftcap::new(20.0), &p, t, &lens);
        check_cache(&SlidingWindow { window: 50 }, &p, t, &lens);
        check_cache(&Alibi { slope: 0.02 }, &p, t, &lens);
    }
}

#[test]
fn a_full_cache_is_the_plain_forward() {
    // One length for the whole batch, at capacity: the plain call (the
    // same kernel for Sq <= 32), bit for bit.
    let p = problem(3, 8, 2, 5, 333, 64);
    let x = Inputs::new(&p, 7, 1.0);
    let v = CausalSoftcap::new(30.0);
    let t = CpuTiles::new(64, 64);
    let (mut out, mut lse) = poisoned(p);
    forward_tiled(&v, &p, t, &x.q, &x.k, &x.v, &mut out, &mut lse);
    let (mut out2, mut lse2) = poisoned(p);
    forward_cache_tiled(
        &v,
        &p,
        t,
        CacheLayout::lengths(&[333; 3]),
        &x.q,
        &x.k,
        &x.v,
        &mut out2,
        &mut lse2,
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out), bits(&out2));
    assert_eq!(bits(&lse), bits(&lse2));
}

/// The paged layout of `lens` over `table`.
fn paging<'a>(lens: &'a [usize], table: &'a [usize], page_size: usize) -> CacheLayout<'a> {
    let pages = Some(Pages { table, page_size });
    CacheLayout { lens, pages }
}

/// The cache of `x` (`[B, Hkv, Sk, D]`, lengths `lens`) scattered into
/// pages of `page_size` in a shuffled order, with one spare page of NaN:
/// `(k pages, v pages, table)`, table entries past a length garbage.
fn paged(
    p: &Problem,
    x: &Inputs,
    lens: &[usize],
    page_size: usize,
) -> (Vec<f32>, Vec<f32>, Vec<usize>) {
    let (d, d_v, hkv, cap) = (p.head_dim, p.head_dim_v, p.heads_kv, p.seq_k);
    let max_pages = cap / page_size;
    let pages = p.batch * max_pages + 1;
    // Page `n` of the shuffled order holds (sequence, page) `order[n]`.
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let m = [7, 5, 11, 13]
        .into_iter()
        .find(|&m| gcd(m, pages) == 1)
        .unwrap_or(1);
    let order: Vec<usize> = (0..pages).map(|n| (n * m + 3) % pages).collect();
    let mut kp = vec![f32::NAN; pages * hkv * page_size * d];
    let mut vp = vec![f32::NAN; pages * hkv * page_size * d_v];
    let mut table = vec![usize::MAX; p.batch * max_pages];
    for (page, &logical) in order.iter().enumerate() {
        if logical == pages - 1 {
            continue; // the spare page
        }
        let (b, lp) = (logical / max_pages, logical % max_pages);
        if lp * page_size < lens[b] {
            table[b * max_pages + lp] = page;
        }
        for h in 0..hkv {
            for slot in 0..page_size {
                let from = (b * hkv + h) * cap + lp * page_size + slot;
                let to = (page * hkv + h) * page_size + slot;
                kp[to * d..(to + 1) * d].copy_from_slice(&x.k[from * d..(from + 1) * d]);
                let v = &x.v[from * d_v..(from + 1) * d_v];
                vp[to * d_v..(to + 1) * d_v].copy_from_slice(v);
            }
        }
    }
    (kp, vp, table)
}

#[test]
fn paged_caches_match_the_contiguous_cache() {
    let t = CpuTiles::new(64, 64);
    let lens = [0, 1, 48, 192, 130];
    let p = problem(lens.len(), 8, 2, 3, 192, 64);
    let x = Inputs::new(&p, 0x9a9e, 1.0);
    let v = CausalSoftcap::new(20.0);
    let want = reference_lens(&v, &p, &x, Some(&lens));
    let (mut out, mut lse) = poisoned(p);
    forward_cache_tiled(
        &v,
        &p,
        t,
        CacheLayout::lengths(&lens),
        &x.q,
        &x.k,
        &x.v,
        &mut out,
        &mut lse,
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Pages of whole key tiles: the same blocks, bit for bit; other sizes
    // cut blocks at page boundaries: within rounding.
    for page_size in [64, 192, 48, 16, 96] {
        let (kp, vp, table) = paged(&p, &x, &lens, page_size);
        let (mut po, mut pl) = poisoned(p);
        forward_cache_tiled(
            &v,
            &p,
            t,
            paging(&lens, &table, page_size),
            &x.q,
            &kp,
            &vp,
            &mut po,
            &mut pl,
        );
        let ctx = format!("page size {page_size}");
        assert_close(&format!("out {ctx}"), &po, &want.out, 2e-5);
        assert_close(&format!("lse {ctx}"), &pl, &want.lse, 2e-5);
        if page_size % t.kv == 0 {
            assert_eq!(
                bits(&po),
                bits(&out),
                "{ctx}: out differs from the contiguous cache"
            );
            assert_eq!(
                bits(&pl),
                bits(&lse),
                "{ctx}: lse differs from the contiguous cache"
            );
        }
    }
}

/// Values of another head dim than queries and keys (`Dv ≠ D`, as in
/// DeepSeek's MLA: 192/128 in prefill, 576/512 in absorbed decode, and the
/// pairs 128/64, 64/32 and a wider odd one) through every f32 kernel: the
/// tile forward and backward over several tilings and key chunkings, the
/// decode kernel over key chunks, and KV caches (lengths, pages, the cache
/// backward) with NaN in the spare slots.
#[test]
fn value_head_dims_apart_from_key_head_dims_match_the_reference() {
    // (B, Hq, Hkv, Sq, Sk, D, Dv)
    let shapes = [
        (1, 2, 2, 97, 130, 192, 128),
        (1, 4, 1, 17, 97, 128, 64),
        (2, 2, 1, 130, 33, 64, 32),
        (1, 3, 1, 40, 61, 40, 72),
    ];
    for (n, &(b, hq, hkv, sq, sk, d, dv)) in shapes.iter().enumerate() {
        let p = problem(b, hq, hkv, sq, sk, d).with_head_dim_v(dv);
        let seed = 0xd5 + n as u64;
        check(&CausalSoftcap::new(20.0), &p, CpuTiles::DEFAULT, None, seed);
        check(
            &Alibi { slope: 0.03 },
            &p,
            CpuTiles { q: 7, kv: 13 },
            Some((3, 2)),
            seed,
        );
        check(
            &SlidingWindow { window: 30 },
            &p,
            CpuTiles { q: 16, kv: 32 },
            None,
            seed,
        );
    }
    // Absorbed decode: one query row per head against a latent cache.
    let p = problem(2, 16, 1, 1, 300, 576).with_head_dim_v(512);
    check_decode(&CausalSoftcap::new(20.0), &p, CpuTiles::new(64, 64));
    let p = problem(1, 8, 2, 4, 150, 64).with_head_dim_v(32);
    check_decode(&Alibi { slope: 0.03 }, &p, CpuTiles::new(32, 32));

    let lens = [0usize, 1, 64, 150, 97];
    for (hq, hkv, sq, d, dv) in [(8, 1, 1, 576, 512), (4, 2, 4, 64, 32), (2, 2, 70, 48, 80)] {
        let p = problem(lens.len(), hq, hkv, sq, 150, d).with_head_dim_v(dv);
        check_cache(&CausalSoftcap::new(20.0), &p, CpuTiles::new(64, 64), &lens);
        let mut x = Inputs::new(&p, 0xdcac ^ sq as u64, 1.0);
        x.poison_spare_slots(&p, &lens, f32::NEG_INFINITY);
        check_cache_backward(&SlidingWindow { window: 30 }, &p, &lens, &x);
        // Pages of 30 and of 50 keys (no tile's multiple), shuffled.
        let want = reference_lens(&Unmasked, &p, &x, Some(&lens));
        for page_size in [30, 50] {
            let (kp, vp, table) = paged(&p, &x, &lens, page_size);
            let (mut out, mut lse) = poisoned(p);
            let cache = paging(&lens, &table, page_size);
            forward_cache(&Unmasked, &p, cache, &x.q, &kp, &vp, &mut out, &mut lse).unwrap();
            let ctx = format!("{p:?} pages of {page_size}");
            assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
            assert_close(&format!("lse {ctx}"), &lse, &want.lse, 2e-5);
        }
    }
}

#[test]
fn cache_backward_matches_reference_and_spare_slots_get_zero() {
    // Forward over the cache, then the backward from its out and lse, for
    // short and long query blocks (Sq 4 runs the decode forward, 70 the
    // same through the tile kernels' positions); NaN in the spare slots.
    let lens = [0usize, 1, 64, 150, 97];
    for (hq, hkv, sq) in [(4, 1, 4), (2, 2, 70)] {
        let p = problem(lens.len(), hq, hkv, sq, 150, 32);
        let mut x = Inputs::new(&p, 0xbac4 ^ sq as u64, 1.0);
        x.poison_spare_slots(&p, &lens, f32::NEG_INFINITY);
        check_cache_backward(&CausalSoftcap::new(20.0), &p, &lens, &x);
        check_cache_backward(&SlidingWindow { window: 30 }, &p, &lens, &x);
        check_cache_backward(&Alibi { slope: 0.03 }, &p, &lens, &x);
    }
}

#[track_caller]
fn check_cache_backward<V: crate::Variant>(v: &V, p: &Problem, lens: &[usize], x: &Inputs)
where
    V::Host: HostVariant,
{
    let host = v.host(p).expect("host");
    let want = reference_lens(&host, p, x, Some(lens));
    let (out, lse) = cache_forward(&host, p, CpuTiles::for_variant::<V>(), lens, x);
    let mut g = Grads::poisoned(p);
    g.f32(v, p, Some(lens), x.backward(&out, &lse), &[]);
    let ctx = format!("{} {p:?} lens {lens:?}", V::NAME);
    assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
    assert_close(&format!("dq {ctx}"), &g.dq, &want.dq, 5e-5);
    assert_close(&format!("dk {ctx}"), &g.dk, &want.dk, 5e-5);
    assert_close(&format!("dv {ctx}"), &g.dv, &want.dv, 5e-5);
    g.assert_spare_slots_zero(p, lens, &ctx);
}

#[test]
fn a_16_bit_cache_reads_as_its_widened_copy() {
    // Widening block by block is exact: the same bits as the f32 kernel
    // on the values widened up front, contiguous and paged.
    let t = CpuTiles::new(64, 64);
    let lens = [0usize, 1, 100, 192];
    let p = problem(lens.len(), 8, 2, 2, 192, 64);
    let x = Inputs::new(&p, 0x16, 1.0);
    let v = SlidingWindow { window: 70 };
    let bf: (Vec<half::bf16>, Vec<half::bf16>) = (
        x.k.iter().map(|&y| half::bf16::from_f32(y)).collect(),
        x.v.iter().map(|&y| half::bf16::from_f32(y)).collect(),
    );
    let hf: (Vec<half::f16>, Vec<half::f16>) = (
        x.k.iter().map(|&y| half::f16::from_f32(y)).collect(),
        x.v.iter().map(|&y| half::f16::from_f32(y)).collect(),
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let run = |k: &[f32], vv: &[f32]| {
        let (mut out, mut lse) = poisoned(p);
        forward_cache_tiled(
            &v,
            &p,
            t,
            CacheLayout::lengths(&lens),
            &x.q,
            k,
            vv,
            &mut out,
            &mut lse,
        );
        (bits(&out), bits(&lse))
    };
    let wide_bf: (Vec<f32>, Vec<f32>) = (
        bf.0.iter().map(|y| y.to_f32()).collect(),
        bf.1.iter().map(|y| y.to_f32()).collect(),
    );
    let (mut out, mut lse) = poisoned(p);
    forward_cache_tiled(
        &v,
        &p,
        t,
        CacheLayout::lengths(&lens),
        &x.q,
        &bf.0,
        &bf.1,
        &mut out,
        &mut lse,
    );
    assert_eq!(
        (bits(&out), bits(&lse)),
        run(&wide_bf.0, &wide_bf.1),
        "bf16 cache"
    );

    let wide_hf: (Vec<f32>, Vec<f32>) = (
        hf.0.iter().map(|y| y.to_f32()).collect(),
        hf.1.iter().map(|y| y.to_f32()).collect(),
    );
    // Pages of 32 (half a key tile) holding the f16 cache in order.
    let (max_pages, ps) = (192 / 32, 32);
    let table: Vec<usize> = (0..lens.len() * max_pages).collect();
    let (mut out, mut lse) = poisoned(p);
    let (mut wout, mut wlse) = poisoned(p);
    // Pages [pages, Hkv, ps, D] from [B, Hkv, Sk, D]: page n of sequence s
    // is its keys n·ps .. for every kv head.
    let paged_of = |src: &[f32]| -> Vec<f32> {
        let mut dst = vec![0.0f32; src.len()];
        let d = p.head_dim;
        for s in 0..lens.len() {
            for n in 0..max_pages {
                for h in 0..p.heads_kv {
                    let from = ((s * p.heads_kv + h) * p.seq_k + n * ps) * d;
                    let to = (((s * max_pages + n) * p.heads_kv + h) * ps) * d;
                    dst[to..to + ps * d].copy_from_slice(&src[from..from + ps * d]);
                }
            }
        }
        dst
    };
    let (kp, vp) = (paged_of(&wide_hf.0), paged_of(&wide_hf.1));
    let kp16: Vec<half::f16> = kp.iter().map(|&y| half::f16::from_f32(y)).collect();
    let vp16: Vec<half::f16> = vp.iter().map(|&y| half::f16::from_f32(y)).collect();
    forward_cache_tiled(
        &v,
        &p,
        t,
        paging(&lens, &table, ps),
        &x.q,
        &kp16,
        &vp16,
        &mut out,
        &mut lse,
    );
    forward_cache_tiled(
        &v,
        &p,
        t,
        paging(&lens, &table, ps),
        &x.q,
        &kp,
        &vp,
        &mut wout,
        &mut wlse,
    );
    assert_eq!(
        (bits(&out), bits(&lse)),
        (bits(&wout), bits(&wlse)),
        "f16 pages"
    );
    // And the f16 cache against the f64 reference.
    let xr = Inputs {
        q: x.q.clone(),
        k: wide_hf.0.clone(),
        v: wide_hf.1.clone(),
        dout: x.dout.clone(),
        dlse: x.dlse.clone(),
    };
    let want = reference_lens(&v, &p, &xr, Some(&lens));
    assert_close("f16 pages out", &out, &want.out, 2e-5);
}
