//! NSA's compressed attention (E18) on the GPU: no kernel of its own. Token `t` attends, with one softmax, to the
//! compressed keys and values of the windows that have ended at or before it (window `c` covers tokens
//! `c·s ..= c·s + l − 1`, visible iff `c·s + l − 1 ≤ t`), which is the dense attention of the layer's queries over the
//! compressed keys ([`super::compress`]) under the spec mask `Mask::StridedCausal { len: l, stride: s }`.
//! [`compressed_spec`] builds that spec from the layer's: the queries' layout unchanged, the keys' lengths the window
//! counts (dense `W` of the common length, varlen `cu_seqlens_k` = [`super::compress::window_offsets`]), the layer's
//! scale. The dense forward and backward then compute the branch's `o_cmp`, its `LSE_cmp` (which the selection
//! recomputes its probabilities from) and the gradients with respect to `q`, `k̃` and `ṽ`; the kernels evaluate the
//! strided diagonal `⌊(t + 1 − l)/s⌋` exactly (`Diagonal` in `gpu/kernels/common.cuh`), and the general suites draw the
//! mask for every kernel. The unit tests show in MPFR that the spec gives the oracle's `compressed_attention`, and that
//! a window visible one token early is caught.

use attnproof_oracle::nsa::NsaConfig;
use attnproof_oracle::{AttentionSpec, Layout};

use super::check_layer;
use super::compress::{window_counts, window_offsets};
use crate::error::GpuError;

/// The spec of NSA's compressed attention for a layer of spec `spec` (causal self-attention) under `config`: queries
/// as in `spec`, keys the complete compression windows of each sequence, the mask `config.compressed_mask()` and
/// `config.scale`. A spec that is not causal self-attention, or an invalid configuration, is a typed error.
pub fn compressed_spec(spec: &AttentionSpec, config: &NsaConfig) -> Result<AttentionSpec, GpuError> {
    config.validate()?;
    check_layer(spec)?;
    let layout = match &spec.layout {
        Layout::Dense { batch, len_q, .. } => {
            let windows = window_counts(spec, config)?.first().copied().unwrap_or(0);
            Layout::Dense { batch: *batch, len_q: *len_q, len_k: windows }
        }
        Layout::Varlen { cu_seqlens_q, .. } => {
            Layout::Varlen { cu_seqlens_q: cu_seqlens_q.clone(), cu_seqlens_k: window_offsets(spec, config)? }
        }
    };
    Ok(AttentionSpec { layout, mask: config.compressed_mask(), scale: config.scale, ..spec.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnproof_oracle::nsa::{NsaInputs, complete_windows, compress, compressed_attention};
    use attnproof_oracle::{DenseConfig, Mask, Mp, Precision, Qkv, Real, forward};
    use ndarray::{Array3, ArrayD, Axis};

    /// The compressed spec's dense attention over the oracle's compressed keys equals the oracle's compressed branch
    /// to 200 bits at 256 (the two sum in other orders), for the paper's overlapping windows scaled down, adjacent
    /// ones, gapped ones and windows longer than the sequence, with GQA; a mask that shows each window one token
    /// early is caught wherever a window ends inside the sequence.
    #[test]
    fn the_compressed_spec_gives_the_oracles_compressed_branch() {
        let precision = Precision(256);
        let (len, n_heads_q, n_heads_kv, d, dv) = (23, 4, 2, 3, 2);
        let values = attnproof_oracle::inputs::uniform(9, len * (n_heads_q * d + n_heads_kv * (d + dv)));
        let (q, rest) = values.split_at(len * n_heads_q * d);
        let (k, v) = rest.split_at(len * n_heads_kv * d);
        let mp = |shape: (usize, usize, usize), x: &[f64]| {
            Array3::from_shape_vec(shape, x.iter().map(|&y| Mp::new(y, precision)).collect::<Vec<_>>()).unwrap()
        };
        let (q, k, v) = (mp((len, n_heads_q, d), q), mp((len, n_heads_kv, d), k), mp((len, n_heads_kv, dv), v));
        let layer = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, len as i32], cu_seqlens_k: vec![0, len as i32] },
            ..AttentionSpec::dense(1, n_heads_q, n_heads_kv, 1, 1, d, dv).with_mask(Mask::Causal)
        };
        for (compress_len, compress_stride) in [(4, 2), (3, 3), (2, 5), (1, 1), (30, 4)] {
            let config = NsaConfig { compress_len, compress_stride, ..NsaConfig::default() };
            let inputs = NsaInputs { q: q.view(), k: k.view(), v: v.view() };
            let branch = compressed_attention(inputs, &config, precision).expect("the oracle's compressed branch");
            // The compressed keys and values `[W, Hkv, cols]`, as the compression kernel lays them out (varlen).
            let compressed = |x: &Array3<Mp>, map| {
                let heads: Vec<_> = (0..n_heads_kv)
                    .map(|h| compress(x.index_axis(Axis(1), h), map, &config, precision).expect("compress"))
                    .collect();
                let views: Vec<_> = heads.iter().map(|a| a.view()).collect();
                ndarray::stack(Axis(1), &views).expect("stack the KV heads")
            };
            let (k_cmp, v_cmp) = (compressed(&k, &config.compress_keys), compressed(&v, &config.compress_values));
            let spec = compressed_spec(&layer, &config).unwrap();
            let run = |spec: &AttentionSpec| {
                let qkv = Qkv { q: q.view().into_dyn(), k: k_cmp.view().into_dyn(), v: v_cmp.view().into_dyn() };
                let out: ArrayD<Mp> =
                    forward(spec, qkv, DenseConfig::default(), precision).expect("the dense forward").o;
                out
            };
            let largest_difference = |dense: &ArrayD<Mp>| {
                assert_eq!(dense.shape(), branch.o.view().into_dyn().shape());
                dense
                    .iter()
                    .zip(branch.o.iter())
                    .map(|(a, b)| (a.clone() - b.clone()).abs().to_f64() / b.abs().to_f64().max(1.0))
                    .fold(0.0, f64::max)
            };
            let windows = k_cmp.dim().0;
            assert_eq!(
                windows,
                complete_windows(len, compress_len, compress_stride).unwrap(),
                "l = {compress_len}, s = {compress_stride}"
            );
            assert!(largest_difference(&run(&spec)) <= 2f64.powi(-200), "l = {compress_len}, s = {compress_stride}");
            if windows > 0 && compress_len > 1 {
                let early = AttentionSpec {
                    mask: Mask::StridedCausal { len: compress_len - 1, stride: compress_stride },
                    ..spec.clone()
                };
                assert!(
                    largest_difference(&run(&early)) > 2f64.powi(-20),
                    "l = {compress_len}, s = {compress_stride}: a window seen one token early went unseen"
                );
            }
        }
    }

    #[test]
    fn the_keys_are_each_sequences_complete_windows() {
        let paper = NsaConfig::default();
        let dense = AttentionSpec::dense(2, 4, 2, 100, 100, 64, 64).with_mask(Mask::Causal);
        let spec = compressed_spec(&dense, &paper).unwrap();
        assert!(matches!(spec.layout, Layout::Dense { batch: 2, len_q: 100, len_k: 5 }), "{:?}", spec.layout);
        assert!(matches!(spec.mask, Mask::StridedCausal { len: 32, stride: 16 }));
        let cu = vec![0, 31, 31, 63, 163];
        let varlen = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: cu.clone(), cu_seqlens_k: cu.clone() },
            ..dense.clone()
        };
        let spec = compressed_spec(&varlen, &paper).unwrap();
        match spec.layout {
            Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
                assert_eq!(cu_seqlens_q, cu);
                assert_eq!(cu_seqlens_k, [0, 0, 0, 1, 6]);
            }
            other => panic!("{other:?}"),
        }
        let cross = AttentionSpec::dense(1, 2, 1, 64, 65, 64, 64).with_mask(Mask::Causal);
        assert!(matches!(compressed_spec(&cross, &paper), Err(GpuError::Unsupported { argument: "layout", .. })));
        let open = dense.clone().with_mask(Mask::None);
        assert!(matches!(compressed_spec(&open, &paper), Err(GpuError::Unsupported { argument: "mask", .. })));
        let zero = NsaConfig { compress_stride: 0, ..paper };
        assert!(compressed_spec(&dense, &zero).is_err());
    }
}
