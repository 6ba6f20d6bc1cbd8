//! Smoke tests of the CUDA path: a round trip of known data through device memory, and the launch path's device check
//! against what the device really compiles; without a device, a visible skip.

use attnproof_gpu::compile::{self, check_device_supports, compute_capability};
use attnproof_gpu::{BackwardTiling, ForwardTiling, module_variants, skip_unless_gpu};
use attnproof_oracle::AttentionSpec;
use half::bf16;

#[test]
fn host_device_round_trip_is_exact() {
    let Some(ctx) = skip_unless_gpu("host_device_round_trip_is_exact") else {
        return;
    };
    // The values 1..=1024 are all exactly representable in f32, so the round trip must be bit-exact.
    let host: Vec<f32> = (1..=1024_u16).map(f32::from).collect();
    let stream = ctx.default_stream();
    let mut device = stream.alloc_zeros::<f32>(host.len()).expect("allocate 1024 f32 on the device");
    stream.memcpy_htod(&host, &mut device).expect("copy host to device");
    let back = stream.clone_dtoh(&device).expect("copy device to host");
    // The copy into pageable host memory is asynchronous with respect to the stream in principle, so wait for the
    // stream before reading `back`.
    stream.synchronize().expect("synchronize the default stream");
    assert_eq!(back, host);
    println!("round trip of {} f32 through CUDA device {} succeeded", host.len(), ctx.ordinal());
}

#[test]
fn the_device_loads_exactly_the_modules_the_support_table_admits() {
    let Some(ctx) = skip_unless_gpu("the_device_loads_exactly_the_modules_the_support_table_admits") else {
        return;
    };
    let capability = compute_capability(&ctx).expect("the device's compute capability");
    let spec = AttentionSpec::dense(1, 2, 1, 64, 64, 64, 64);
    let variants = module_variants::<bf16>(&spec, ForwardTiling::for_head_dims(64, 64), BackwardTiling::DEFAULT)
        .expect("the spec's modules");
    for v in variants {
        // The launch path's compile: an admitted module compiles and loads; a refused one is the table's typed error,
        // given before NVRTC runs, never a compile log.
        let loaded = compile::module(&ctx, v.kernel, &v.defines);
        match check_device_supports(v.kernel.name, capability) {
            Ok(()) => {
                loaded.unwrap_or_else(|e| panic!("{} {:?} on {capability:?}: {e}", v.kernel.name, v.defines));
            }
            Err(refused) => assert_eq!(loaded.err(), Some(refused), "{} on {capability:?}", v.kernel.name),
        }
    }
    println!("device {} ({}.{}) loads what the support table admits", ctx.ordinal(), capability.0, capability.1);
}
