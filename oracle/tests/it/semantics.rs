//! The conventions of docs/equations.md as the oracle implements them: bottom-right causal (E1a),
//! windows, GQA mapping and sums (E1b, E9), varlen with empty sequences, fully masked rows
//! (E1c), `dv ≠ d`, and the ring and zigzag orders (E11, E11a). Comparisons are exact: each
//! pair of computations below performs the same arithmetic, so any difference is a bug.

use attnproof_oracle::online::{ring_arrival_order, ring_block_at, zigzag_chunks};
use attnproof_oracle::{
    AttentionSpec, DenseConfig, Layout, Mask, Mp, Precision, Qkv, backward_f64, forward, forward_f64,
};
use ndarray::{ArrayD, Axis, IxDyn, Slice};

fn tensor(seed: u64, shape: &[usize]) -> ArrayD<f64> {
    attnproof_oracle::inputs::uniform_tensor(seed, shape)
}

const PREC: Precision = Precision(128);

fn mp(t: &ArrayD<f64>) -> ArrayD<Mp> {
    t.mapv(|x| Mp::new(x, PREC))
}

#[test]
fn gqa_equals_attention_with_repeated_kv_heads_and_sums_dk_dv() {
    let (hq, hkv) = (4, 2);
    let gqa = AttentionSpec::dense(2, hq, hkv, 5, 7, 3, 2).with_mask(Mask::Causal);
    let mha = AttentionSpec { n_heads_kv: hq, ..gqa.clone() };
    let (q, k, v, g) =
        (tensor(1, &[2, hq, 5, 3]), tensor(2, &[2, hkv, 7, 3]), tensor(3, &[2, hkv, 7, 2]), tensor(4, &[2, hq, 5, 2]));
    // Query head h reads KV head h / (Hq/Hkv): heads 0,1 → 0 and 2,3 → 1.
    let repeat = |t: &ArrayD<f64>| t.select(Axis(1), &[0, 0, 1, 1]);
    let a = backward_f64(&gqa, q.view(), k.view(), v.view(), g.view()).unwrap();
    let b = backward_f64(&mha, q.view(), repeat(&k).view(), repeat(&v).view(), g.view()).unwrap();
    assert_eq!(a.forward, b.forward);
    assert_eq!(a.dq, b.dq);
    for kv in 0..hkv {
        for (grouped, repeated) in [(&a.dk, &b.dk), (&a.dv, &b.dv)] {
            let sum = &repeated.index_axis(Axis(1), 2 * kv) + &repeated.index_axis(Axis(1), 2 * kv + 1);
            assert_eq!(grouped.index_axis(Axis(1), kv), sum);
        }
    }
}

#[test]
fn each_query_head_is_one_head_attention_over_its_own_kv_head() {
    // Six query heads over three KV heads, and six over six: head h of the batched call equals a one-head call on
    // query head h and KV head h / G alone, so no head can read another group's keys.
    for hkv in [3, 6] {
        let hq = 6;
        let spec = AttentionSpec::dense(1, hq, hkv, 4, 5, 3, 2).with_mask(Mask::Causal);
        let (q, k, v) = (tensor(5, &[1, hq, 4, 3]), tensor(6, &[1, hkv, 5, 3]), tensor(7, &[1, hkv, 5, 2]));
        let all = forward_f64(&spec, q.view(), k.view(), v.view()).unwrap();
        let one = AttentionSpec { n_heads_q: 1, n_heads_kv: 1, ..spec.clone() };
        let head = |t: &ArrayD<f64>, h: usize| t.slice_axis(Axis(1), Slice::from(h..h + 1)).to_owned();
        for h in 0..hq {
            let kv = h / (hq / hkv);
            let alone = forward_f64(&one, head(&q, h).view(), head(&k, kv).view(), head(&v, kv).view()).unwrap();
            assert_eq!(head(&all.o, h), alone.o, "head {h} of {hq} over {hkv}");
            assert_eq!(head(&all.lse, h), alone.lse, "head {h} of {hq} over {hkv}");
        }
    }
}

#[test]
fn varlen_equals_each_sequence_alone_including_empty_ones() {
    // Sequences (Lq, Lk): (3, 5), (0, 0), (2, 0), (0, 4), (4, 4).
    let lens = [(3usize, 5usize), (0, 0), (2, 0), (0, 4), (4, 4)];
    let cu = |f: fn(&(usize, usize)) -> usize| {
        std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, l| {
                *acc += f(l) as i32;
                Some(*acc)
            }))
            .collect::<Vec<i32>>()
    };
    let (cu_q, cu_k) = (cu(|l| l.0), cu(|l| l.1));
    let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    let spec = AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: cu_q.clone(), cu_seqlens_k: cu_k.clone() },
        ..AttentionSpec::dense(1, 2, 1, 0, 0, 3, 2).with_mask(Mask::Causal)
    };
    let (q, k, v, g) = (tensor(5, &[tq, 2, 3]), tensor(6, &[tk, 1, 3]), tensor(7, &[tk, 1, 2]), tensor(8, &[tq, 2, 2]));
    let all = backward_f64(&spec, q.view(), k.view(), v.view(), g.view()).unwrap();
    for (b, &(lq, lk)) in lens.iter().enumerate() {
        let one = AttentionSpec { layout: Layout::Dense { batch: 1, len_q: lq, len_k: lk }, ..spec.clone() };
        let rows = |t: &ArrayD<f64>, cu: &[i32]| {
            let s = t.slice_axis(Axis(0), Slice::from(cu[b] as usize..cu[b + 1] as usize));
            s.permuted_axes(IxDyn(&[1, 0, 2])).insert_axis(Axis(0)).to_owned()
        };
        let r = backward_f64(
            &one,
            rows(&q, &cu_q).view(),
            rows(&k, &cu_k).view(),
            rows(&v, &cu_k).view(),
            rows(&g, &cu_q).view(),
        )
        .unwrap();
        assert_eq!(rows(&all.forward.o, &cu_q), r.forward.o, "O of sequence {b}");
        assert_eq!(rows(&all.dq, &cu_q), r.dq, "dQ of sequence {b}");
        assert_eq!(rows(&all.dk, &cu_k), r.dk, "dK of sequence {b}");
        assert_eq!(rows(&all.dv, &cu_k), r.dv, "dV of sequence {b}");
        let lse = all.forward.lse.slice_axis(Axis(1), Slice::from(cu_q[b] as usize..cu_q[b + 1] as usize));
        assert_eq!(lse.insert_axis(Axis(0)), r.forward.lse, "LSE of sequence {b}");
        if lk == 0 {
            assert!(r.forward.lse.iter().all(|x| *x == f64::NEG_INFINITY));
        }
    }
}

#[test]
fn causal_is_bottom_right_aligned() {
    // Lq = 3 < Lk = 5: query i sees keys 0..=i+2; the last query sees every key.
    let causal = AttentionSpec::dense(1, 1, 1, 3, 5, 2, 2).with_mask(Mask::Causal);
    let (q, k, v) = (mp(&tensor(9, &[1, 1, 3, 2])), mp(&tensor(10, &[1, 1, 5, 2])), mp(&tensor(11, &[1, 1, 5, 2])));
    let run = |spec: &AttentionSpec, k: &ArrayD<Mp>, v: &ArrayD<Mp>| {
        forward(spec, Qkv { q: q.view(), k: k.view(), v: v.view() }, DenseConfig::default(), PREC).unwrap()
    };
    let full = run(&causal, &k, &v);
    for i in 0..3 {
        let keys = i + 3;
        let prefix = AttentionSpec::dense(1, 1, 1, 3, keys, 2, 2);
        let cut = |t: &ArrayD<Mp>| t.slice_axis(Axis(2), Slice::from(0..keys)).to_owned();
        let unmasked = run(&prefix, &cut(&k), &cut(&v));
        assert_eq!(full.o.index_axis(Axis(2), i), unmasked.o.index_axis(Axis(2), i), "row {i}");
        assert_eq!(full.lse[[0, 0, i]], unmasked.lse[[0, 0, i]], "row {i}");
    }
}

#[test]
fn rows_above_the_diagonal_are_fully_masked_when_lq_exceeds_lk() {
    // Lq = 5 > Lk = 2: rows 0..3 see nothing (E1c): O = 0, LSE = −∞, zero gradients, no NaN.
    let spec = AttentionSpec::dense(1, 2, 2, 5, 2, 3, 4).with_mask(Mask::Causal);
    let r = backward_f64(
        &spec,
        tensor(12, &[1, 2, 5, 3]).view(),
        tensor(13, &[1, 2, 2, 3]).view(),
        tensor(14, &[1, 2, 2, 4]).view(),
        tensor(15, &[1, 2, 5, 4]).view(),
    )
    .unwrap();
    for h in 0..2 {
        for i in 0..3 {
            assert_eq!(r.forward.lse[[0, h, i]], f64::NEG_INFINITY);
            assert!(r.forward.o.slice(ndarray::s![0, h, i, ..]).iter().all(|x| *x == 0.0));
            assert!(r.dq.slice(ndarray::s![0, h, i, ..]).iter().all(|x| *x == 0.0));
            assert_eq!(r.delta[[0, h, i]], 0.0);
        }
        assert!(r.forward.lse[[0, h, 3]].is_finite());
    }
    for t in [&r.forward.o, &r.dq, &r.dk, &r.dv] {
        assert!(t.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn a_zero_width_window_attends_to_the_diagonal_only() {
    let spec = AttentionSpec::dense(1, 1, 1, 4, 4, 2, 3).with_mask(Mask::Window { left: 0, right: 0 });
    let v = tensor(16, &[1, 1, 4, 3]);
    let r = forward_f64(&spec, tensor(17, &[1, 1, 4, 2]).view(), tensor(18, &[1, 1, 4, 2]).view(), v.view()).unwrap();
    assert_eq!(r.o, v);
}

#[test]
fn a_window_wider_than_the_sequence_is_no_mask() {
    let base = AttentionSpec::dense(1, 1, 1, 4, 6, 2, 3);
    let wide = base.clone().with_mask(Mask::Window { left: 6, right: 6 });
    let narrow = base.clone().with_mask(Mask::Window { left: 6, right: 1 });
    let (q, k, v) = (tensor(19, &[1, 1, 4, 2]), tensor(20, &[1, 1, 6, 2]), tensor(21, &[1, 1, 6, 3]));
    let none = forward_f64(&base, q.view(), k.view(), v.view()).unwrap();
    assert_eq!(forward_f64(&wide, q.view(), k.view(), v.view()).unwrap(), none);
    // The right edge matters: row 0 (aligned to key 2) must not see keys 4, 5.
    assert_ne!(forward_f64(&narrow, q.view(), k.view(), v.view()).unwrap().o, none.o);
}

#[test]
fn and_of_masks_equals_the_equivalent_predicate() {
    let mask = Mask::And(vec![Mask::Causal, Mask::Window { left: 1, right: 0 }]);
    let pred = Mask::Predicate(attnproof_oracle::Predicate {
        name: "causal window of 2".into(),
        visible: std::sync::Arc::new(|p: attnproof_oracle::Pair| {
            let (i, j) = (p.aligned_query(), p.key as i64);
            j <= i && j >= i - 1
        }),
    });
    assert_eq!(mask.matrix(5, 7), pred.matrix(5, 7));
    assert_eq!(mask.matrix(7, 5), pred.matrix(7, 5));
}

#[test]
fn value_dim_may_differ_from_head_dim() {
    let spec = AttentionSpec::dense(1, 1, 1, 3, 4, 5, 2);
    let (q, k, v, g) =
        (tensor(22, &[1, 1, 3, 5]), tensor(23, &[1, 1, 4, 5]), tensor(24, &[1, 1, 4, 2]), tensor(25, &[1, 1, 3, 2]));
    let r = backward_f64(&spec, q.view(), k.view(), v.view(), g.view()).unwrap();
    assert_eq!(r.forward.o.shape(), &[1, 1, 3, 2]);
    assert_eq!((r.dq.shape(), r.dk.shape(), r.dv.shape()), (&[1, 1, 3, 5][..], &[1, 1, 4, 5][..], &[1, 1, 4, 2][..]));
}

#[test]
fn the_ring_block_at_any_step_is_the_home_block_minus_the_step_modulo_the_ring() {
    // Steps past one full turn occur (a worker asks for the owner after its last hop): (g − t) mod G for any t.
    for devices in 1..=6usize {
        for g in 0..devices {
            for step in 0..4 * devices {
                let expected = (g as i64 - step as i64).rem_euclid(devices as i64) as usize;
                assert_eq!(ring_block_at(g, step, devices), expected, "device {g} of {devices}, step {step}");
            }
        }
    }
}

#[test]
fn ring_orders_are_permutations_starting_at_home() {
    for devices in 1..=8 {
        for g in 0..devices {
            let order = ring_arrival_order(g, devices);
            assert_eq!(order[0], g);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..devices).collect::<Vec<_>>());
            // One hop per step: the block held at step t + 1 is the one the previous device held at t.
            for t in 1..devices {
                assert_eq!(order[t], ring_arrival_order((g + devices - 1) % devices, devices)[t - 1]);
            }
        }
        let mut chunks: Vec<usize> = (0..devices).flat_map(|g| zigzag_chunks(g, devices)).collect();
        chunks.sort_unstable();
        assert_eq!(chunks, (0..2 * devices).collect::<Vec<_>>());
    }
}

#[test]
fn key_ranges_contain_every_visible_key_and_are_tight_for_named_masks() {
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window { left: 2, right: 1 },
        Mask::And(vec![Mask::Causal, Mask::Window { left: 3, right: 0 }]),
    ];
    for mask in &masks {
        for (len_q, len_k) in [(5, 5), (3, 8), (8, 3), (0, 4), (4, 0)] {
            let m = mask.matrix(len_q, len_k);
            for i in 0..len_q {
                let visible: Vec<usize> = (0..len_k).filter(|&j| m[[i, j]]).collect();
                let range = mask.key_range(i, len_q, len_k);
                let expected = visible.first().map_or(range.start..range.start, |&lo| lo..visible.last().unwrap() + 1);
                assert_eq!(
                    range.clone().filter(|&j| m[[i, j]]).count(),
                    visible.len(),
                    "{mask:?} row {i} misses a key"
                );
                assert_eq!(range.len(), expected.len(), "{mask:?} ({len_q}, {len_k}) row {i}: {range:?} is not tight");
            }
        }
    }
}
