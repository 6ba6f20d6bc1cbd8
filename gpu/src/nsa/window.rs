//! NSA's sliding-window branch (E18) on the GPU: no kernel of its own. Query `t` attends to tokens
//! `max(0, t + 1 − w) ..= t` (the oracle's `nsa::window_attention`, `w` = `NsaConfig::window`), which is the dense
//! attention of a self-attention spec under the causal mask narrowed to `w − 1` keys on the left. [`window_spec`]
//! builds that spec from the layer's; the dense forward and backward (`crate::flash_forward_device`,
//! `crate::flash_backward_device`), already verified for such masks by the general suites, then compute the branch
//! and its gradients. The unit tests show in MPFR that the spec's mask gives the oracle's window branch.

use attnproof_oracle::nsa::NsaConfig;
use attnproof_oracle::{AttentionSpec, Mask};

use super::check_layer;
use crate::error::GpuError;

/// The spec of NSA's window branch for a layer of spec `spec` (causal self-attention: the mask `Causal`, every
/// sequence's query and key lengths equal) under `config`: the causal mask narrowed to `config.window − 1` keys to
/// the left of the diagonal, and `config.scale`. A window of 0 (the branch disabled, its output 0 by E1c) or a spec
/// that is not causal self-attention is a typed error.
pub fn window_spec(spec: &AttentionSpec, config: &NsaConfig) -> Result<AttentionSpec, GpuError> {
    config.validate()?;
    check_layer(spec)?;
    if config.window == 0 {
        return Err(GpuError::Unsupported {
            argument: "window",
            reason: "a window of 0 disables the branch (its output is 0); leave the branch out instead".into(),
        });
    }
    Ok(AttentionSpec {
        mask: Mask::And(vec![Mask::Causal, Mask::Window { left: config.window - 1, right: 0 }]),
        scale: config.scale,
        ..spec.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::nsa::{NsaInputs, window_attention};
    use attnproof_oracle::{DenseConfig, Layout, Mp, Precision, Qkv, Real, forward};
    use ndarray::{Array3, ArrayD};

    /// The window spec's dense attention equals the oracle's window branch to 200 bits at 256 (the two sum in other
    /// orders), for windows of 1 token, 2, inside the sequence, exactly the sequence and beyond it, and GQA.
    #[test]
    fn the_window_spec_gives_the_oracles_window_branch() {
        let precision = Precision(256);
        let (len, n_heads_q, n_heads_kv, d, dv) = (9, 4, 2, 3, 2);
        let values = attnproof_oracle::inputs::uniform(5, len * (n_heads_q * d + n_heads_kv * (d + dv)));
        let (q, rest) = values.split_at(len * n_heads_q * d);
        let (k, v) = rest.split_at(len * n_heads_kv * d);
        let mp = |shape: (usize, usize, usize), x: &[f64]| {
            Array3::from_shape_vec(shape, x.iter().map(|&y| Mp::new(y, precision)).collect::<Vec<_>>()).unwrap()
        };
        let (q, k, v) = (mp((len, n_heads_q, d), q), mp((len, n_heads_kv, d), k), mp((len, n_heads_kv, dv), v));
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, len as i32], cu_seqlens_k: vec![0, len as i32] },
            ..AttentionSpec::dense(1, n_heads_q, n_heads_kv, 1, 1, d, dv).with_mask(Mask::Causal)
        };
        for window in [1, 2, 4, len, len + 3] {
            let config = NsaConfig { window, ..NsaConfig::default() };
            let branch = window_attention(NsaInputs { q: q.view(), k: k.view(), v: v.view() }, &config, precision)
                .expect("the oracle's window branch");
            let qkv = Qkv { q: q.view().into_dyn(), k: k.view().into_dyn(), v: v.view().into_dyn() };
            let dense = forward(&window_spec(&spec, &config).unwrap(), qkv, DenseConfig::default(), precision)
                .expect("the dense forward");
            let dense: ArrayD<Mp> = dense.o;
            assert_eq!(dense.shape(), branch.view().into_dyn().shape());
            let largest_difference = |dense: &ArrayD<Mp>| {
                dense
                    .iter()
                    .zip(branch.iter())
                    .map(|(a, b)| (a.clone() - b.clone()).abs().to_f64() / b.abs().to_f64().max(1.0))
                    .fold(0.0, f64::max)
            };
            assert!(largest_difference(&dense) <= 2f64.powi(-200), "window {window}");
            // One key more on the left (the off-by-one a window mask invites) is caught wherever it adds a key.
            if window < len {
                let wider = AttentionSpec {
                    mask: Mask::And(vec![Mask::Causal, Mask::Window { left: window, right: 0 }]),
                    ..window_spec(&spec, &config).unwrap()
                };
                let qkv = Qkv { q: q.view().into_dyn(), k: k.view().into_dyn(), v: v.view().into_dyn() };
                let off = forward(&wider, qkv, DenseConfig::default(), precision).expect("the dense forward");
                assert!(largest_difference(&off.o) > 2f64.powi(-20), "window {window}: one key more went unseen");
            }
        }
    }

    #[test]
    fn only_causal_self_attention_with_a_window_is_taken() {
        let spec = AttentionSpec::dense(1, 2, 1, 64, 64, 64, 64).with_mask(Mask::Causal);
        let paper = NsaConfig::default();
        let w = window_spec(&spec, &paper).unwrap();
        assert!(matches!(&w.mask, Mask::And(parts)
            if matches!(parts[..], [Mask::Causal, Mask::Window { left: 511, right: 0 }])));
        let closed = NsaConfig { window: 0, ..paper.clone() };
        assert!(matches!(window_spec(&spec, &closed), Err(GpuError::Unsupported { argument: "window", .. })));
        let cross = AttentionSpec::dense(1, 2, 1, 64, 65, 64, 64).with_mask(Mask::Causal);
        assert!(matches!(window_spec(&cross, &paper), Err(GpuError::Unsupported { argument: "layout", .. })));
        let open = spec.clone().with_mask(Mask::None);
        assert!(matches!(window_spec(&open, &paper), Err(GpuError::Unsupported { argument: "mask", .. })));
    }
}
