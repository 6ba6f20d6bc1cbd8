//! Smoke test of the CUDA path: a round trip of known data through device memory, or a visible skip without a device.

use attnproof_gpu::skip_unless_gpu;

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
