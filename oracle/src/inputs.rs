//! Deterministic pseudo-random inputs (xorshift64), for examples, benchmarks and tests that
//! need fixed, reproducible tensors without a random-number dependency.

use ndarray::{ArrayD, IxDyn};

/// `n` values uniform in `[-1, 1)` from `seed`; the same seed always gives the same values.
pub fn uniform(seed: u64, n: usize) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// A tensor of `shape` filled with [`uniform`] values.
pub fn uniform_tensor(seed: u64, shape: &[usize]) -> ArrayD<f64> {
    ArrayD::from_shape_vec(IxDyn(shape), uniform(seed, shape.iter().product())).expect("length matches the shape")
}
