//! NSA's compressed attention (`attnproof_gpu::nsa::compressed`, E18) on the device, end to end from the layer: the
//! compression kernel makes `k̃` and `ṽ` from the layer's K and V, and the dense kernels attend over them under the
//! spec [`compressed_spec`] builds (the strided causal mask, window `c` visible to token `t` iff `c·s + l − 1 ≤ t`).
//! Forward (`o_cmp`, `LSE_cmp`) and backward (`dq`, `dk̃`, `dṽ`, every dQ strategy) are judged by the harness against
//! the oracle within the dense recipes' bounds, with poisoned and guarded outputs and A/B/A determinism; on Hopper the
//! `wgmma` backward (the production one for head dims up to 128) is judged too.
//!
//! The suites draw [`compressed_attention_draws`]: the paper's windows, fla-core's 64-token blocks and short adjacent,
//! gapped and overlapping ones, lengths with no window, one window and a few hundred tokens, dense and varlen with
//! empty sequences, GQA groups 1–16 (any size, not only powers of two), head dims 64, 128 and 192 with `dv = 128`
//! and any multiple of 8, every value profile. The general dense suites draw the mask too, for every kernel.
//! Without a device each test prints `skipped: no CUDA device` and passes.

use std::cell::RefCell;

use crate::common::*;
use crate::property::{SECOND_INPUT, default_run_config, run_config};
use attnproof_gpu::compile::{self, FLASH_BWD_SM90};
use attnproof_gpu::flash::WGMMA_MAX_HEAD_DIM;
use attnproof_gpu::nsa::compress::compress_kv;
use attnproof_gpu::nsa::compressed::compressed_spec;
use attnproof_gpu::skip_unless_gpu;
use attnproof_harness::Case;
use attnproof_harness::adversarial::{Repeat, Worst, backward_verdicts, forward_verdicts};
use attnproof_harness::candidate::GpuCandidate;
use attnproof_harness::generate::{make_case, make_d_out};
use attnproof_harness::nsa::{CompressedAttentionDraw, compressed_attention_draws};
use attnproof_oracle::nsa::NsaConfig;
use attnproof_oracle::{AttentionSpec, Layout, Mask, Scale};
use half::{bf16, f16};
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// The two suites ("gpunsaca" in ASCII, plus the dtype).
pub const COMPRESSED_SUITES: [TypedSuite; 2] = [
    TypedSuite { name: "gpu_nsa_compressed_bf16", bf16: true, cases: 32, seed: 0x6770_756e_7361_6361 },
    TypedSuite { name: "gpu_nsa_compressed_f16", bf16: false, cases: 24, seed: 0x6770_756e_7361_6362 },
];

/// The compressed attention's case of a layer case: the layer's queries over the device's compressed keys and values.
fn compressed_case<T: Storage>(
    candidate: &GpuCandidate,
    layer: &Case<T>,
    config: &NsaConfig,
) -> Result<Case<T>, TestCaseError> {
    let fail = |e: &dyn std::fmt::Display| TestCaseError::fail(e.to_string());
    let spec = compressed_spec(&layer.spec, config).map_err(|e| fail(&e))?;
    let kv =
        compress_kv(&candidate.stream, &layer.spec, config, layer.k.view(), layer.v.view()).map_err(|e| fail(&e))?;
    Ok(Case { spec, q: layer.q.clone(), k: kv.k, v: kv.v })
}

/// The candidates a draw is judged by: the production kernels, and on Hopper the `wgmma` backward where it applies.
fn candidates(base: &GpuCandidate, spec: &AttentionSpec) -> Vec<GpuCandidate> {
    let mut out = vec![base.clone()];
    let hopper = compile::compute_capability(base.stream.context()).is_ok_and(|cc| cc == (9, 0));
    if hopper && spec.head_dim <= WGMMA_MAX_HEAD_DIM && spec.head_dim_v <= WGMMA_MAX_HEAD_DIM {
        out.push(GpuCandidate { backward_kernel: FLASH_BWD_SM90, ..base.clone() });
    }
    out
}

/// One draw: two layer inputs (A, B) compressed on the device, the forward on A, B, A and the backward on A, B, A
/// with every dQ strategy, each verdict within its bound with a valid gate.
fn check_draw<T: Storage>(
    base: &GpuCandidate,
    worst: &RefCell<Worst>,
    draw: &CompressedAttentionDraw,
) -> Result<(), TestCaseError> {
    let seeds = [draw.seed, draw.seed ^ SECOND_INPUT];
    let layers = seeds.map(|s| make_case::<T>(&draw.layer, draw.profile, s));
    let cases = [compressed_case(base, &layers[0], &draw.config)?, compressed_case(base, &layers[1], &draw.config)?];
    let d_outs = seeds.map(|s| make_d_out::<T>(&cases[0].spec, s));
    for candidate in candidates(base, &cases[0].spec) {
        let forward = forward_verdicts(&candidate, &[&cases[0], &cases[1]], Repeat::FirstInput)
            .map_err(|e| e.into_test_case_error())?;
        let problems = [(&cases[0], &d_outs[0]), (&cases[1], &d_outs[1])];
        let backward =
            backward_verdicts(&candidate, &problems, Repeat::FirstInput).map_err(|e| e.into_test_case_error())?;
        forward.iter().chain(&backward).for_each(|v| worst.borrow_mut().record(v));
    }
    Ok(())
}

fn run_suite(suite: &TypedSuite, config: Config, candidate: &GpuCandidate, worst: &RefCell<Worst>) {
    let describe =
        |d: &CompressedAttentionDraw| format!("{:?} {:?} {:?} seed {}", d.layer, d.config, d.profile, d.seed);
    let result = if suite.bf16 {
        run_described(config, compressed_attention_draws(), |d| check_draw::<bf16>(candidate, worst, d), describe)
    } else {
        run_described(config, compressed_attention_draws(), |d| check_draw::<f16>(candidate, worst, d), describe)
    };
    if let Err(e) = result {
        panic!("{}: {e}", suite.name);
    }
}

fn run_production(suite: &TypedSuite) {
    let Some(candidate) = GpuCandidate::if_available(suite.name) else {
        return;
    };
    let worst = RefCell::new(Worst::default());
    run_suite(suite, run_config(suite.name, suite.cases, suite.seed), &candidate, &worst);
    println!("{}: worst error/bound {}", suite.name, worst.borrow());
}

#[test]
fn compressed_attention_is_within_bound_bf16() {
    run_production(&COMPRESSED_SUITES[0]);
}

#[test]
fn compressed_attention_is_within_bound_f16() {
    run_production(&COMPRESSED_SUITES[1]);
}

/// The paper's layer at 2048 tokens: `l = 32`, `s = 16`, a GQA group of 16 over one KV head, `d = 192`, `dv = 128`
/// (E31's shape), and a group of 5 over two KV heads at `d = 128`, bf16, forward and backward.
#[test]
fn the_paper_layer_at_2048_tokens_is_within_bound() {
    let Some(ctx) = skip_unless_gpu("the_paper_layer_at_2048_tokens_is_within_bound") else {
        return;
    };
    let candidate = GpuCandidate::production(ctx.new_stream().expect("create a stream"));
    let worst = RefCell::new(Worst::default());
    for (n_heads_q, n_heads_kv, d, dv) in [(16, 1, 192, 128), (10, 2, 128, 128)] {
        let draw = CompressedAttentionDraw {
            layer: AttentionSpec::dense(1, n_heads_q, n_heads_kv, 2048, 2048, d, dv).with_mask(Mask::Causal),
            config: NsaConfig::default(),
            profile: gaussian(1.0),
            seed: 0x006e_7361_3230_3438,
        };
        check_draw::<bf16>(&candidate, &worst, &draw).unwrap_or_else(|e| panic!("{:?}: {e}", draw.layer));
    }
    println!("paper layer: worst error/bound {}", worst.borrow());
}

/// The suites' fixed seeds, replayed without a device, reach what the branch needs: a group above 8 and a group that
/// is not a power of two, E31's head dims, the paper's windows, a sequence with no complete window, varlen, and a
/// layer whose compressed keys span more than one KV tile.
#[test]
fn the_compressed_suites_draw_every_class() {
    for suite in &COMPRESSED_SUITES {
        let seen = RefCell::new(std::collections::BTreeSet::new());
        TestRunner::new(default_run_config(suite.name, suite.cases, suite.seed))
            .run(&compressed_attention_draws(), |draw| {
                let mut s = seen.borrow_mut();
                let layer = &draw.layer;
                let group = layer.n_heads_q / layer.n_heads_kv;
                let (l, stride) = (draw.config.compress_len, draw.config.compress_stride);
                let spec = compressed_spec(layer, &draw.config).expect("a drawn layer is an NSA layer");
                for (class, reached) in [
                    ("group > 8", group > 8),
                    ("group not a power of two", !group.is_power_of_two()),
                    ("d 192, dv 128", layer.head_dim == 192 && layer.head_dim_v == 128),
                    ("paper windows", l == 32 && stride == 16),
                    ("no complete window", layer.sequences().iter().any(|q| q.len_k < l)),
                    ("varlen", matches!(layer.layout, Layout::Varlen { .. })),
                    ("keys beyond one KV tile", spec.sequences().iter().any(|q| q.len_k > 64)),
                    ("default scale", layer.scale == Scale::InverseSqrtHeadDim),
                ] {
                    if reached {
                        s.insert(class);
                    }
                }
                Ok(())
            })
            .expect("replay");
        let seen = seen.into_inner();
        for class in [
            "group > 8",
            "group not a power of two",
            "d 192, dv 128",
            "paper windows",
            "no complete window",
            "varlen",
            "keys beyond one KV tile",
            "default scale",
        ] {
            assert!(seen.contains(class), "{}: no draw of {class}: {seen:?}", suite.name);
        }
    }
}
