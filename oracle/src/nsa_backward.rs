//! The NSA layer's backward (E18, each branch by E6–E10): the gradients of the gated sum of the compressed, selected
//! and sliding-window branches with respect to Q, K, V, the gate logits and the parameters of the compression maps
//! φ_K and φ_V, with the selection held fixed (top-n is piecewise constant in its inputs, so it has no gradient).
//! Each map is one parameter shared by every KV head, so its gradient is the sum over the KV heads, in ascending
//! order, of [`compress_backward`]'s per-head gradient ([`MapGradient::add`]); the mean has none
//! ([`MapGradient::Mean`]). `proofs::nsa::layer_map_gradients_match_finite_differences` checks that sum.
//!
//! Each branch is dense attention under its own visibility, so its backward is [`backward_with_visibility`] on a
//! one-sequence problem whose keys are the branch's: the compressed keys and values `[W, Hkv, ·]` under the strided
//! causal mask (then [`compress_backward`] carries `dK̃`, `dṼ` back onto the tokens of every window, per KV head), the
//! tokens under `causal ∧ block listed` for the selected branch, and under the window for the last. The branches'
//! upstream gradients are the gated sum's ([`gate_combine_backward`]), and Q, K and V collect the three branches'
//! gradients in branch order.

use ndarray::{Array2, Array3, ArrayView3, Axis, Zip};

use crate::attention::{Qkv, backward_with_visibility};
use crate::dense::DenseConfig;
use crate::error::OracleError;
use crate::nsa::{
    Compression, MapGradient, NsaConfig, NsaInputs, compress, compress_backward, compressed_attention,
    gate_combine_backward, selected_attention, selected_tokens, selection_blocks, window_attention, window_tokens,
};
use crate::real::Real;
use crate::spec::{AttentionSpec, Layout, Mask, Sequence};

/// The gradients of the NSA layer for an upstream gradient `dO` `[T, Hq, dv]`.
#[derive(Clone, Debug, PartialEq)]
pub struct NsaGradients<S> {
    /// `∂L/∂Q` `[T, Hq, d]`.
    pub dq: Array3<S>,
    /// `∂L/∂K` `[T, Hkv, d]`: summed over the group's heads and the three branches.
    pub dk: Array3<S>,
    /// `∂L/∂V` `[T, Hkv, dv]`.
    pub dv: Array3<S>,
    /// `∂L/∂x` of the gate logits `[T, Hq, 3]`.
    pub d_gate_logits: Array3<S>,
    /// `∂L/∂φ_K`: the gradient of the keys' compression map's parameters (`config.compress_keys`), summed over the KV
    /// heads in ascending order; [`MapGradient::Mean`] for the mean.
    pub d_map_keys: MapGradient<S>,
    /// `∂L/∂φ_V`: the same for the values' map (`config.compress_values`).
    pub d_map_values: MapGradient<S>,
}

/// E18's output with the selection `selection` `[T, Hkv, n]` given instead of chosen: the gated sum of the three
/// branches, `nsa_forward`'s `o` whenever `selection` is the one it selects.
pub fn nsa_forward_with_selection<S: Real>(
    inputs: NsaInputs<'_, S>,
    gate_logits: ArrayView3<'_, S>,
    selection: ArrayView3<'_, i32>,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<Array3<S>, OracleError> {
    let branches = branch_outputs(inputs, selection, config, ctx)?;
    let (_, o) =
        crate::nsa::gate_combine([branches[0].view(), branches[1].view(), branches[2].view()], gate_logits, ctx)?;
    Ok(o)
}

fn branch_outputs<S: Real>(
    inputs: NsaInputs<'_, S>,
    selection: ArrayView3<'_, i32>,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<[Array3<S>; 3], OracleError> {
    Ok([
        compressed_attention(inputs, config, ctx)?.o,
        selected_attention(inputs, selection, config, ctx)?,
        window_attention(inputs, config, ctx)?,
    ])
}

/// The backward of [`nsa_forward_with_selection`] (module docs): `selection` is held fixed; `d_out` `[T, Hq, dv]`.
pub fn nsa_backward<S: Real>(
    inputs: NsaInputs<'_, S>,
    gate_logits: ArrayView3<'_, S>,
    selection: ArrayView3<'_, i32>,
    d_out: ArrayView3<'_, S>,
    config: &NsaConfig,
    ctx: S::Ctx,
) -> Result<NsaGradients<S>, OracleError> {
    let branches = branch_outputs(inputs, selection, config, ctx)?;
    let gates =
        gate_combine_backward([branches[0].view(), branches[1].view(), branches[2].view()], gate_logits, d_out, ctx)?;
    let (len, n_heads_q, head_dim) = inputs.q.dim();
    let (n_heads_kv, head_dim_v, group) = (inputs.n_heads_kv(), inputs.v.dim().2, inputs.group());
    let one_sequence = |len_k: usize| AttentionSpec {
        layout: Layout::Varlen { cu_seqlens_q: vec![0, len as i32], cu_seqlens_k: vec![0, len_k as i32] },
        n_heads_q,
        n_heads_kv,
        head_dim,
        head_dim_v,
        scale: config.scale,
        mask: Mask::None,
    };
    let dense = DenseConfig::default();
    let mut dq = Array3::from_elem(inputs.q.raw_dim(), S::zero(ctx));
    let mut dk = Array3::from_elem(inputs.k.raw_dim(), S::zero(ctx));
    let mut dv = Array3::from_elem(inputs.v.raw_dim(), S::zero(ctx));
    let add = |acc: &mut Array3<S>, g: ndarray::ArrayD<S>| {
        Zip::from(acc.view_mut().into_dyn()).and(&g).for_each(|a, b| *a = a.clone() + b.clone());
    };

    // The compressed branch over the compressed keys and values, then back through the pooling.
    let n_windows = crate::nsa::complete_windows(len, config.compress_len, config.compress_stride)?;
    let per_head = |x: ArrayView3<'_, S>, map: &Compression| -> Result<Vec<Array2<S>>, OracleError> {
        (0..n_heads_kv).map(|kv| compress(x.index_axis(Axis(1), kv), map, config, ctx)).collect()
    };
    let stack = |rows: &[Array2<S>], cols: usize| {
        Array3::from_shape_fn((n_windows, n_heads_kv, cols), |(c, kv, j)| rows[kv][[c, j]].clone())
    };
    let k_cmp = stack(&per_head(inputs.k, &config.compress_keys)?, head_dim);
    let v_cmp = stack(&per_head(inputs.v, &config.compress_values)?, head_dim_v);
    let visible_windows = config.compressed_mask().matrix(len, n_windows);
    let compressed = backward_with_visibility(
        &one_sequence(n_windows),
        Qkv { q: inputs.q.into_dyn(), k: k_cmp.view().into_dyn(), v: v_cmp.view().into_dyn() },
        gates.d_branches[0].view().into_dyn(),
        &|_: &Sequence, _| visible_windows.clone(),
        dense,
        ctx,
    )?;
    add(&mut dq, compressed.dq);
    let d_k_cmp = compressed.dk.into_dimensionality::<ndarray::Ix3>().expect("[W, Hkv, d]");
    let d_v_cmp = compressed.dv.into_dimensionality::<ndarray::Ix3>().expect("[W, Hkv, dv]");
    let mut d_map_keys = MapGradient::zeros(&config.compress_keys, ctx);
    let mut d_map_values = MapGradient::zeros(&config.compress_values, ctx);
    for kv in 0..n_heads_kv {
        for (x, map, d_cmp, d_x, d_map) in [
            (inputs.k, &config.compress_keys, &d_k_cmp, &mut dk, &mut d_map_keys),
            (inputs.v, &config.compress_values, &d_v_cmp, &mut dv, &mut d_map_values),
        ] {
            let g = compress_backward(x.index_axis(Axis(1), kv), map, d_cmp.index_axis(Axis(1), kv), config, ctx)?;
            let mut rows = d_x.index_axis_mut(Axis(1), kv);
            rows.zip_mut_with(&g.dx, |a, b| *a = a.clone() + b.clone());
            // Every KV head compresses with the same map, so the map's gradient collects each head's share.
            d_map.add(&g.d_map)?;
        }
    }

    // The selected and window branches see the tokens their forwards attend to (`selected_tokens`, `window_tokens`).
    let n_blocks = selection_blocks(len, config.select_block)?;
    let (sel_len, sel_heads, _) = selection.dim();
    if (sel_len, sel_heads) != (len, n_heads_kv) {
        return Err(OracleError::ShapeMismatch {
            argument: "selection",
            expected: vec![len, n_heads_kv, selection.dim().2],
            actual: selection.shape().to_vec(),
        });
    }
    let mut listed = vec![Array2::from_elem((len, len), false); n_heads_kv];
    let mut window = Array2::from_elem((len, len), false);
    for t in 0..len {
        for (kv, visible) in listed.iter_mut().enumerate() {
            for j in selected_tokens(selection, t, kv, n_blocks, config)? {
                visible[[t, j]] = true;
            }
        }
        window_tokens(t, config).for_each(|j| window[[t, j]] = true);
    }
    let tokens = |visibility: &(dyn Fn(&Sequence, usize) -> Array2<bool> + Sync), d_branch: &Array3<S>| {
        backward_with_visibility(
            &one_sequence(len),
            Qkv { q: inputs.q.into_dyn(), k: inputs.k.into_dyn(), v: inputs.v.into_dyn() },
            d_branch.view().into_dyn(),
            visibility,
            dense,
            ctx,
        )
    };
    let selected = tokens(&|_: &Sequence, h| listed[h / group].clone(), &gates.d_branches[1])?;
    let windowed = tokens(&|_: &Sequence, _| window.clone(), &gates.d_branches[2])?;
    for g in [selected, windowed] {
        add(&mut dq, g.dq);
        add(&mut dk, g.dk);
        add(&mut dv, g.dv);
    }
    Ok(NsaGradients { dq, dk, dv, d_gate_logits: gates.d_gate_logits, d_map_keys, d_map_values })
}
