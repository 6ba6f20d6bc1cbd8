//! NSA's gates on the GPU (`attnproof_gpu::nsa::gates`, `gpu/kernels/nsa_gates.cu`): the gated sum of the three branch
//! outputs and its gradients against the oracle's `gate_combine` and `gate_combine_backward` through
//! `attnproof_harness::nsa`, with NaN-poisoned and guarded outputs and inputs checked unchanged; each draw runs twice
//! and must give the same bits. The suites draw the harness's layouts and heads, `dv` up to 256, branch outputs and
//! `dO` of two magnitudes and gate logits of every range (zero, unit, ±15, and ±100 where `expf` over- and
//! underflows). Without a device each test prints `skipped: no CUDA device` and passes.

use std::sync::Arc;

use crate::common::*;
use crate::property::{default_run_config, run_typed_production};
use attnproof_gpu::GpuError;
use attnproof_gpu::compile::KernelSource;
use attnproof_gpu::nsa::gates::{
    GateBranches, GateGradientsDevice, NSA_GATES, gate_backward, gate_backward_device, gate_combine,
    gate_combine_device, gate_logits_shape,
};
use attnproof_harness::nsa::{GateDraw, gate_draws, gates_guarded, verify_gate_backward, verify_gate_combine};
use attnproof_oracle::spec::Operand;
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::CudaStream;
use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// The two suites ("gpunsag" in ASCII, plus the dtype).
pub const GATE_SUITES: [TypedSuite; 2] = [
    TypedSuite { name: "gpu_nsa_gates_bf16", bf16: true, cases: 64, seed: 0x6770_756e_7361_6701 },
    TypedSuite { name: "gpu_nsa_gates_f16", bf16: false, cases: 64, seed: 0x6770_756e_7361_6702 },
];

/// Runs a gates suite's draws under `config` through the gates' kernel text `kernel` on `stream`; a failing draw
/// comes back described by its spec.
pub fn run_gate_suite(
    suite: &TypedSuite,
    config: Config,
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
) -> Result<(), Box<TestError<String>>> {
    fn describe<T>(d: &GateDraw<T>) -> String {
        format!("{:?}", d.spec)
    }
    if suite.bf16 {
        run_described(config, gate_draws::<bf16>(), |d| check_draw(stream, kernel, d), describe)
    } else {
        run_described(config, gate_draws::<f16>(), |d| check_draw(stream, kernel, d), describe)
    }
}

fn check_draw<T: Storage>(
    stream: &Arc<CudaStream>,
    kernel: KernelSource,
    draw: &GateDraw<T>,
) -> Result<(), TestCaseError> {
    check_gates(stream, kernel, draw).map_err(TestCaseError::fail)
}

/// Two guarded runs (the same bits), then both verdicts.
fn check_gates<T: Storage>(stream: &Arc<CudaStream>, kernel: KernelSource, draw: &GateDraw<T>) -> Result<(), String> {
    let (o, d, dx) = gates_guarded(stream, draw, kernel).map_err(|e| e.to_string())?;
    let (o2, d2, dx2) = gates_guarded(stream, draw, kernel).map_err(|e| e.to_string())?;
    let bits = |t: &ArrayD<T>| t.iter().map(|x| x.bits()).collect::<Vec<_>>();
    let same = bits(&o) == bits(&o2)
        && d.iter().zip(&d2).all(|(a, b)| bits(a) == bits(b))
        && dx.iter().zip(dx2.iter()).all(|(a, b)| a.to_bits() == b.to_bits());
    if !same {
        return Err("the same input gave different bits".into());
    }
    let forward = verify_gate_combine(draw, &o).map_err(|e| e.to_string())?;
    if !forward.passed() {
        return Err(forward.failures.join("\n"));
    }
    let backward = verify_gate_backward(draw, &d, &dx).map_err(|e| e.to_string())?;
    if !backward.passed() {
        return Err(backward.failures.join("\n"));
    }
    Ok(())
}

fn run_production(suite: &TypedSuite) {
    run_typed_production(suite, NSA_GATES, run_gate_suite);
}

#[test]
fn gates_and_their_gradients_are_within_the_bounds_bf16() {
    run_production(&GATE_SUITES[0]);
}

#[test]
fn gates_and_their_gradients_are_within_the_bounds_f16() {
    run_production(&GATE_SUITES[1]);
}

/// The suites' fixed seeds reach every logit range, both layouts and head dims above 128, replayed without a device.
#[test]
fn the_gate_suites_draw_every_logit_range_and_layout() {
    for suite in &GATE_SUITES {
        let seen = std::cell::RefCell::new(std::collections::BTreeSet::new());
        TestRunner::new(default_run_config(suite.name, suite.cases, suite.seed))
            .run(&gate_draws::<bf16>(), |draw| {
                let mut s = seen.borrow_mut();
                let largest = draw.gate_logits.iter().map(|x| x.to_f32().abs()).fold(0.0f32, f32::max);
                s.insert(match largest {
                    0.0 => "zero",
                    x if x < 8.0 => "unit",
                    x if x < 88.0 => "wide",
                    _ => "extreme",
                });
                s.insert(if matches!(draw.spec.layout, attnproof_oracle::Layout::Dense { .. }) {
                    "dense"
                } else {
                    "varlen"
                });
                if draw.spec.head_dim_v > 128 {
                    s.insert("wide head");
                }
                Ok(())
            })
            .expect("replay");
        let seen = seen.into_inner();
        for class in ["zero", "unit", "wide", "extreme", "dense", "varlen", "wide head"] {
            assert!(seen.contains(class), "{}: no draw of {class}: {seen:?}", suite.name);
        }
    }
}

/// Fixed draws that kill the catalog's `gpu-nsa-gates-*` mutants: the suite's first draws with extreme logits, wide
/// logits and a head dim of at least 64, from a fixed runner.
pub fn killing_cases() -> Vec<(&'static str, GateDraw<bf16>)> {
    let mut runner = TestRunner::deterministic();
    let mut find = |want: &dyn Fn(&GateDraw<bf16>) -> bool| loop {
        let draw = gate_draws::<bf16>().new_tree(&mut runner).expect("a draw").current();
        if want(&draw) {
            return draw;
        }
    };
    let largest = |d: &GateDraw<bf16>| d.gate_logits.iter().map(|x| x.to_f32().abs()).fold(0.0f32, f32::max);
    let rows = |d: &GateDraw<bf16>| d.d_out.len() / d.spec.head_dim_v.max(1);
    vec![
        ("extreme_logits", find(&|d| largest(d) > 88.0 && rows(d) >= 8 && d.spec.head_dim_v >= 64)),
        ("wide_logits", find(&|d| (10.0..88.0).contains(&largest(d)) && rows(d) >= 8 && d.spec.head_dim_v >= 64)),
    ]
}

/// Runs the gates' kernel text `kernel` on a killing case; `Ok(())` when it passes both verdicts.
pub fn check_gate_case(stream: &Arc<CudaStream>, kernel: KernelSource, case: &GateDraw<bf16>) -> Result<(), String> {
    check_gates(stream, kernel, case)
}

/// The killing cases under compute-sanitizer (`run.sh sanitize`).
#[test]
fn sanitizer_shapes() {
    let Some(stream) = device_stream("nsa_gates::sanitizer_shapes") else { return };
    for (name, case) in killing_cases() {
        if let Err(why) = check_gate_case(&stream, NSA_GATES, &case) {
            panic!("case `{name}`: {why}");
        }
    }
}

/// The host wrappers give the device wrappers' bits.
#[test]
fn the_host_wrappers_equal_the_device_wrappers() {
    let Some(stream) = device_stream("nsa_gates::the_host_wrappers_equal_the_device_wrappers") else { return };
    let (_, draw) = killing_cases().swap_remove(0);
    let views = [draw.branches[0].view(), draw.branches[1].view(), draw.branches[2].view()];
    let o = gate_combine(&stream, &draw.spec, views.clone(), draw.gate_logits.view()).expect("host combine");
    let grads = gate_backward(&stream, &draw.spec, views, draw.gate_logits.view(), draw.d_out.view()).expect("host");
    let (o2, d2, dx2) = gates_guarded(&stream, &draw, NSA_GATES).expect("device");
    assert_eq!(o, o2);
    assert_eq!(grads.d_branches, d2);
    assert!(grads.d_gate_logits.iter().zip(dx2.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Bad input is a typed error before any launch: odd head dims, logits of the wrong shape or not finite, branches
/// of the wrong shape, device buffers too small.
#[test]
fn bad_gate_input_is_a_typed_error_before_any_launch() {
    let Some(stream) = device_stream("nsa_gates::bad_gate_input_is_a_typed_error_before_any_launch") else { return };
    let spec = AttentionSpec::dense(1, 2, 1, 16, 16, 16, 16).with_mask(Mask::Causal);
    let o_shape = spec.expected_shape(Operand::O);
    let zeros = |shape: &[usize]| ArrayD::from_elem(IxDyn(shape), bf16::ZERO);
    let o = zeros(&o_shape);
    let x = zeros(&gate_logits_shape(&spec));
    let views = || [o.view(), o.view(), o.view()];
    let odd = AttentionSpec::dense(1, 2, 1, 16, 16, 16, 12).with_mask(Mask::Causal);
    assert!(matches!(
        gate_combine(&stream, &odd, views(), x.view()),
        Err(GpuError::Unsupported { .. } | GpuError::Shape { .. })
    ));
    let wrong = zeros(&[1, 2, 16, 2]);
    assert!(matches!(
        gate_combine(&stream, &spec, views(), wrong.view()),
        Err(GpuError::Shape { argument: "gate_logits", .. })
    ));
    let mut infinite = x.clone();
    *infinite.iter_mut().next().unwrap() = bf16::INFINITY;
    assert!(matches!(gate_combine(&stream, &spec, views(), infinite.view()), Err(GpuError::Spec(_))));
    let short = zeros(&[1, 2, 15, 16]);
    assert!(matches!(
        gate_combine(&stream, &spec, [short.view(), o.view(), o.view()], x.view()),
        Err(GpuError::Shape { argument: "o_cmp", .. })
    ));
    assert!(matches!(
        gate_backward(&stream, &spec, views(), x.view(), short.view()),
        Err(GpuError::Shape { argument: "d_out", .. })
    ));
    let n = o.len();
    let full = stream.alloc_zeros::<bf16>(n).unwrap();
    let small = stream.alloc_zeros::<bf16>(n - 1).unwrap();
    let logits = stream.alloc_zeros::<bf16>(x.len()).unwrap();
    let branches = GateBranches { compressed: &full, selected: &small, window: &full };
    let mut out = stream.alloc_zeros::<bf16>(n).unwrap();
    let err = gate_combine_device(&stream, &spec, NSA_GATES, branches, &logits, &mut out).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "o_slc", .. }), "{err}");
    let ok = GateBranches { compressed: &full, selected: &full, window: &full };
    let mut short_out = stream.alloc_zeros::<bf16>(n - 1).unwrap();
    let err = gate_combine_device(&stream, &spec, NSA_GATES, ok, &logits, &mut short_out).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "o", .. }), "{err}");
    let (mut a, mut b, mut c) = (
        stream.alloc_zeros::<bf16>(n).unwrap(),
        stream.alloc_zeros::<bf16>(n).unwrap(),
        stream.alloc_zeros::<bf16>(n).unwrap(),
    );
    let mut dx = stream.alloc_zeros::<f32>(x.len() - 1).unwrap();
    let grads =
        GateGradientsDevice { d_compressed: &mut a, d_selected: &mut b, d_window: &mut c, d_gate_logits: &mut dx };
    let err = gate_backward_device(&stream, &spec, NSA_GATES, ok, &logits, &full, grads).unwrap_err();
    assert!(matches!(err, GpuError::BufferTooSmall { argument: "d_gate_logits", .. }), "{err}");
    // Nothing ran: the buffers still hold their zeros.
    assert!(stream.clone_dtoh(&out).unwrap().iter().all(|v| v.to_bits() == 0));
    assert!(stream.clone_dtoh(&a).unwrap().iter().all(|v| v.to_bits() == 0));
}
