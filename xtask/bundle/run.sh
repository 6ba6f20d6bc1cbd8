#!/usr/bin/env bash
# Entry script of the GPU bundle: `cargo xtask gpu-bundle` copies this file (xtask/bundle/run.sh) into gpu-bundle/.
# Modes:
#   run.sh all [ARGS]       the whole GPU verification in one go: every test binary (the kernel-text mutants among
#                           them), the scratch-built mutants and the sanitizer runs side by side, then, alone on the GPU, the benchmark with the backward
#                           and the SDPA peers (ARGS go to bin/bench; PEERS_ARGS=--backward adds FlexAttention). Logs in $ATTNPROOF_LOGS (default: $OUT if set, else
#                           a fresh directory), packed into all-logs.tgz; a summary last. Non-zero if anything failed.
#                           ALL_BENCH=0 runs the verification alone, without the benchmark. PART=i/n runs the i-th of
#                           n shares of the verification (every n-th unit: test module, other binary, sanitizer, Python
#                           package, scratch mutants; the `mutants` module's hunts make MUTANT_UNITS units, default 4),
#                           so that n calls under a device's per-call limit run it all; the
#                           benchmark only with the last share. ALL_SECONDS=N stops the units still running after N
#                           seconds and reports them as cut (failed), so that the summary and the logs come back
#                           inside a call's limit.
#   run.sh fuzz [MINUTES] [PROCESSES]
#                           the GPU property tests of the forward and backward kernels with fresh seeds, PROCESSES
#                           (default 3) of each side by side, batch after batch until MINUTES (default 5) have passed;
#                           cases per process from $PROPTEST_CASES (default 48 forward, 16 backward). A failing case's
#                           regression file and log land in $ATTNPROOF_LOGS (default $OUT, else a fresh directory).
#   run.sh [tests] [ARGS]   every test binary (ARGS go to each: filters, --test-threads, ...); the default
#   run.sh mutants          the GPU mutants: patched kernel texts (the table mutant -> killed by), then each
#                           scratch-built mutant of mutants/ (its unpatched test binary must pass, its patched one fail)
#   run.sh sanitize         compute-sanitizer memcheck and racecheck over the small-shape tests in SANITIZE below
#   run.sh bench [ARGS]     bin/bench (ARGS: --all-tilings, --reps N, ...), then peers.py (PyTorch SDPA flash and
#                           cuDNN, FlexAttention) in the same call; extra peers.py arguments in $PEERS_ARGS
#   run.sh bsa-bench [ARGS] bin/bench --block-sparse (the block-sparse forward on causal 128x128-block lists at 16K,
#                           64K, 128K), then block_sparse_peers.py (FlexAttention on the same lists) in the same call
#   run.sh dsa-bench [ARGS] bin/bench --dsa (DSA's indexer with its exact top-k at 16K, 64K, 128K), then
#                           dsa_peers.py (the PyTorch baseline: chunked scores and torch.topk) in the same call
#   run.sh dsa-sparse-bench [ARGS] bin/bench --dsa-sparse (DSA's token-sparse attention forward and backward, 64
#                           heads over one KV head, k = 2048, at 16K, 64K, 128K), dsa_sparse_peers.py (FlexAttention
#                           with the same selection as a mask, forward and backward) and bin/bench's dense causal forward at B1 H16 L16K D128 in the same
#                           call, for the ratio of effective TFLOP/s the issue sets
#   run.sh recall [ARGS]    bin/recall (E30: Recall@K and the attention-mass ratio of BSA's selector and the pyramid
#                           under each scoring at several lengths, from the GPU's exact block masses; ARGS:
#                           --lengths L,..., --seed N); the CSV also to $OUT/recall.csv
#   run.sh ring [ARGS]      bin/ring_bench (ring attention: time per step, overlap, efficiency against the dense
#                           kernel; ARGS: --backward, --nccl for one GPU per ring device, --devices 2,4,8, ...)
#   run.sh peers [ARGS]     dumps PyTorch's kernels' case files (python/examples/dump_peers.py ARGS, e.g.
#                           --only "flex block-sparse" for FlexAttention's BlockMask cases alone), checks them with
#                           bin/check (check.txt, check.json, peers.md under $OUT) and packs the cases in
#                           cases.tgz.* parts of at most 15 MiB under $OUT for checking elsewhere
#   run.sh unpack           only unpacks the programs (every mode does that first), for running tests/* and bin/* by hand
#   run.sh python [ARGS]    the Python package's pytest suite and python/examples/test_sdpa.py with the machine's
#                           torch (CPU and CUDA tensors, TF32), after dumping PyTorch's SDPA case files for its
#                           same-report-as-the-CLI test (ARGS go to pytest)
# Every mode exits non-zero on any failure.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
export ATTNPROOF_REQUIRE_GPU=1
export CUDA_HOME=/usr/local/cuda
# NVRTC (libnvrtc.so.13) is loaded at run time; the toolkit's lib64 is not always on the loader path.
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}"
export PATH="$CUDA_HOME/bin:$PATH"
# NVLink multicast stays off (on a shared host it can put the GPUs out of service), and NCCL comes from pip's
# nvidia-nccl wheel when the host has no system copy: cudarc looks for libnccl.so, the wheel ships libnccl.so.2.
export NCCL_NVLS_ENABLE=0
# The wheel's layout differs between CUDA majors (nvidia/nccl/lib, nvidia/cu13/lib): search the nvidia namespace.
nccl_so="$(python3 -c 'import glob, os, nvidia; print(next(iter(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "**", "libnccl.so*"), recursive=True))), ""))' 2>/dev/null)"
if [ -n "$nccl_so" ]; then
    mkdir -p /tmp/attnproof-nccl && ln -sf "$nccl_so" /tmp/attnproof-nccl/libnccl.so
    export LD_LIBRARY_PATH="/tmp/attnproof-nccl:$LD_LIBRARY_PATH"
fi
cd "$here" || exit 1
# The programs travel compressed (`cargo xtask gpu-bundle` packs them to fit the device tool's 64 MiB): each is
# unpacked once, through a temporary name so that a second run.sh started beside this one never sees half a file.
for packed in "$here"/tests/*.gz "$here"/bin/*.gz; do
    [ -e "$packed" ] || continue
    program="${packed%.gz}"
    partial="$(mktemp "$program.XXXXXX")" || exit 1
    if gzip -dc "$packed" >"$partial" && chmod +x "$partial" && mv -f "$partial" "$program"; then
        rm -f "$packed"
    else
        rm -f "$partial"
    fi
done
# Small-shape tests that every kernel's sanitizer run covers: "test-binary filter...", one test per line so that a
# failure names it. A new kernel adds its line. Under the sanitizer every launch is about a hundred times slower and
# the adversarial table's tests run far too many cases (a backward filter matching a few of them did not finish in a
# 7-minute device call), so each kernel has a dedicated test of a handful of tiny shapes, gpu/tests/it/common.rs
# `sanitizer_shapes`: tail tiles (tile +- 1), a fully masked row, a GQA group of 3, varlen with an empty sequence, a
# sliding window, and the largest head dims (256, and d != dv), which take the forward's single-slice tiling and the
# backward's single-stage pipeline (Q_STAGES = 1); the backward runs every strategy (strategy A's bwd_dq and the
# deterministic dQ sum included). The ring's one-chunk test covers the state-out forward and the merge kernels.
SANITIZE=(
    "attnproof-gpu-it flash_forward::sanitizer_shapes"
    "attnproof-gpu-it flash_backward::sanitizer_shapes"
    "attnproof-gpu-it block_sparse::sanitizer_shapes"
    "attnproof-gpu-it block_sparse::wgmma_sanitizer_shapes"
    "attnproof-gpu-it block_sparse_backward::sanitizer_shapes"
    "attnproof-gpu-it block_sparse_backward::wgmma_sanitizer_shapes"
    "attnproof-gpu-it block_selection::all_tied_blocks_select_the_lowest_indices"
    "attnproof-gpu-it nsa_compress::sanitizer_shapes"
    "attnproof-gpu-it nsa_gates::sanitizer_shapes"
    "attnproof-gpu-it nsa_select::sanitizer_shapes"
    "attnproof-gpu-it nsa_selected::sanitizer_shapes"
    "attnproof-gpu-it nsa_selected_backward::sanitizer_shapes"
    "attnproof-gpu-it nsa_layer::sanitizer_shapes"
    "attnproof-gpu-it dsa_index::sanitizer_shapes"
    "attnproof-gpu-it dsa_sparse::sanitizer_shapes"
    "attnproof-gpu-it dsa_sparse_backward::sanitizer_shapes"
    "attnproof-gpu-it dsa_loss::sanitizer_shapes"
    "attnproof-gpu-it pyramid_selection::sanitizer_shapes"
    "attnproof-gpu-it pyramid_diagnostics::sanitizer_shapes"
    "attnproof-gpu-it pisa_tail::sanitizer_shapes"
    "attnproof-gpu-it pisa_tail_backward::sanitizer_shapes"
    "attnproof-gpu-it pisa_covariance::sanitizer_shapes"
    "attnproof-gpu-it hils::sanitizer_shapes"
    "attnproof-gpu-it ring_state::one_chunk"
)
# Stops process $1 and every process below it, the parent first (its children listed before it goes, so that none
# is missed once they are reparented, and so that a unit's subshell writes no exit status for a test it did not finish).
stop_tree() {
    local children child
    children="$(pgrep -P "$1" 2>/dev/null)"
    kill -TERM "$1" 2>/dev/null
    for child in $children; do stop_tree "$child"; done
}
# The scratch-built GPU mutants: for each mutants/NAME/, `cargo xtask gpu-bundle` built the killing test binary
# (`test`) from a patched copy of the tree and wrote its libtest filter (`filter`, maybe empty) and the name of the
# unpatched binary under tests/ (`baseline`). The unpatched binary must pass the filter, so that a failure says
# something about the patch (a missing GPU, say, fails both); the patched one must fail. Returns non-zero unless
# every mutant is killed; with no such mutant it reports 0 of 0.
scratch_mutants() {
    local total=0 killed=0 dir name filter baseline log exe
    for dir in "$here"/mutants/*/; do
        # Each patched binary travels gzip-compressed (a quarter of its size: the bundle and the working tree share
        # the device tool's 64 MiB), and is unpacked into a scratch file to run.
        [ -f "$dir/test.gz" ] || continue
        name="$(basename "$dir")"
        filter="$(cat "$dir/filter")"
        baseline="$(cat "$dir/baseline")"
        total=$((total + 1))
        log="$(mktemp)"
        exe="$(mktemp)"
        gzip -dc "$dir/test.gz" >"$exe" && chmod +x "$exe"
        if ! "$here/tests/$baseline" ${filter:+"$filter"} >"$log" 2>&1; then
            echo "$name: BASELINE FAILED: tests/$baseline ${filter} fails unpatched; last lines:"
            tail -n 20 "$log"
        elif "$exe" ${filter:+"$filter"} >"$log" 2>&1; then
            echo "$name: SURVIVED (tests/$baseline ${filter} passes patched)"
        else
            killed=$((killed + 1))
            echo "$name: killed ($(grep -h -m 3 -- '\.\.\. FAILED$' "$log" | paste -sd' ' -))"
        fi
        rm -f "$log" "$exe"
    done
    echo "gpu mutants of scratch builds: $killed of $total killed"
    [ "$killed" -eq "$total" ]
}
mode=tests
case "${1:-}" in
    all | fuzz | tests | mutants | sanitize | bench | bsa-bench | dsa-bench | dsa-sparse-bench | recall | ring | peers | python | unpack) mode="$1"; shift ;;
esac
case "$mode" in
all)
    logs="${ATTNPROOF_LOGS:-${OUT:-$(mktemp -d)}}"
    work="$(mktemp -d)"
    start=$(date +%s)
    # PART=i/n: this call runs unit u (in the order below, counted from 0) when u mod n = i - 1.
    part="${PART:-1/1}"
    share="${part%/*}"
    shares="${part#*/}"
    if ! [[ "$share" =~ ^[0-9]+$ && "$shares" =~ ^[0-9]+$ ]] || [ "$share" -lt 1 ] || [ "$share" -gt "$shares" ]; then
        echo "run.sh all: PART must be i/n with 1 <= i <= n, not '$part'" >&2
        exit 2
    fi
    unit=0
    mine() {
        unit=$((unit + 1))
        [ $(((unit - 1) % shares)) -eq $((share - 1)) ]
    }
    # Phase 1: the test binaries and the sanitizer at once. Their kernels are small and none is timed; most of their
    # time is the f64 oracle on the CPU, so running them side by side takes the time of the longest. The integration
    # binary (attnproof-gpu-it) holds one module per former test file: each module runs as a process of its own
    # (filter `MODULE::`), with its own log and summary line; other binaries run whole. Output streams (--nocapture):
    # a call cut short still has what every test printed so far (a hunt's verdict per mutant, a suite's tally), which
    # libtest would otherwise print only when the binary ends.
    for bin in "$here"/tests/*; do
        name="$(basename "$bin")"
        modules=""
        case "$name" in
        *-it) modules="$("$bin" --list 2>/dev/null | sed -n 's/^\([A-Za-z0-9_]*\)::.*: test$/\1/p' | sort -u)" ;;
        esac
        if [ -z "$modules" ]; then
            mine || continue
            ("$bin" --nocapture >"$work/test-$name.log" 2>&1; echo $? >"$work/test-$name.rc") &
            continue
        fi
        for module in $modules; do
            if [ "$module" = mutants ]; then
                # The hunts are the longest module by far (each judges its mutants in child processes): they run as
                # MUTANT_UNITS units of every MUTANT_UNITS-th test (by exact name), so that PART=i/n spreads them
                # over the shares instead of leaving them all to one call.
                hunts="$("$bin" --list 2>/dev/null | sed -n 's/^\(mutants::[A-Za-z0-9_]*\): test$/\1/p')"
                n_units="${MUTANT_UNITS:-4}"
                for ((i = 0; i < n_units; i++)); do
                    mine || continue
                    mapfile -t these < <(echo "$hunts" | awk -v n="$n_units" -v i="$i" 'NF && (NR - 1) % n == i')
                    [ "${#these[@]}" -gt 0 ] || continue
                    ("$bin" --exact "${these[@]}" --nocapture >"$work/test-$name-mutants-$i.log" 2>&1
                        echo $? >"$work/test-$name-mutants-$i.rc") &
                done
                continue
            fi
            mine || continue
            ("$bin" "$module::" --nocapture >"$work/test-$name-$module.log" 2>&1
                echo $? >"$work/test-$name-$module.rc") &
        done
    done
    if mine; then (bash "$here/run.sh" sanitize >"$work/sanitize.log" 2>&1; echo $? >"$work/sanitize.rc") & fi
    if mine; then (bash "$here/run.sh" python >"$work/python.log" 2>&1; echo $? >"$work/python.rc") & fi
    if mine; then (scratch_mutants >"$work/scratch-mutants.log" 2>&1; echo $? >"$work/scratch-mutants.rc") & fi
    # ALL_SECONDS=N stops phase 1 after N seconds, so that a call with a limit of its own still ends with the summary
    # and the logs: every unit still running is stopped with its processes (a hunt's children too), reported as cut
    # with what its log holds so far, and counted as failed; the benchmark is then left out.
    cut=0
    if [ -n "${ALL_SECONDS:-}" ]; then
        while [ -n "$(jobs -rp)" ] && [ $(($(date +%s) - start)) -lt "$ALL_SECONDS" ]; do sleep 2; done
        for job in $(jobs -rp); do
            cut=1
            stop_tree "$job"
        done
    fi
    wait
    phase1=$(($(date +%s) - start))
    # Phase 2, alone on the GPU: ours, then PyTorch's SDPA kernels in the same call. FlexAttention is left out by
    # default (torch.compile takes minutes per shape, more than the rest together): PEERS_ARGS=--backward adds it.
    # ALL_BENCH=0 leaves it out: the verification alone, when a call's device time is short; so does any share of
    # PART=i/n but the last.
    if [ "${ALL_BENCH:-1}" = 0 ] || [ "$share" -lt "$shares" ] || [ "$cut" = 1 ]; then
        echo "gpu-bundle all: benchmark left out (ALL_BENCH=0, a share before the last, or cut by ALL_SECONDS)" \
            >"$work/bench.log"
    else
        PEERS_ARGS="${PEERS_ARGS:---backward --no-flex}" bash "$here/run.sh" bench --backward "$@" >"$work/bench.log" 2>&1
        echo $? >"$work/bench.rc"
    fi
    failed=0
    {
        echo "gpu-bundle all (share $share of $shares, $unit units in all): tests and sanitizer ${phase1} s, everything $(($(date +%s) - start)) s"
        for rc in "$work"/*.rc; do
            [ -e "$rc" ] || continue  # a share without units
            name="$(basename "$rc" .rc)"
            status="$(cat "$rc")"
            [ "$status" = "0" ] || failed=$((failed + 1))
            counts="$(grep -h "^test result" "$work/$name.log" 2>/dev/null | sed 's/^test result: //; s/; finished.*//' | paste -sd' ' -)"
            echo "$name: exit $status${counts:+ ($counts)}"
        done
        for log in "$work"/*.log; do
            name="$(basename "$log" .log)"
            [ "$name" = bench ] || [ -e "$work/$name.rc" ] && continue
            failed=$((failed + 1))
            echo "$name: CUT by ALL_SECONDS=${ALL_SECONDS:-}; its last lines:"
            grep -v '^$' "$log" | tail -n 5 | sed 's/^/    /'
        done
        grep -h "^gpu mutants of\|^gpu-bundle sanitize" "$work"/*.log
        grep -h "skipped: no CUDA device" "$work"/test-*.log && failed=$((failed + 1))
        echo
        sed -n '/^shape /,$p' "$work/bench.log"
        echo
        echo "gpu-bundle all: $failed parts failed"
    } >"$work/summary.txt"
    cat "$work/summary.txt"
    mkdir -p "$logs"
    cp "$work/summary.txt" "$logs/summary.txt"
    (cd "$work" && tar czf "$logs/all-logs.tgz" ./*.log ./*.rc summary.txt)
    echo "gpu-bundle all: logs in $logs (all-logs.tgz)"
    exit $((failed > 0))
    ;;
fuzz)
    minutes="${1:-5}"
    processes="${2:-3}"
    logs="${ATTNPROOF_LOGS:-${OUT:-$(mktemp -d)}}"
    mkdir -p "$logs"
    deadline=$(($(date +%s) + 60 * minutes))
    batch=0
    failed=0
    total=0
    while [ "$(date +%s)" -lt "$deadline" ] && [ "$failed" -eq 0 ]; do
        batch=$((batch + 1))
        work="$(mktemp -d)"
        for i in $(seq "$processes"); do
            for side in forward backward; do
                cases="${PROPTEST_CASES:-$([ "$side" = forward ] && echo 48 || echo 16)}"
                # Each process in its own directory: proptest writes a failure's regression file relative to it.
                dir="$work/$side-$i"
                mkdir -p "$dir"
                # The suites draw from fixed seeds unless told otherwise (gpu/tests/it/property.rs); fuzzing wants
                # fresh draws in every process, and the log keeps the seed to replay a failure.
                seed="$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')"
                echo "PROPTEST_RNG_SEED=$seed" >"$dir/log"
                (cd "$dir" && PROPTEST_RNG_SEED="$seed" PROPTEST_CASES="$cases" "$here/tests/attnproof-gpu-it" \
                    "flash_$side::kernel_${side}_is_within_bound" --show-output >>log 2>&1; echo $? >rc) &
            done
        done
        wait
        for dir in "$work"/*; do
            total=$((total + 1))
            if [ "$(cat "$dir/rc")" != "0" ]; then
                failed=$((failed + 1))
                name="fuzz-batch$batch-$(basename "$dir")"
                cp "$dir/log" "$logs/$name.log"
                for f in "$dir"/proptest-regressions/*.txt; do [ -f "$f" ] && cp "$f" "$logs/$name-$(basename "$f")"; done
                echo "gpu-bundle fuzz: $(basename "$dir") of batch $batch failed; log and regression file in $logs"
            fi
        done
        grep -h "worst error/bound" "$work"/*/log | sed "s/^/batch $batch: /"
        rm -rf "$work"
    done
    echo "gpu-bundle fuzz: $batch batches, $total processes, $failed failed"
    echo "(commit a regression file under tests/proptest-regressions/ of this repository and add a named test for it)"
    exit $((failed > 0))
    ;;
tests)
    failed=0
    for bin in "$here"/tests/*; do
        echo "=== $(basename "$bin")"
        "$bin" --show-output "$@" || failed=$((failed + 1))
    done
    echo "gpu-bundle: $failed test binaries failed"
    exit $((failed > 0))
    ;;
mutants)
    # Every kernel-text mutant: mutants::all_{forward,backward,block_sparse_forward,block_selection}_mutants_are_killed
    # and the same mutants through the general suites (..._by_the_general_suite).
    "$here"/tests/attnproof-gpu-it mutants_are_killed --nocapture
    status=$?
    scratch_mutants || status=1
    echo "gpu-bundle mutants: exit $status"
    exit $status
    ;;
sanitize)
    # Each (entry, tool) run is a process of its own, SANITIZE_JOBS (default 6) at a time: under the sanitizer the
    # host side (the f64 oracle, the instrumentation) is the bottleneck, not the GPU, and one after another the runs
    # outgrew a 10-minute device call. Each writes its own log; the report follows SANITIZE's order.
    jobs="${SANITIZE_JOBS:-6}"
    work="$(mktemp -d)"
    index=0
    for entry in "${SANITIZE[@]}"; do
        read -r -a words <<<"$entry"
        bin="${words[0]}"
        for tool in memcheck racecheck; do
            index=$((index + 1))
            while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
            (compute-sanitizer --tool "$tool" --error-exitcode 99 "$here/tests/$bin" --test-threads=1 "${words[@]:1}" \
                >"$work/$index.log" 2>&1
                echo $? >"$work/$index.rc") &
        done
    done
    wait
    failed=0
    index=0
    for entry in "${SANITIZE[@]}"; do
        read -r -a words <<<"$entry"
        for tool in memcheck racecheck; do
            index=$((index + 1))
            echo "=== compute-sanitizer --tool $tool ${words[*]}"
            status="$(cat "$work/$index.rc")"
            grep -E "^test result|SUMMARY|^=========.*(ERROR|rror|azard)" "$work/$index.log" | tail -n 20
            if [ "$status" -ne 0 ]; then
                failed=$((failed + 1))
                echo "--- $tool ${words[*]} failed (exit $status); last lines:"
                tail -n 40 "$work/$index.log"
            fi
        done
    done
    rm -rf "$work"
    echo "gpu-bundle sanitize: $failed runs failed"
    exit $((failed > 0))
    ;;
bench)
    csv="$(mktemp -d)/ours.csv"
    "$here"/bin/bench --csv "$csv" "$@" || exit 1
    # PEERS_ARGS holds several arguments separated by spaces.
    read -r -a peers_args <<<"${PEERS_ARGS:-}"
    python3 "$here"/peers.py --ours "$csv" "${peers_args[@]}" || exit 1
    if [ -n "${OUT:-}" ]; then cp "$csv" "$OUT/ours.csv"; fi
    ;;
bsa-bench)
    dir="$(mktemp -d)"
    "$here"/bin/bench --block-sparse --lists-dir "$dir" --csv "$dir/ours.csv" "$@" || exit 1
    python3 "$here"/block_sparse_peers.py --ours "$dir/ours.csv" --lists "$dir" || exit 1
    if [ -n "${OUT:-}" ]; then cp "$dir/ours.csv" "$OUT/bsa-ours.csv"; fi
    ;;
dsa-bench)
    csv="$(mktemp -d)/dsa.csv"
    "$here"/bin/bench --dsa --csv "$csv" "$@" || exit 1
    read -r -a peers_args <<<"${PEERS_ARGS:-}"
    python3 "$here"/dsa_peers.py --ours "$csv" "${peers_args[@]}" || exit 1
    if [ -n "${OUT:-}" ]; then cp "$csv" "$OUT/dsa-ours.csv"; fi
    ;;
dsa-sparse-bench)
    csv="$(mktemp -d)/dsa-sparse.csv"
    "$here"/bin/bench --dsa-sparse --csv "$csv" "$@" || exit 1
    read -r -a peers_args <<<"${PEERS_ARGS:-}"
    python3 "$here"/dsa_sparse_peers.py --ours "$csv" "${peers_args[@]}" || exit 1
    "$here"/bin/bench --shape 1,16,16384,128 --csv "${csv%.csv}-dense.csv" || exit 1
    if [ -n "${OUT:-}" ]; then cp "$csv" "$OUT/dsa-sparse-ours.csv"; cp "${csv%.csv}-dense.csv" "$OUT/dsa-sparse-dense.csv"; fi
    ;;
recall)
    csv="$(mktemp -d)/recall.csv"
    "$here"/bin/recall --csv "$csv" "$@" || exit 1
    if [ -n "${OUT:-}" ]; then cp "$csv" "$OUT/recall.csv"; fi
    ;;
ring)
    csv="$(mktemp -d)/ring.csv"
    "$here"/bin/ring_bench --csv "$csv" "$@" || exit 1
    if [ -n "${OUT:-}" ]; then cp "$csv" "$OUT/ring.csv"; fi
    ;;
python)
    # The Python package's tests with the machine's torch (CPU and CUDA tensors, SDPA): the wheel installed into a
    # scratch directory, the `check` binary beside it for the same-report test; a torch test may not skip here.
    # PyTorch's SDPA kernels' case files are dumped first, so that the same-report test compares the Python API and
    # the CLI on them too (FlexAttention's are left to `run.sh peers`: torch.compile takes minutes).
    site="$(mktemp -d)"
    peer_cases="$(mktemp -d)"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$here"/python/wheels/*.whl || exit 1
    python3 "$here"/python/examples/dump_peers.py --out "$peer_cases" --only sdpa >/dev/null || exit 1
    PYTHONPATH="$site" ATTNPROOF_CHECK_BINARY="$here/bin/check" ATTNPROOF_REQUIRE_CLI=1 ATTNPROOF_REQUIRE_TORCH=1 \
        ATTNPROOF_PEER_CASES="$peer_cases" \
        python3 -m pytest -q -p no:cacheprovider "$here/python/tests" "$here/python/examples" "$@"
    ;;
peers)
    out="${OUT:-$(mktemp -d)}"
    cases="$(mktemp -d)"
    PYTHONUNBUFFERED=1 python3 "$here"/python/examples/dump_peers.py --out "$cases" "$@" || exit 1
    "$here"/bin/check "$cases"/*.safetensors >"$out/check.txt"
    status=$?
    "$here"/bin/check "$cases"/*.safetensors --json >"$out/check.json"
    python3 "$here"/python/examples/peers_table.py "$out/check.json" >"$out/peers.md"
    (cd "$cases" && tar czf - ./*.safetensors) | split -b 15m - "$out/cases.tgz."
    tail -n 30 "$out/check.txt"
    echo "gpu-bundle peers: check exit $status, results in $out"
    exit $((status > 1))
    ;;
unpack)
    ls "$here"/tests "$here"/bin
    ;;
esac
