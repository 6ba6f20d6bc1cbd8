//! Writes a dense bf16 case file (docs/case-format.md) with gradients, the f64 oracle's outputs rounded to storage
//! standing in for a kernel's: a file of a given size for timing `cargo xtask check`, and an example of writing
//! cases from Rust. Run: `cargo run --release -p attnproof-harness --example write_case -- OUT.safetensors
//! [B H L D] [--causal]` (default 1 8 4096 128).

use attnproof_harness::case::build::CaseBuilder;
use attnproof_harness::case::safetensors::Dtype;
use attnproof_harness::generate::{ValueProfile, make_case, make_d_out};
use attnproof_oracle::{AttentionSpec, Mask, backward_f64};
use half::bf16;
use ndarray::ArrayD;

/// `t` rounded to bf16 and widened back: what a bf16 kernel would store.
fn stored(t: &ArrayD<f64>) -> ArrayD<f64> {
    t.mapv(|x| f64::from(bf16::from_f64(x).to_f32()))
}

fn widen(t: &ArrayD<bf16>) -> ArrayD<f64> {
    t.mapv(|x| f64::from(x.to_f32()))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let out = args.first().expect("usage: write_case OUT.safetensors [B H L D] [--causal]");
    let dims: Vec<usize> = args.iter().skip(1).filter_map(|a| a.parse().ok()).collect();
    let [b, h, l, d] = match dims.as_slice() {
        [] => [1, 8, 4096, 128],
        &[b, h, l, d] => [b, h, l, d],
        _ => panic!("give all four of B H L D, or none"),
    };
    let causal = args.iter().any(|a| a == "--causal");
    let mut spec = AttentionSpec::dense(b, h, h, l, l, d, d);
    if causal {
        spec = spec.with_mask(Mask::Causal);
    }
    let case = make_case::<bf16>(&spec, ValueProfile::GAUSSIAN, 1);
    let d_out = make_d_out::<bf16>(&spec, 2);
    let (q, k, v, g) = (widen(&case.q), widen(&case.k), widen(&case.v), widen(&d_out));
    let grads = backward_f64(&spec, q.view(), k.view(), v.view(), g.view()).expect("a valid problem");
    let scale = 1.0 / (d as f64).sqrt();
    let builder = CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &q)
        .tensor("k", Dtype::Bf16, &k)
        .tensor("v", Dtype::Bf16, &v)
        .tensor("o", Dtype::Bf16, &stored(&grads.forward.o))
        .tensor("lse", Dtype::F32, &grads.forward.lse.mapv(|x| f64::from(x as f32)))
        .tensor("do", Dtype::Bf16, &g)
        .tensor("dq", Dtype::Bf16, &stored(&grads.dq))
        .tensor("dk", Dtype::Bf16, &stored(&grads.dk))
        .tensor("dv", Dtype::Bf16, &stored(&grads.dv))
        .meta("format_version", "1")
        .meta("layout", "bhld")
        .meta("causal", if causal { "true" } else { "false" })
        .meta("causal_align", "bottom_right")
        .meta("scale", &format!("{scale:?}"))
        .meta("lse_base", "e")
        .meta("recipe", "bf16-in/f32-acc/p-bf16")
        .meta("kernel", "the f64 oracle rounded to bf16 (write_case example)");
    std::fs::write(out, builder.bytes()).unwrap_or_else(|e| panic!("{out}: {e}"));
    println!("wrote {out}: B={b} H={h} L={l} D={d} causal={causal}");
}
