//! Input generators for fuzzing: Gaussian values (Box–Muller over the oracle's deterministic
//! uniform source), heavy tails, peaked rows, the maximum placed in the last KV tile, values
//! with a non-zero mean and mixed signs, and logit scales up to 100 (which overflow f32 and f64
//! without max subtraction). Values are rounded to the storage type, so the oracle and the
//! candidate see the same numbers.

use attnproof_oracle::AttentionSpec;
use attnproof_oracle::inputs::uniform;
use attnproof_oracle::spec::Operand;
use attnproof_reference::Element;
use ndarray::{ArrayD, IxDyn};

use crate::flash::Case;

/// The shape of the value distribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Distribution {
    /// Standard normal entries.
    Gaussian,
    /// Normal divided by `sqrt(u)`, `u` uniform in `(0, 1]`, clipped at ±8: a Student-t-like tail.
    HeavyTail,
    /// Gaussian, and every query row has one key aligned with it (one dominant logit per row).
    Peaked,
    /// Gaussian, and the last key is aligned with the sum of the queries: the row maximum tends
    /// to sit in the last KV tile.
    MaxInLastTile,
}

/// How a case's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValueProfile {
    /// Distribution of Q, K, V.
    pub distribution: Distribution,
    /// Queries are multiplied by this, so logits have roughly this standard deviation.
    pub logit_scale: f64,
    /// Added to every value (V with a non-zero mean; Gaussian V has mixed signs).
    pub value_mean: f64,
}

impl ValueProfile {
    /// Standard normal Q, K, V with logits of unit scale and zero-mean values: the plain draw of a test that is about
    /// something other than the values.
    pub const GAUSSIAN: ValueProfile =
        ValueProfile { distribution: Distribution::Gaussian, logit_scale: 1.0, value_mean: 0.0 };
}

/// `n` standard normal values from `seed`.
pub fn gaussian(seed: u64, n: usize) -> Vec<f64> {
    let u = uniform(seed, 2 * n);
    (0..n)
        .map(|i| {
            let u1 = (u[2 * i] + 1.0) / 2.0; // [0, 1)
            let u2 = (u[2 * i + 1] + 1.0) / 2.0;
            (-2.0 * (1.0 - u1).ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        })
        .collect()
}

pub(crate) fn draw(seed: u64, n: usize, distribution: Distribution) -> Vec<f64> {
    let g = gaussian(seed, n);
    match distribution {
        Distribution::HeavyTail => {
            let u = uniform(seed ^ 0x5555, n);
            g.iter().zip(u).map(|(x, u)| (x / ((u + 1.0) / 2.0).max(1e-3).sqrt()).clamp(-8.0, 8.0)).collect()
        }
        _ => g,
    }
}

/// A case for `spec` under `profile`, values rounded to `T`.
pub fn make_case<T: Element>(spec: &AttentionSpec, profile: ValueProfile, seed: u64) -> Case<T> {
    let shape = |op| spec.expected_shape(op);
    let tensor = |op, salt: u64, factor: f64, offset: f64| {
        let s = shape(op);
        let n = s.iter().product();
        let data = draw(seed.wrapping_mul(31).wrapping_add(salt), n, profile.distribution)
            .into_iter()
            .map(|x| x * factor + offset)
            .collect();
        ArrayD::from_shape_vec(IxDyn(&s), data).expect("sizes agree")
    };
    let mut q = tensor(Operand::Q, 1, profile.logit_scale, 0.0);
    let mut k = tensor(Operand::K, 2, 1.0, 0.0);
    let v = tensor(Operand::V, 3, 1.0, profile.value_mean);
    match profile.distribution {
        Distribution::Peaked => align_keys_with_queries(spec, &q, &mut k),
        Distribution::MaxInLastTile => align_last_key(spec, &q, &mut k),
        _ => {}
    }
    // Keep logits at the requested scale however the keys were aligned.
    if profile.logit_scale == 0.0 {
        q.fill(0.0);
    }
    let round = |t: ArrayD<f64>| t.mapv(|x| T::from_f32(x as f32));
    Case { spec: spec.clone(), q: round(q), k: round(k), v: round(v) }
}

/// For each sequence and KV head, key `i mod Lk` takes the direction of query row `i` of the
/// group's first query head, normalized to the key scale: row `i` gets one dominant logit.
fn align_keys_with_queries(spec: &AttentionSpec, q: &ArrayD<f64>, k: &mut ArrayD<f64>) {
    for seq in spec.sequences() {
        if seq.len_k == 0 {
            continue;
        }
        for kv in 0..spec.n_heads_kv {
            let qh = spec.head_rows(q.view(), &seq, kv * spec.group_size(), false).to_owned();
            let mut kh = k.slice_mut(spec.head_slice(&seq, kv, true));
            for i in 0..seq.len_q.min(seq.len_k) {
                let norm = qh.row(i).iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
                let target = (spec.head_dim as f64).sqrt() * 1.5;
                for c in 0..spec.head_dim {
                    kh[[i, c]] = qh[[i, c]] / norm * target;
                }
            }
        }
    }
}

/// For each sequence and KV head, the last key takes the direction of the sum of the group's
/// first head's queries.
fn align_last_key(spec: &AttentionSpec, q: &ArrayD<f64>, k: &mut ArrayD<f64>) {
    for seq in spec.sequences() {
        if seq.len_k == 0 || seq.len_q == 0 {
            continue;
        }
        for kv in 0..spec.n_heads_kv {
            let qh = spec.head_rows(q.view(), &seq, kv * spec.group_size(), false).to_owned();
            let sum: Vec<f64> = (0..spec.head_dim).map(|c| qh.column(c).sum()).collect();
            let norm = sum.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
            let mut kh = k.slice_mut(spec.head_slice(&seq, kv, true));
            for (c, s) in sum.iter().enumerate() {
                kh[[seq.len_k - 1, c]] = s / norm * (spec.head_dim as f64).sqrt() * 1.5;
            }
        }
    }
}

/// An upstream gradient `dO` for `spec` (Gaussian, rounded to `T`).
pub fn make_d_out<T: Element>(spec: &AttentionSpec, seed: u64) -> ArrayD<T> {
    let shape = spec.expected_shape(Operand::O);
    let n = shape.iter().product();
    let data = gaussian(seed.wrapping_mul(37).wrapping_add(5), n).into_iter().map(|x| T::from_f32(x as f32)).collect();
    ArrayD::from_shape_vec(IxDyn(&shape), data).expect("sizes agree")
}

/// A small xorshift64 stream for drawing index lists (NSA's block lists, DSA's token lists, the token lists of
/// `check`'s cases) without a random-number dependency.
pub struct ListStream(u64);

impl ListStream {
    /// The stream of `seed` (any seed, zero included).
    pub fn new(seed: u64) -> Self {
        ListStream(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// The next 64 bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
    /// `k` distinct elements of `from`, ascending.
    pub fn pick(&mut self, mut from: Vec<usize>, k: usize) -> Vec<usize> {
        let k = k.min(from.len());
        for i in 0..k {
            let j = i + self.below(from.len() - i);
            from.swap(i, j);
        }
        from.truncate(k);
        from.sort_unstable();
        from
    }
}
