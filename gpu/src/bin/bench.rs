//! Benchmark of the FlashAttention forward kernel on the shapes: median milliseconds and TFLOP/s over timed
//! launches, as CSV on stdout (and in `--csv PATH`), for `bench/peers.py` to put beside PyTorch's kernels.
//!
//! Method (the same as `bench/peers.py`): bf16 inputs drawn at random (never zeros: they run faster than real data),
//! three input sets in distinct buffers cycled launch by launch so that L2 never holds the next launch's inputs,
//! `--warmup` untimed launches first (module compile and load, clocks up), then `--reps` launches each bracketed by
//! CUDA events, and the median of those. FLOPs are `4·B·H·L²·D` non-causal and half that causal (the two matrix
//! products; softmax arithmetic is not counted), as the peers count them.
//!
//! Usage: `bench [--reps N] [--warmup N] [--all-tilings] [--csv PATH] [--backward] [--shape B,H,L,D]
//! [--fwd-source PATH]... [--bwd-source PATH]... [--block-sparse [--lists-dir DIR] [--select-chunks N]...
//! [--wgmma-source PATH]...
//! [--wgmma-bwd-source PATH]...] [--nsa [--nsa-select-source PATH]... [--nsa-selected-source PATH]...]
//! [--dsa [--dsa-source PATH]... [--dsa-ctas-per-sm N]... [--dsa-max-t T]] [--dsa-sparse [--dsa-sparse-source PATH]... [--dsa-max-t T]]
//! [--pisa-tail [--tail-source PATH]...]`.
//! `--pisa-tail` times PISA's tail forward (`attnproof_gpu::pisa::tail`, direction `pisa-tail-fwd`, over a `TailPlan`
//! formed once: the block-sparse forward over the exact lists, the blocks' statistics and `H̄`, the tail on the tensor
//! cores and its merge) beside the block-sparse
//! forward alone on the same exact lists (`bsa-fwd`) at B = 1, H = 24, T = 32K, D = 128, causal, 64×64 blocks, lists
//! per query head of the diagonal and each earlier block with probability 0.15; the ratio of the two is the tail's
//! overhead. `--tail-source PATH` (repeatable) also times the tail compiled from another text (a whole NVRTC source:
//! `common.cuh`, `bsa_select.cu`, `pisa_tail.cu`, with the same kernel names and launch shapes) in rows whose tiling
//! ends in `@` and the file's name. Then the backward over the tail forward's `O` and LSE: the block-sparse backward
//! alone on the exact lists (`bsa-bwd`) and the tail's backward (`pisa-tail-bwd`, `attnproof_gpu::pisa::tail_backward`),
//! both with the atomic dQ, FLOPs 2.5 times the forward's; their ratio is the tail backward's overhead.
//! `--dsa` times DSA's discovery instead (`attnproof_gpu::dsa::index`: the lightning indexer fused with its exact top-k,
//! direction `dsa-index`, shape `(T,H_I,d_I,k)`) at T = 16K, 64K and 128K (up to `--dsa-max-t`), H_I = 64, d_I =
//! 128, k = 2048, bf16 inputs and f32 weights at random, with a workspace for the resident CTAs; its `tflops` column
//! counts the causal indexer's products, `2·H_I·d_I·T(T+1)/2`. The same text on `mma.sync` (`DSA_INDEX_MMA_SYNC`,
//! what devices other than Hopper run; tiling `fused@dsa_index_mma_sync`) is timed beside it, its lists compared.
//! `--dsa-source PATH` (repeatable) also times another text of `dsa_index.cu` (after `common.cuh` and `sm90.cuh`)
//! and says on stderr whether its lists equal the embedded kernel's;
//! `--dsa-ctas-per-sm N` (repeatable) times the embedded text with a persistent grid of N CTAs per multiprocessor
//! (tiling `fused/ctasN`) beside the default grid of `attnproof_gpu::dsa::index::resident_ctas`.
//! `bench/dsa_peers.py` puts the rows beside the PyTorch baseline.
//! `--dsa-sparse` times DSA's token-sparse attention forward instead (`attnproof_gpu::dsa::sparse`, direction
//! `dsa-sparse-fwd`, shape `(T,H,d,k)`) at T = 16K, 64K and 128K (up to `--dsa-max-t`), H = 64 query heads over one
//! KV head (MQA), d = dv = 128, k = 2048, lists shared by the heads: token `t` lists all its `t + 1` tokens while
//! they fit, else `k` spread evenly over `0 … t` (`⌊i(t+1)/k⌋`, the last being `t`), so that every gathered row is a
//! different token and neighbouring tokens share few rows; its `tflops` column counts the visited pairs' products,
//! `2·H·(d + dv)·Σ_t min(t + 1, k)`. The launch's default (`wgmma` on Hopper) is timed beside the same text on
//! `mma.sync` (`DSA_SPARSE_MMA_SYNC`, tiling `gather@dsa_sparse_mma_sync`); `--dsa-sparse-source PATH` (repeatable)
//! also times another text of `dsa_sparse.cu`; stderr says whether each output equals the default's bit for bit (the
//! two paths sum each product's terms in different orders, so theirs may differ in the last bits).
//! It also times the backward (`attnproof_gpu::dsa::sparse_backward`, direction `dsa-sparse-bwd`, dK and dV by f32
//! reductions) from the forward's O and LSE and a random dO, its `tflops` counting `2·H·(3d + 2dv)·Σ_t min(t + 1, k)`.
//! Last, the indexer loss on the same lists (`attnproof_gpu::dsa::loss`, direction `dsa-loss`: V3.2's indexer of 64
//! heads of 128 against the forward's queries, keys and LSE as the teacher, both kernels), its `tflops` counting
//! `2·(4·H_I·d_I + H·d)` per visited pair (the indexer's logits twice, ∂q^I and ∂k^I, the teacher's logits).
//! `bench/dsa_sparse_peers.py` puts the rows beside FlexAttention under the same selection.
//! `--all-tilings` also times every tiling the kernel compiles for the head dim (the `default` column marks the one
//! the launch wrappers use). On compute capability 9.0 the dense rows also time the sm_90a forward (`flash_fwd_sm90`, tiling
//! `8x1/sm90`) wherever it takes the head dims; the `default` column marks the kernel and tiling the dense wrapper
//! runs (`attnproof_gpu::production_forward`).
//! `--backward` adds backward rows (dQ, dK, dV and `D` from the forward's O and LSE and a random dO; the forward is
//! run untimed first) for the two-traversals strategy (`default` = 1) and the atomic KV-owner strategy, with FLOPs
//! 2.5 times the forward's; on an H200 also for the backward with the `wgmma` KV owner (`flash_bwd_sm90`, tiling
//! suffix `/sm90`). `--fwd-source PATH` and `--bwd-source PATH` (repeatable) also time the forward or the
//! backward compiled from another text of the kernel (a whole NVRTC source: `common.cuh` followed by a
//! `flash_fwd.cu` or `flash_bwd.cu`), in rows whose tiling ends in `@` and the file's name: one device call can then
//! compare candidate kernels with the embedded ones on the same inputs.
//!
//! `--block-sparse` adds the block-sparse forward (`attnproof_gpu::block_sparse`, E14) at B = 1, H = 16, D = 128,
//! L = 16K, 64K and 128K, causal, 128×128 blocks (the kernel the wrappers pick, `BlockLists::forward_kernel`: on an
//! H200 the sm_90a `wgmma` kernel, with `flash_fwd` beside it in rows `<kind>/mma.sync`; `--wgmma-source PATH`,
//! repeatable, times other texts of `flash_fwd_sm90.cu` in rows `<kind>@<stem>`), with two kinds of lists per query
//! head: the diagonal block plus 8
//! earlier blocks drawn at random (`top8+diag`), and the diagonal plus each earlier block with probability 1/4
//! (`quarter+diag`). Its rows (direction `bsa-fwd`) count effective FLOPs, those of the visited blocks only, each as a
//! full 128×128 block (`4·D·128·128` per visited block and head, the diagonal included), so that the same lists give
//! the same FLOPs to every peer. It also times the block-sparse backward over the same lists (direction `bsa-bwd`,
//! tiling `<kind>/<strategy>`, FLOPs 2.5 times the forward's, each launch validating the lists and building their
//! CSR transpose as a caller's would): the kernel the wrappers pick (`BlockLists::backward_kernel`: on an H200 the
//! `wgmma` KV owner), `flash_bwd` beside it in rows `<kind>/mma.sync/<strategy>`, and, with `--wgmma-bwd-source PATH`
//! (repeatable), other texts of the `wgmma` backward (a whole NVRTC source: `common.cuh`, `sm90.cuh`, `flash_bwd.cu`,
//! `flash_bwd_sm90.cu`) in rows `<kind>@<stem>/<strategy>`, saying on stderr whether each row's dK, dV and dQ equal
//! the production kernel's bit for bit (and dQ's largest difference). `--lists-dir DIR` writes each list tensor there (raw little-endian `i32`,
//! `lists-L<L>-<kind>-1x16x<blocks>x<width>.i32`) for `bench/block_sparse_peers.py` to give FlexAttention.
//! It also times the block selector (`attnproof_gpu::block_sparse::select`, direction `bsa-select`) at L = 16K, 64K,
//! 128K and 256K with 16 query heads over 2 KV heads, D = 128, causal, 128×128 blocks, top-8 without forced blocks
//! (the work of the PyTorch baseline in `block_sparse_peers.py`); its `tflops` column is 0 (not a FLOP count).
//! `--select-source PATH` (repeatable) also times the selector compiled from another text of `bsa_select.cu` (after
//! `common.cuh`, with the same kernel names and launch shapes), in rows whose tiling ends in `@` and the file's name,
//! and says on stderr whether its lists equal the embedded selector's on the same inputs; `--select-chunks N`
//! (repeatable) times the embedded selector under `SelectSchedule::Chunks(N)` beside its default schedule (rows
//! `top8/hkv2/chunksN`, saying on stderr whether the lists are the same), and with `--select-pool-ctas-per-sm P`
//! (repeatable) also under `SelectSchedule::ChunksPooledBy` with P query pooling CTAs per multiprocessor (rows
//! `top8/hkv2/chunksN/poolP`); `--selection-only` leaves
//! out the block-sparse forward and backward rows. At each length the selector also runs at PISA's leaf of 64 keys
//! (64×64 blocks, top-8: `bsa-select`, tiling `top8/hkv2/c64`) beside PISA's covariance-aware selection on the same
//! blocks (`attnproof_gpu::pisa::covariance`, direction `cov-select`, `γ = 1`: the tail's statistics, the spreads and
//! the selector with E24's spread term) and the pyramid selector (`attnproof_gpu::pisa`, direction `pisa-select`:
//! β = 4, K = 8, per query block of 64 rows, each scoring in the tiling column).
//! `--pisa-source PATH` (repeatable) also times the pyramid selector compiled from another text (a whole NVRTC
//! source: `common.cuh`, `bsa_select.cu`, `pisa_select.cu`) in rows whose tiling ends in `@` and the file's name, and
//! says on stderr whether its lists equal the embedded selector's.
//!
//! `--nsa` times NSA's pieces instead (`attnproof_gpu::nsa`) at two configurations, the paper's (directions `nsa-*`:
//! windows of 32 every 16 tokens) and fla-core's (`nsa64-*`: non-overlapping windows of 64), both with 64-token
//! blocks, 16 per list with the first and two local ones forced, at B = 1, T = 16K and 64K, D = 128,
//! 64 query heads over 4 KV heads (group 16, fla-core's benchmark) and 16 over 4 (group 4): the compression of K and V
//! (direction `nsa-compress`; at the paper's windows also with learned `[l·d, d]` matrices: `nsa-compress-matrix`, its
//! transpose onto the tokens `nsa-compress-matrix-transpose` and the matrices' gradients `nsa-compress-matrix-grad`,
//! FLOPs `2·l·d²` per window, KV head and operand each), the compressed attention's forward (`nsa-cmp-fwd`, the dense forward under the strided
//! causal mask; FLOPs `4·d·Hq·Σ_t W(t)` over the windows each token sees) and the selection (`nsa-select`: block
//! scores from the compressed keys and `LSE_cmp`, and top-n lists; FLOPs `2·d·Hq·Σ_t W(t)`, the recomputed score
//! products only), and the selected attention's forward over those lists (`nsa-selected-fwd`; FLOPs `4·d·Hq` times
//! the keys the lists show each token, up to its own: the visible work, not the masked products the kernel also
//! does; at every tiling that holds the group, `-r16` ... `-r64` in the tiling column, the default one marked), its
//! backward with atomic dQ (`nsa-selected-bwd`; FLOPs 2.5 times the forward's) and the compressed attention's
//! backward (`nsa-cmp-bwd`, the dense backward under the strided causal mask, without the pooling's transpose), then
//! once per shape the sliding-window branch (`nsa-window-fwd` and `nsa-window-bwd`, the dense forward and backward
//! under `nsa::window::window_spec`, window 512) and the gated sum of the branches (`nsa-gates`), and last the whole
//! layer through `nsa::layer` at both configurations (`nsa-layer-fwd`, `nsa-layer-bwd`, `nsa64-layer-*`: all three
//! branches, the gates, the pooling's transpose and the branch sums). `--nsa-select-source PATH` (repeatable) also times another text of `nsa_select.cu` and says on stderr
//! whether its lists equal the embedded kernel's; `--nsa-selected-source PATH` another text of `nsa_selected.cu` (at
//! the default tiling), and whether its output equals the embedded kernel's bit for bit.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use attnproof_gpu::backward::{
    BackwardDeviceInputs, BackwardDeviceOutputs, BackwardTiling, GpuBackwardStrategy, flash_backward_device,
    flash_backward_device_with, is_wgmma_backward, production_backward_kernel, wgmma_backward_supports,
};
use attnproof_gpu::block_sparse::backward::{block_sparse_backward_device, block_sparse_backward_device_with};
use attnproof_gpu::block_sparse::select::{
    BSA_SELECT, SelectSchedule, lists_shape, select_blocks_device, select_blocks_device_scheduled, workspace_len,
};
use attnproof_gpu::block_sparse::{BlockLists, ListHeads, block_sparse_forward_device};
use attnproof_gpu::compile::{FLASH_BWD, FLASH_BWD_SM90, FLASH_FWD, FLASH_FWD_SM90, KernelSource, compute_capability};
use attnproof_gpu::dsa::index::{
    self as dsa_index, DSA_INDEX, DSA_INDEX_MMA_SYNC, IndexerShape, ScoreRows, indexer_top_k_device, resident_ctas,
};
use attnproof_gpu::dsa::loss::{DSA_LOSS, LossGradients, LossInputsDevice, LossRows, LossShape, indexer_loss_device};
use attnproof_gpu::dsa::sparse::{DSA_SPARSE, DSA_SPARSE_MMA_SYNC, ListSharing, TokenSelection, token_sparse_device};
use attnproof_gpu::dsa::sparse_backward::{DSA_SPARSE_BWD, token_sparse_backward_device};
use attnproof_gpu::flash::flash_forward_device;
use attnproof_gpu::nsa::compress::{
    NSA_COMPRESS, compress_kv_backward_device, compress_kv_device, compress_map_gradient_device, compressed_shape,
};
use attnproof_gpu::nsa::compressed::compressed_spec;
use attnproof_gpu::nsa::gates::{GateBranches, NSA_GATES, gate_combine_device, gate_logits_shape};
use attnproof_gpu::nsa::layer::{
    NsaLayerBackwardDevice, NsaLayerBackwardInputs, NsaLayerForwardDevice, NsaLayerInputs, NsaLayerKernels,
    nsa_layer_backward_device, nsa_layer_forward_device,
};
use attnproof_gpu::nsa::select::{self as nsa_select, NSA_SELECT};
use attnproof_gpu::nsa::selected::{self as nsa_selected, NSA_SELECTED, SelectedTiling};
use attnproof_gpu::nsa::selected_backward::{NSA_SELECTED_BWD, selected_backward_device};
use attnproof_gpu::nsa::window::window_spec;
use attnproof_gpu::pisa::covariance::{CovarianceWorkspace, PISA_COVARIANCE, covariance_select_device};
use attnproof_gpu::pisa::select::{
    PISA_SELECT, PyramidSelectConfig, lists_shape as pisa_lists_shape, select_pyramid_device,
    workspace_len as pisa_workspace_len,
};
use attnproof_gpu::pisa::tail::{PISA_TAIL, TailPlan, TailWorkspace, pisa_tail_forward_planned};
use attnproof_gpu::pisa::tail_backward::{TailBackwardWorkspace, pisa_tail_backward_device};
use attnproof_gpu::{ForwardTiling, PreparedForward, cuda_device, forward_variant, production_forward};
use attnproof_oracle::bsa::BsaConfig;
use attnproof_oracle::nsa::{Compression, NsaConfig};
use attnproof_oracle::pisa::CovarianceConfig;
use attnproof_oracle::pyramid::{PyramidConfig, Scoring};
use attnproof_oracle::spec::{Operand, strided_causal_keys};
use attnproof_oracle::{AttentionSpec, Mask};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

/// (B, H, L, D) of the table.
const SHAPES: [(usize, usize, usize, usize); 4] =
    [(16, 16, 1024, 64), (4, 16, 4096, 128), (1, 16, 16384, 128), (1, 8, 65536, 128)];
/// Input sets cycled between launches.
const SETS: usize = 3;

struct Options {
    reps: usize,
    warmup: usize,
    all_tilings: bool,
    csv: Option<String>,
    backward: bool,
    /// `--shape B,H,L,D`: only this row of SHAPES (a quick look while tuning; the report runs all of them).
    shape: Option<(usize, usize, usize, usize)>,
    /// `--fwd-source PATH`: other texts of the forward kernel, each timed beside the embedded one.
    fwd_sources: Vec<KernelSource>,
    /// `--bwd-source PATH`: other texts of the backward kernel, each timed beside the embedded one.
    bwd_sources: Vec<KernelSource>,
    /// `--block-sparse`: the block-sparse rows (instead of the dense ones).
    block_sparse: bool,
    /// `--lists-dir DIR`: where the block-sparse rows' lists are written for the peers.
    lists_dir: Option<String>,
    /// `--select-source PATH`: other texts of the block selector, each timed beside the embedded one.
    select_sources: Vec<KernelSource>,
    /// `--pisa-source PATH`: other texts of the pyramid selector, each timed beside the embedded one.
    pisa_sources: Vec<KernelSource>,
    /// `--tail-source PATH`: other texts of PISA's tail kernels, each timed beside the embedded one.
    tail_sources: Vec<KernelSource>,
    /// `--selection-only`: of the block-sparse rows, only the selector's.
    selection_only: bool,
    /// `--select-chunks N`: schedules of the block selector timed beside its default one.
    select_chunks: Vec<usize>,
    /// `--select-pool-ctas-per-sm P`: each of those schedules also with P query pooling CTAs per multiprocessor.
    select_pool_ctas_per_sm: Vec<usize>,
    /// `--wgmma-source PATH`: other texts of the sm_90a forward, each timed in the block-sparse forward rows, with
    /// the file's stem for the CSV.
    wgmma_sources: Vec<(KernelSource, String)>,
    /// `--wgmma-bwd-source PATH`: other texts of the `wgmma` backward, each timed in the block-sparse backward rows,
    /// with the file's stem.
    wgmma_bwd_sources: Vec<(KernelSource, String)>,
    /// `--nsa`: NSA's rows (instead of the dense ones).
    nsa: bool,
    /// `--nsa-select-source PATH`: other texts of NSA's selection, each timed beside the embedded one.
    nsa_select_sources: Vec<KernelSource>,
    /// `--nsa-selected-source PATH`: other texts of NSA's selected attention, each timed beside the embedded one.
    nsa_selected_sources: Vec<KernelSource>,
    /// `--dsa`: DSA's discovery rows (instead of the dense ones).
    dsa: bool,
    /// `--dsa-source PATH`: other texts of the indexer, each timed beside the embedded one.
    dsa_sources: Vec<KernelSource>,
    /// `--dsa-ctas-per-sm N`: the embedded indexer also timed with a workspace for N CTAs per multiprocessor.
    dsa_ctas_per_sm: Vec<usize>,
    /// `--dsa-max-t T`: the longest sequence of the DSA rows.
    dsa_max_t: usize,
    /// `--dsa-sparse`: DSA's token-sparse attention rows (instead of the dense ones).
    dsa_sparse: bool,
    /// `--dsa-sparse-source PATH`: other texts of the token-sparse attention, each timed beside the embedded one.
    dsa_sparse_sources: Vec<KernelSource>,
    /// `--pisa-tail`: PISA's tail forward beside the block-sparse forward on the same lists (instead of the dense rows).
    pisa_tail: bool,
}

/// The kernel text in `path` (given to `flag`, it must define `entry`) as a source the compile cache can key on
/// (leaked: it lives as long as the process).
fn kernel_from_file(flag: &str, path: &str, entry: &str) -> Result<KernelSource, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{flag} {path}: {e}"))?;
    if !text.contains(&format!("{entry}(")) {
        return Err(format!("{flag} {path}: no {entry} kernel in the file"));
    }
    let stem = std::path::Path::new(path).file_stem().and_then(|s| s.to_str()).unwrap_or("variant");
    // NVRTC program names and CSV cells: keep the name plain.
    let name: String = stem.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-').collect();
    Ok(KernelSource { name: Box::leak(name.into_boxed_str()), source: Box::leak(text.into_boxed_str()) })
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        reps: 30,
        warmup: 5,
        all_tilings: false,
        csv: None,
        backward: false,
        shape: None,
        fwd_sources: vec![],
        bwd_sources: vec![],
        block_sparse: false,
        lists_dir: None,
        select_sources: vec![],
        select_chunks: vec![],
        select_pool_ctas_per_sm: vec![],
        pisa_sources: vec![],
        tail_sources: vec![],
        selection_only: false,
        wgmma_sources: vec![],
        wgmma_bwd_sources: vec![],
        nsa: false,
        nsa_select_sources: vec![],
        nsa_selected_sources: vec![],
        dsa: false,
        dsa_sources: vec![],
        dsa_ctas_per_sm: vec![],
        dsa_max_t: 131072,
        dsa_sparse: false,
        dsa_sparse_sources: vec![],
        pisa_tail: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--reps" => o.reps = value("--reps")?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--warmup" => o.warmup = value("--warmup")?.parse().map_err(|e| format!("--warmup: {e}"))?,
            "--csv" => o.csv = Some(value("--csv")?),
            "--all-tilings" => o.all_tilings = true,
            "--backward" => o.backward = true,
            "--block-sparse" => o.block_sparse = true,
            "--lists-dir" => o.lists_dir = Some(value("--lists-dir")?),
            "--selection-only" => o.selection_only = true,
            "--select-chunks" => {
                let n = value("--select-chunks")?.parse().map_err(|e| format!("--select-chunks: {e}"))?;
                o.select_chunks.push(n);
            }
            "--select-pool-ctas-per-sm" => {
                let flag = "--select-pool-ctas-per-sm";
                let n = value(flag)?.parse().map_err(|e| format!("{flag}: {e}"))?;
                o.select_pool_ctas_per_sm.push(n);
            }
            "--pisa-source" => {
                let path = value("--pisa-source")?;
                o.pisa_sources.push(kernel_from_file("--pisa-source", &path, "pisa_select")?);
            }
            "--nsa" => o.nsa = true,
            "--pisa-tail" => o.pisa_tail = true,
            "--tail-source" => {
                let path = value("--tail-source")?;
                o.tail_sources.push(kernel_from_file("--tail-source", &path, "pisa_tail_merge")?);
            }
            "--dsa" => o.dsa = true,
            "--dsa-sparse" => o.dsa_sparse = true,
            "--dsa-sparse-source" => {
                let path = value("--dsa-sparse-source")?;
                o.dsa_sparse_sources.push(kernel_from_file("--dsa-sparse-source", &path, "dsa_sparse_fwd")?);
            }
            "--dsa-source" => {
                let path = value("--dsa-source")?;
                o.dsa_sources.push(kernel_from_file("--dsa-source", &path, "dsa_index_topk")?);
            }
            "--dsa-ctas-per-sm" => {
                let n = value("--dsa-ctas-per-sm")?.parse().map_err(|e| format!("--dsa-ctas-per-sm: {e}"))?;
                o.dsa_ctas_per_sm.push(n);
            }
            "--dsa-max-t" => o.dsa_max_t = value("--dsa-max-t")?.parse().map_err(|e| format!("--dsa-max-t: {e}"))?,
            "--nsa-select-source" => {
                let path = value("--nsa-select-source")?;
                o.nsa_select_sources.push(kernel_from_file("--nsa-select-source", &path, "nsa_block_scores")?);
            }
            "--nsa-selected-source" => {
                let path = value("--nsa-selected-source")?;
                o.nsa_selected_sources.push(kernel_from_file("--nsa-selected-source", &path, "nsa_selected_fwd")?);
            }
            "--select-source" => {
                let path = value("--select-source")?;
                o.select_sources.push(kernel_from_file("--select-source", &path, "bsa_select")?);
            }
            "--wgmma-source" => {
                let path = value("--wgmma-source")?;
                let text = kernel_from_file("--wgmma-source", &path, "flash_fwd")?;
                // Named as the sm_90a kernel, so that its launch plan is that kernel's (`flash::is_wgmma`).
                let kernel = KernelSource { name: FLASH_FWD_SM90.name, source: text.source };
                o.wgmma_sources.push((kernel, text.name.to_owned()));
            }
            "--wgmma-bwd-source" => {
                let path = value("--wgmma-bwd-source")?;
                let text = kernel_from_file("--wgmma-bwd-source", &path, "bwd_kv")?;
                // Named as the wgmma backward, so that its launch plan is that kernel's (`is_wgmma_backward`).
                let kernel = KernelSource { name: FLASH_BWD_SM90.name, source: text.source };
                o.wgmma_bwd_sources.push((kernel, text.name.to_owned()));
            }
            "--fwd-source" => {
                let path = value("--fwd-source")?;
                o.fwd_sources.push(kernel_from_file("--fwd-source", &path, "flash_fwd")?);
            }
            "--bwd-source" => {
                let path = value("--bwd-source")?;
                o.bwd_sources.push(kernel_from_file("--bwd-source", &path, "bwd_kv")?);
            }
            "--shape" => {
                let text = value("--shape")?;
                let dims: Vec<usize> =
                    text.split(',').map(str::parse).collect::<Result<_, _>>().map_err(|e| format!("--shape: {e}"))?;
                let shape = match dims[..] {
                    [b, h, l, d] => (b, h, l, d),
                    _ => return Err(format!("--shape takes B,H,L,D, not `{text}`")),
                };
                if !SHAPES.contains(&shape) {
                    return Err(format!("--shape {text} is not one of {SHAPES:?}"));
                }
                o.shape = Some(shape);
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if !o.bwd_sources.is_empty() && !o.backward {
        return Err("--bwd-source times backward kernels: add --backward".into());
    }
    let block_sparse_only = !o.select_sources.is_empty()
        || !o.pisa_sources.is_empty()
        || !o.wgmma_sources.is_empty()
        || !o.select_chunks.is_empty();
    if (o.selection_only || block_sparse_only || !o.wgmma_bwd_sources.is_empty()) && !o.block_sparse {
        return Err("--selection-only, --select-source, --select-chunks, --pisa-source, --wgmma-source and \
                    --wgmma-bwd-source concern the block-sparse rows: add --block-sparse"
            .into());
    }
    if !o.tail_sources.is_empty() && !o.pisa_tail {
        return Err("--tail-source times PISA's tail: add --pisa-tail".into());
    }
    if o.lists_dir.is_some() && !o.block_sparse {
        return Err("--lists-dir writes the block-sparse rows' lists: add --block-sparse".into());
    }
    if (!o.nsa_select_sources.is_empty() || !o.nsa_selected_sources.is_empty()) && !o.nsa {
        return Err("--nsa-select-source and --nsa-selected-source time NSA's pieces: add --nsa".into());
    }
    if !o.dsa_sources.is_empty() && !o.dsa {
        return Err("--dsa-source times DSA's indexer: add --dsa".into());
    }
    if !o.dsa_ctas_per_sm.is_empty() && !o.dsa {
        return Err("--dsa-ctas-per-sm times DSA's indexer: add --dsa".into());
    }
    if o.dsa_ctas_per_sm.contains(&0) {
        return Err("--dsa-ctas-per-sm: at least one CTA per multiprocessor".into());
    }
    if !o.dsa_sparse_sources.is_empty() && !o.dsa_sparse {
        return Err("--dsa-sparse-source times DSA's token-sparse attention: add --dsa-sparse".into());
    }
    if o.dsa_sparse && (o.dsa || o.nsa || o.block_sparse || o.backward || o.shape.is_some() || o.all_tilings) {
        return Err("--dsa-sparse times its own shapes".into());
    }
    if o.dsa && (o.nsa || o.block_sparse || o.backward || o.shape.is_some() || o.all_tilings) {
        return Err("--dsa times its own shapes".into());
    }
    if o.nsa && (o.block_sparse || o.backward || o.shape.is_some() || o.all_tilings) {
        return Err("--nsa times its own shapes and directions".into());
    }
    if o.block_sparse && (o.backward || o.shape.is_some() || o.all_tilings) {
        return Err("--block-sparse times its own shapes, forward only".into());
    }
    if o.reps < 20 {
        return Err("--reps must be at least 20 (the median of fewer launches is too noisy to report)".into());
    }
    Ok(o)
}

/// Deterministic standard-normal-ish bf16 values (Irwin–Hall sum of four uniforms, scaled to unit variance): random
/// enough that no cache or zero-skipping helps, and cheap enough for a billion elements.
fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut next = xorshift(seed);
    (0..n)
        .map(|_| {
            let r = next();
            let sum: f32 = (0..4).map(|i| ((r >> (16 * i)) & 0xffff) as f32 / 65536.0).sum();
            bf16::from_f32((sum - 2.0) * 1.732_050_8)
        })
        .collect()
}

/// A xorshift64 stream from `seed` (never the all-zero state).
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

struct Inputs {
    q: Vec<CudaSlice<bf16>>,
    k: Vec<CudaSlice<bf16>>,
    v: Vec<CudaSlice<bf16>>,
}

fn upload(stream: &Arc<CudaStream>, n: usize, seed: u64) -> Result<CudaSlice<bf16>, String> {
    stream.clone_htod(&random_bf16(n, seed)).map_err(|e| format!("upload: {e}"))
}

/// Median milliseconds of `reps` calls of `launch(set)`, each bracketed by CUDA events, after `warmup` untimed
/// ones, cycling the input sets.
/// [`SETS`] input sets of `n` random bf16 each for Q, K and V (seeds `3s + 1`, `+ 2`, `+ 3`).
fn upload_sets(stream: &Arc<CudaStream>, n: usize) -> Result<Inputs, String> {
    let mut inputs = Inputs { q: vec![], k: vec![], v: vec![] };
    for s in 0..SETS as u64 {
        inputs.q.push(upload(stream, n, 3 * s + 1)?);
        inputs.k.push(upload(stream, n, 3 * s + 2)?);
        inputs.v.push(upload(stream, n, 3 * s + 3)?);
    }
    Ok(inputs)
}

fn median_ms(
    stream: &Arc<CudaStream>,
    opts: &Options,
    mut launch: impl FnMut(usize) -> Result<(), String>,
) -> Result<f64, String> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let err = |e: &dyn std::fmt::Display| e.to_string();
    for i in 0..opts.warmup {
        launch(i % SETS)?;
    }
    let mut events = Vec::with_capacity(opts.reps);
    for i in 0..opts.reps {
        let start = stream.record_event(flags).map_err(|e| err(&e))?;
        launch(i % SETS)?;
        let end = stream.record_event(flags).map_err(|e| err(&e))?;
        events.push((start, end));
    }
    stream.synchronize().map_err(|e| err(&e))?;
    let mut ms = events
        .iter()
        .map(|(a, b)| a.elapsed_ms(b).map(f64::from))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(&e))?;
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// The backward's inputs beyond Q, K, V: per input set the forward's `O` and LSE, and a random `dO`.
struct BackwardInputs {
    o: Vec<CudaSlice<bf16>>,
    lse: Vec<CudaSlice<f32>>,
    d_out: Vec<CudaSlice<bf16>>,
}

impl BackwardInputs {
    /// The backward's device inputs of input set `s`.
    fn device_inputs<'a>(&'a self, inputs: &'a Inputs, s: usize) -> BackwardDeviceInputs<'a, bf16> {
        BackwardDeviceInputs {
            q: &inputs.q[s],
            k: &inputs.k[s],
            v: &inputs.v[s],
            o: &self.o[s],
            lse: &self.lse[s],
            d_out: &self.d_out[s],
        }
    }
}

/// Runs the forward on every input set (untimed) and draws the upstream gradients.
fn backward_inputs(
    stream: &Arc<CudaStream>,
    fwd: &PreparedForward<bf16>,
    inputs: &Inputs,
    n: usize,
    rows: usize,
) -> Result<BackwardInputs, String> {
    let mut out = BackwardInputs { o: vec![], lse: vec![], d_out: vec![] };
    for s in 0..SETS {
        let mut o = stream.alloc_zeros::<bf16>(n).map_err(|e| e.to_string())?;
        let mut lse = stream.alloc_zeros::<f32>(rows).map_err(|e| e.to_string())?;
        fwd.launch(stream, &inputs.q[s], &inputs.k[s], &inputs.v[s], &mut o, &mut lse).map_err(|e| e.to_string())?;
        out.o.push(o);
        out.lse.push(lse);
        out.d_out.push(upload(stream, n, 100 + s as u64)?);
    }
    Ok(out)
}

/// The tiling column's suffix naming a kernel text from a file (empty for the embedded kernel).
fn source_suffix(kernel: KernelSource, embedded: bool) -> String {
    if embedded { String::new() } else { format!("@{}", kernel.name) }
}

/// Times `run` with each of `kernels` (the embedded text first) writing into `lists`, says on stderr whether each
/// other text's lists (from the last timed launch's input set, the same for every text) equal the embedded text's,
/// and emits `row(suffix, default, ms)` per text (`suffix` from [`source_suffix`], `default` 1 for the embedded one).
/// Returns the embedded text's lists.
fn time_list_kernels(
    stream: &Arc<CudaStream>,
    opts: &Options,
    kernels: impl IntoIterator<Item = KernelSource>,
    lists: &mut CudaSlice<i32>,
    what: &str,
    out: &mut String,
    mut run: impl FnMut(KernelSource, usize, &mut CudaSlice<i32>) -> Result<(), String>,
    row: impl Fn(&str, u8, f64) -> String,
) -> Result<Vec<i32>, String> {
    let mut embedded_lists = None;
    for kernel in kernels {
        let ms = median_ms(stream, opts, |s| run(kernel, s, lists))?;
        let got = stream.clone_dtoh(lists).map_err(|e| e.to_string())?;
        let suffix = source_suffix(kernel, embedded_lists.is_none());
        match &embedded_lists {
            None => embedded_lists = Some(got),
            Some(want) => eprintln!("{what}{suffix}: lists equal the embedded text's: {}", *want == got),
        }
        emit(out, row(&suffix, u8::from(suffix.is_empty()), ms));
    }
    Ok(embedded_lists.unwrap_or_default())
}

/// One CSV row, printed at once (a long run shows progress) and kept for `--csv`.
fn emit(out: &mut String, line: String) {
    print!("{line}");
    std::io::stdout().flush().ok();
    out.push_str(&line);
}

/// The strategies the benchmark times; the KV-owner with atomic dQ (FlashAttention-2's) is the default row the peers
/// are compared with. The deterministic KV-owner mode is left out: its per-KV-tile dQ partials take `⌈Lk/128⌉`
/// copies of dQ in f32 (134 GB at L = 65536), so it is a verification mode, not a fast path.
const TIMED_STRATEGIES: [(GpuBackwardStrategy, &str); 2] =
    [(GpuBackwardStrategy::TwoTraversals, "two-traversals"), (GpuBackwardStrategy::KvOwnerAtomic, "kv-owner-atomic")];

/// The block-sparse rows' sequence lengths, heads and head dim (B = 1), and their block size.
const BLOCK_SPARSE_LENGTHS: [usize; 3] = [16384, 65536, 131072];
const BLOCK_SPARSE_HEADS: usize = 16;
const BLOCK_SPARSE_DIM: usize = 128;
const BLOCK: usize = 128;

/// The two kinds of lists of the block-sparse rows.
#[derive(Clone, Copy, Debug)]
enum ListKind {
    /// The diagonal block and 8 earlier blocks at random (all earlier ones when there are fewer).
    TopEightAndDiagonal,
    /// The diagonal block and each earlier block with probability 1/4.
    QuarterAndDiagonal,
}

impl ListKind {
    fn name(self) -> &'static str {
        match self {
            ListKind::TopEightAndDiagonal => "top8+diag",
            ListKind::QuarterAndDiagonal => "quarter+diag",
        }
    }
}

/// Causal lists per query head (`[1, heads, blocks, width]`, width the longest list) and the visited block count.
fn causal_lists(blocks: usize, heads: usize, kind: ListKind, seed: u64) -> (ndarray::Array4<i32>, usize) {
    let mut next = xorshift(seed);
    let rows: Vec<Vec<i32>> = (0..heads * blocks)
        .map(|row| {
            let a = row % blocks;
            let mut chosen: Vec<usize> = match kind {
                ListKind::TopEightAndDiagonal => {
                    // A partial Fisher–Yates shuffle of the earlier blocks: the first min(8, a) are a uniform draw.
                    let mut earlier: Vec<usize> = (0..a).collect();
                    let take = a.min(8);
                    for i in 0..take {
                        let j = i + (next() % (a - i) as u64) as usize;
                        earlier.swap(i, j);
                    }
                    earlier.truncate(take);
                    earlier
                }
                ListKind::QuarterAndDiagonal => (0..a).filter(|_| next().is_multiple_of(4)).collect(),
            };
            chosen.push(a);
            chosen.sort_unstable();
            chosen.into_iter().map(|b| b as i32).collect()
        })
        .collect();
    let width = rows.iter().map(Vec::len).max().unwrap_or(0);
    let visited = rows.iter().map(Vec::len).sum();
    let mut lists = ndarray::Array4::from_elem((1, heads, blocks, width), -1i32);
    for (row, entries) in rows.iter().enumerate() {
        for (w, &b) in entries.iter().enumerate() {
            lists[[0, row / blocks, row % blocks, w]] = b;
        }
    }
    (lists, visited)
}

/// The selector rows' lengths and KV heads (16 query heads, D = 128).
const SELECTION_LENGTHS: [usize; 4] = [16384, 65536, 131072, 262144];
const SELECTION_KV_HEADS: usize = 2;

/// The block selector's rows (see the module docs).
fn run_selection(opts: &Options, stream: &Arc<CudaStream>, out: &mut String) -> Result<(), String> {
    let (h, hkv, d) = (BLOCK_SPARSE_HEADS, SELECTION_KV_HEADS, BLOCK_SPARSE_DIM);
    let config = BsaConfig { q_block: BLOCK, kv_block: BLOCK, top_k: 8, force_first: false, force_local: 0 };
    for l in SELECTION_LENGTHS {
        let spec = AttentionSpec::dense(1, h, hkv, l, l, d, d).with_mask(Mask::Causal);
        let mut q = vec![];
        let mut k = vec![];
        for s in 0..SETS as u64 {
            q.push(upload(stream, h * l * d, 3 * s + 1)?);
            k.push(upload(stream, hkv * l * d, 3 * s + 2)?);
        }
        let mut pooled = stream.alloc_zeros::<f64>(workspace_len(&spec, &config)).map_err(|e| e.to_string())?;
        let mut lists =
            stream.alloc_zeros::<i32>(lists_shape(&spec, &config).iter().product()).map_err(|e| e.to_string())?;
        let embedded = time_list_kernels(
            stream,
            opts,
            std::iter::once(BSA_SELECT).chain(opts.select_sources.iter().copied()),
            &mut lists,
            &format!("L = {l}, selector"),
            out,
            |kernel, s, lists| {
                select_blocks_device(stream, &spec, &config, kernel, &q[s], &k[s], &mut pooled, lists)
                    .map_err(|e| e.to_string())
            },
            |suffix, default, ms| {
                format!("\"(1,{h},{l},{d})\",true,bsa-select,top8/hkv{hkv}{suffix},{default},{ms:.4},0.0\n")
            },
        )?;
        let sms = attnproof_gpu::common::multiprocessors(stream.context()).map_err(|e| e.to_string())?;
        let schedules = opts.select_chunks.iter().flat_map(|&chunks| {
            std::iter::once((SelectSchedule::Chunks(chunks), format!("chunks{chunks}"))).chain(
                opts.select_pool_ctas_per_sm.iter().map(move |&per_sm| {
                    let schedule = SelectSchedule::ChunksPooledBy { chunks, pool_ctas: per_sm * sms };
                    (schedule, format!("chunks{chunks}/pool{per_sm}"))
                }),
            )
        });
        for (schedule, label) in schedules {
            let ms = median_ms(stream, opts, |s| {
                select_blocks_device_scheduled(
                    stream,
                    &spec,
                    &config,
                    BSA_SELECT,
                    (&q[s], &k[s]),
                    &mut pooled,
                    &mut lists,
                    schedule,
                )
                .map_err(|e| e.to_string())
            })?;
            let got = stream.clone_dtoh(&lists).map_err(|e| e.to_string())?;
            eprintln!("L = {l}, selector under {label}: lists equal the default schedule's: {}", got == embedded);
            emit(out, format!("\"(1,{h},{l},{d})\",true,bsa-select,top8/hkv{hkv}/{label},0,{ms:.4},0.0\n"));
        }
        run_pyramid_selection(opts, stream, &spec, (&q, &k), out)?;
    }
    Ok(())
}

/// The pyramid selector's rows beside BSA's at PISA's leaf of 64 keys (see the module docs): on the same inputs, BSA
/// with 64×64 blocks and top-8, then the pyramid (β = 4, K = 8) under each scoring.
fn run_pyramid_selection(
    opts: &Options,
    stream: &Arc<CudaStream>,
    spec: &AttentionSpec,
    (q, k): (&[CudaSlice<bf16>], &[CudaSlice<bf16>]),
    out: &mut String,
) -> Result<(), String> {
    let (h, l, d) = (spec.n_heads_q, spec.sequences()[0].len_k, spec.head_dim);
    let hkv = spec.n_heads_kv;
    let bsa = BsaConfig { q_block: 64, kv_block: 64, top_k: 8, force_first: false, force_local: 0 };
    let mut pooled = stream.alloc_zeros::<f64>(workspace_len(spec, &bsa)).map_err(|e| e.to_string())?;
    let mut lists = stream.alloc_zeros::<i32>(lists_shape(spec, &bsa).iter().product()).map_err(|e| e.to_string())?;
    let ms = median_ms(stream, opts, |s| {
        select_blocks_device(stream, spec, &bsa, BSA_SELECT, &q[s], &k[s], &mut pooled, &mut lists)
            .map_err(|e| e.to_string())
    })?;
    emit(out, format!("\"(1,{h},{l},{d})\",true,bsa-select,top8/hkv{hkv}/c64,1,{ms:.4},0.0\n"));
    // E24's covariance-aware selection on the same blocks and inputs (its values one more upload): the tail's
    // statistics, the spreads, the pooling and BSA's selector with the spread term.
    let cov = CovarianceConfig { bsa, gamma: 1.0 };
    let v: Vec<CudaSlice<bf16>> =
        (0..SETS as u64).map(|s| upload(stream, hkv * l * d, 3 * s + 3)).collect::<Result<_, _>>()?;
    let mut work = CovarianceWorkspace::alloc(stream, spec, &cov).map_err(|e| e.to_string())?;
    let ms = median_ms(stream, opts, |s| {
        covariance_select_device(stream, spec, &cov, PISA_COVARIANCE, (&q[s], &k[s], &v[s]), &mut work, &mut lists)
            .map_err(|e| e.to_string())
    })?;
    emit(out, format!("\"(1,{h},{l},{d})\",true,cov-select,top8/hkv{hkv}/c64/g1,1,{ms:.4},0.0\n"));
    for (name, scoring) in [("lse", Scoring::Lse), ("pisa1", Scoring::Pisa1), ("pisa2", Scoring::Pisa2)] {
        let config = PyramidSelectConfig {
            q_block: 64,
            pyramid: PyramidConfig { leaf_size: 64, branching: 4, keep: 8, scoring },
        };
        let mut pooled = stream.alloc_zeros::<f64>(pisa_workspace_len(spec, &config)).map_err(|e| e.to_string())?;
        let mut lists =
            stream.alloc_zeros::<i32>(pisa_lists_shape(spec, &config).iter().product()).map_err(|e| e.to_string())?;
        time_list_kernels(
            stream,
            opts,
            std::iter::once(PISA_SELECT).chain(opts.pisa_sources.iter().copied()),
            &mut lists,
            &format!("L = {l}, pyramid {name}"),
            out,
            |kernel, s, lists| {
                select_pyramid_device(stream, spec, &config, kernel, (&q[s], &k[s]), &mut pooled, lists, None)
                    .map_err(|e| e.to_string())
            },
            |suffix, default, ms| {
                format!(
                    "\"(1,{h},{l},{d})\",true,pisa-select,{name}/b4/k8/hkv{hkv}/c64{suffix},{default},{ms:.4},0.0\n"
                )
            },
        )?;
    }
    Ok(())
}

/// The block-sparse rows (see the module docs).
fn run_block_sparse(opts: &Options, stream: &Arc<CudaStream>, out: &mut String) -> Result<(), String> {
    let (h, d) = (BLOCK_SPARSE_HEADS, BLOCK_SPARSE_DIM);
    let device = compute_capability(stream.context()).map_err(|e| e.to_string())?;
    for l in BLOCK_SPARSE_LENGTHS {
        let n = h * l * d;
        let inputs = upload_sets(stream, n)?;
        let mut o = stream.alloc_zeros::<bf16>(n).map_err(|e| e.to_string())?;
        let mut lse = stream.alloc_zeros::<f32>(h * l).map_err(|e| e.to_string())?;
        let spec = AttentionSpec::dense(1, h, h, l, l, d, d).with_mask(Mask::Causal);
        let blocks = l / BLOCK;
        for kind in [ListKind::TopEightAndDiagonal, ListKind::QuarterAndDiagonal] {
            let (lists, visited) = causal_lists(blocks, h, kind, l as u64);
            if let Some(dir) = &opts.lists_dir {
                let (_, _, _, width) = lists.dim();
                let path = format!("{dir}/lists-L{l}-{}-1x{h}x{blocks}x{width}.i32", kind.name());
                let bytes: Vec<u8> = lists.iter().flat_map(|x| x.to_le_bytes()).collect();
                std::fs::write(&path, bytes).map_err(|e| format!("write {path}: {e}"))?;
            }
            let density = visited as f64 / (h * blocks * (blocks + 1) / 2) as f64;
            eprintln!(
                "L = {l}, {}: {visited} visited blocks, {:.2}% of the causal blocks",
                kind.name(),
                100.0 * density
            );
            let lists = BlockLists { q_block: BLOCK, kv_block: BLOCK, heads: ListHeads::PerQueryHead, lists };
            let flops = 4.0 * (d * BLOCK * BLOCK) as f64 * visited as f64;
            // The production kernel (default 1), then `flash_fwd` where that is another kernel, then any other texts
            // of the sm_90a kernel, all on the same lists and inputs.
            let production = lists.forward_kernel(&spec, device);
            let mut kernels = vec![(production, kind.name().to_owned())];
            if production != FLASH_FWD {
                kernels.push((FLASH_FWD, format!("{}/mma.sync", kind.name())));
            }
            kernels.extend(opts.wgmma_sources.iter().map(|(k, stem)| (*k, format!("{}@{stem}", kind.name()))));
            for (kernel, tiling) in &kernels {
                let fwd =
                    PreparedForward::<bf16>::block_sparse(stream, &spec, &lists, *kernel).map_err(|e| e.to_string())?;
                let ms = median_ms(stream, opts, |s| {
                    fwd.launch(stream, &inputs.q[s], &inputs.k[s], &inputs.v[s], &mut o, &mut lse)
                        .map_err(|e| e.to_string())
                })?;
                let default = u8::from(*kernel == production);
                emit(
                    out,
                    format!("\"(1,{h},{l},{d})\",true,bsa-fwd,{tiling},{default},{ms:.4},{:.1}\n", flops / ms / 1e9),
                );
            }
            let fwd =
                PreparedForward::<bf16>::block_sparse(stream, &spec, &lists, production).map_err(|e| e.to_string())?;
            let extra = backward_inputs(stream, &fwd, &inputs, n, h * l)?;
            let (mut dq, mut dk, mut dv) = (alloc(stream, n)?, alloc(stream, n)?, alloc(stream, n)?);
            let mut delta = stream.alloc_zeros::<f32>(h * l).map_err(|e| e.to_string())?;
            // The production backward, then `flash_bwd` where that is another kernel, then other texts of the wgmma
            // backward.
            let production = lists.backward_kernel(&spec, device);
            let mut kernels = vec![(production, kind.name().to_owned())];
            if production != FLASH_BWD {
                kernels.push((FLASH_BWD, format!("{}/mma.sync", kind.name())));
            }
            kernels.extend(opts.wgmma_bwd_sources.iter().map(|(k, stem)| (*k, format!("{}@{stem}", kind.name()))));
            // The production kernel's outputs per strategy, for the other texts' to be compared with.
            let mut production_outputs: Vec<(GpuBackwardStrategy, Vec<Vec<bf16>>)> = vec![];
            for ((kernel, label), (strategy, name)) in
                kernels.iter().flat_map(|k| TIMED_STRATEGIES.iter().map(move |s| (k, s)))
            {
                // Each launch validates the lists and builds their CSR transpose on the device, as a caller's would.
                let ms = median_ms(stream, opts, |s| {
                    let inputs = extra.device_inputs(&inputs, s);
                    let outputs = BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta };
                    block_sparse_backward_device_with(
                        stream,
                        &spec,
                        &lists,
                        *kernel,
                        lists.backward_tiling(),
                        inputs,
                        outputs,
                        *strategy,
                    )
                    .map_err(|e| e.to_string())
                })?;
                // With other texts to judge, each row's outputs are compared with the production kernel's (every
                // timed launch read the same input set last): dK and dV must be its bits (the same recipe in the
                // same order), dQ too under two traversals, while the atomic dQ's order of additions may differ (its
                // largest difference is reported).
                if !opts.wgmma_bwd_sources.is_empty() {
                    let got = [&dq, &dk, &dv]
                        .map(|t| stream.clone_dtoh(t))
                        .into_iter()
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| e.to_string())?;
                    if *kernel == production {
                        production_outputs.push((*strategy, got));
                    } else if let Some((_, want)) = production_outputs.iter().find(|(s, _)| s == strategy) {
                        let largest = want[0]
                            .iter()
                            .zip(&got[0])
                            .map(|(x, y)| (x.to_f32() - y.to_f32()).abs())
                            .fold(0.0f32, f32::max);
                        eprintln!(
                            "L = {l}, {label}/{name}: dK bitwise {}, dV bitwise {}, dQ bitwise {} (largest |difference| \
                             {largest:e})",
                            want[1] == got[1],
                            want[2] == got[2],
                            want[0] == got[0],
                        );
                    }
                }
                let default = u8::from(*strategy == GpuBackwardStrategy::KvOwnerAtomic && *kernel == production);
                emit(
                    out,
                    format!(
                        "\"(1,{h},{l},{d})\",true,bsa-bwd,{label}/{name},{default},{ms:.4},{:.1}\n",
                        2.5 * flops / ms / 1e9
                    ),
                );
            }
        }
    }
    Ok(())
}

/// NSA's rows (see the module docs): (T, Hq, Hkv) at D = 128.
const NSA_SHAPES: [(usize, usize, usize); 4] = [(16384, 64, 4), (65536, 64, 4), (16384, 16, 4), (65536, 16, 4)];

/// NSA's configurations the rows are timed at, with their rows' direction prefix: the paper's (windows of 32 every
/// 16 tokens) and fla-core's (non-overlapping windows of 64, so a block's score is one window's), both with 64-token
/// blocks, 16 per list, the first and two local ones forced.
fn nsa_configs() -> [(&'static str, NsaConfig); 2] {
    let paper = NsaConfig::default();
    let fla = NsaConfig { compress_len: 64, compress_stride: 64, ..NsaConfig::default() };
    [("nsa", paper), ("nsa64", fla)]
}

fn run_nsa(opts: &Options, stream: &Arc<CudaStream>, out: &mut String) -> Result<(), String> {
    let d = BLOCK_SPARSE_DIM;
    for (l, hq, hkv) in NSA_SHAPES {
        let layer = AttentionSpec::dense(1, hq, hkv, l, l, d, d).with_mask(Mask::Causal);
        let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
        for s in 0..SETS as u64 {
            q.push(upload(stream, hq * l * d, 3 * s + 1)?);
            k.push(upload(stream, hkv * l * d, 3 * s + 2)?);
            v.push(upload(stream, hkv * l * d, 3 * s + 3)?);
        }
        for (prefix, config) in nsa_configs() {
            run_nsa_config(opts, stream, out, &layer, (prefix, &config), [&q, &k, &v])?;
        }
        run_nsa_window_and_gates(opts, stream, out, &layer, [&q, &k, &v])?;
        for (prefix, config) in nsa_configs() {
            run_nsa_layer(opts, stream, out, &layer, (prefix, &config), [&q, &k, &v])?;
        }
    }
    Ok(())
}

/// The rows every configuration shares: the sliding-window branch (`nsa-window-fwd`: the dense forward under
/// `window_spec`, window 512; FLOPs `4·d·Hq` per visible pair) and the gated sum of the three branch outputs
/// (`nsa-gates`: one pass over four `[T, Hq, dv]` tensors).
fn run_nsa_window_and_gates(
    opts: &Options,
    stream: &Arc<CudaStream>,
    out: &mut String,
    layer: &AttentionSpec,
    [q, k, v]: [&Vec<CudaSlice<bf16>>; 3],
) -> Result<(), String> {
    let e = |e: attnproof_gpu::GpuError| e.to_string();
    let config = NsaConfig::default();
    let (d, hq, hkv, l) = (layer.head_dim, layer.n_heads_q, layer.n_heads_kv, layer.sequences()[0].len_q);
    let shape = format!("\"(1,{hq},{l},{d})\",true");
    let window = window_spec(layer, &config).map_err(e)?;
    let count = |op: Operand| layer.expected_shape(op).iter().product::<usize>();
    let mut o_win = alloc(stream, count(Operand::O))?;
    let mut lse = stream.alloc_zeros::<f32>(count(Operand::RowStat)).map_err(|e| e.to_string())?;
    let ms = median_ms(stream, opts, |s| {
        flash_forward_device(stream, &window, &q[s], &k[s], &v[s], &mut o_win, &mut lse).map_err(e)
    })?;
    let pairs: f64 = (0..l).map(|t| (t + 1).min(config.window) as f64).sum();
    emit(out, format!("{shape},nsa-window-fwd,hkv{hkv},1,{ms:.4},{:.1}\n", 4.0 * (d * hq) as f64 * pairs / ms / 1e9));
    let mut grads = BackwardGrads::new(stream, &window)?;
    let ms = median_ms(stream, opts, |s| {
        let inputs =
            BackwardDeviceInputs { q: &q[s], k: &k[s], v: &v[s], o: &o_win, lse: &lse, d_out: &q[(s + 1) % SETS] };
        flash_backward_device(stream, &window, inputs, grads.outputs(), GpuBackwardStrategy::KvOwnerAtomic).map_err(e)
    })?;
    emit(out, format!("{shape},nsa-window-bwd,hkv{hkv},1,{ms:.4},{:.1}\n", 10.0 * (d * hq) as f64 * pairs / ms / 1e9));
    // The branch outputs are the window output three times (their values do not change the time).
    let logits = alloc(stream, gate_logits_shape(layer).iter().product())?;
    let mut o = alloc(stream, count(Operand::O))?;
    let branches = GateBranches { compressed: &o_win, selected: &o_win, window: &o_win };
    let ms = median_ms(stream, opts, |_| {
        gate_combine_device(stream, layer, NSA_GATES, branches, &logits, &mut o).map_err(e)
    })?;
    emit(out, format!("{shape},nsa-gates,hkv{hkv},1,{ms:.4},0.0\n"));
    Ok(())
}

/// The whole layer through `nsa::layer` (all three branches, window 512, the gates, gate logits 0) under one
/// configuration: `{prefix}-layer-fwd` (compression, compressed attention, selection, selected attention, window,
/// gates) and `{prefix}-layer-bwd` (the gates' backward, the three attention backwards with atomic dQ, the pooling's
/// transpose, the branch sums), each timed on its own after an untimed forward; FLOPs not stated (0.0).
fn run_nsa_layer(
    opts: &Options,
    stream: &Arc<CudaStream>,
    out: &mut String,
    layer: &AttentionSpec,
    (prefix, config): (&str, &NsaConfig),
    [q, k, v]: [&Vec<CudaSlice<bf16>>; 3],
) -> Result<(), String> {
    let e = |e: attnproof_gpu::GpuError| e.to_string();
    let (d, hq, hkv, l) = (layer.head_dim, layer.n_heads_q, layer.n_heads_kv, layer.sequences()[0].len_q);
    let shape = format!("\"(1,{hq},{l},{d})\",true");
    let kernels = NsaLayerKernels::default();
    let logits = alloc(stream, gate_logits_shape(layer).iter().product())?;
    let mut forward = NsaLayerForwardDevice::alloc(stream, layer, config).map_err(e)?;
    let inputs = |s: usize| NsaLayerInputs { q: &q[s], k: &k[s], v: &v[s], gate_logits: &logits };
    let ms = median_ms(stream, opts, |s| {
        nsa_layer_forward_device(stream, layer, config, &kernels, inputs(s), &mut forward).map_err(e)
    })?;
    emit(out, format!("{shape},{prefix}-layer-fwd,hkv{hkv},1,{ms:.4},0.0\n"));
    nsa_layer_forward_device(stream, layer, config, &kernels, inputs(0), &mut forward).map_err(e)?;
    let mut grads = NsaLayerBackwardDevice::alloc(stream, layer, config).map_err(e)?;
    let ms = median_ms(stream, opts, |s| {
        // The forward of set 0 with the upstream gradient of another set (its values do not change the time).
        let backward = NsaLayerBackwardInputs { layer: inputs(0), forward: &forward, d_out: &q[(s + 1) % SETS] };
        let strategy = GpuBackwardStrategy::KvOwnerAtomic;
        nsa_layer_backward_device(stream, layer, config, &kernels, backward, strategy, &mut grads).map_err(e)
    })?;
    emit(out, format!("{shape},{prefix}-layer-bwd,hkv{hkv},1,{ms:.4},0.0\n"));
    Ok(())
}

/// The learned compression matrices (`Compression::Linear`, `[l·d, d]` for K and V) at `config`'s windows: the
/// compression (`nsa-compress-matrix`, FLOPs `2·l·d²` per window, KV head and operand), the pooling's transpose onto the
/// tokens (`nsa-compress-matrix-transpose`, the same FLOPs) and the matrices' own gradients
/// (`nsa-compress-matrix-grad`, the same FLOPs), the last two from the compressed operands as upstream gradients.
fn run_nsa_matrix(
    opts: &Options,
    stream: &Arc<CudaStream>,
    out: &mut String,
    layer: &AttentionSpec,
    config: &NsaConfig,
    [k, v]: [&CudaSlice<bf16>; 2],
    [up_k, up_v]: [&CudaSlice<bf16>; 2],
) -> Result<(), String> {
    let e = |e: attnproof_gpu::GpuError| e.to_string();
    let (d, dv, hq, hkv, len) =
        (layer.head_dim, layer.head_dim_v, layer.n_heads_q, layer.n_heads_kv, layer.sequences()[0].len_q);
    let l = config.compress_len;
    let matrix = |cols: usize| {
        Compression::Linear(ndarray::Array2::from_shape_fn((l * cols, cols), |(r, c)| {
            (((r * 7 + c * 3) % 11) as f64 / 5.0 - 1.0) / (l * cols) as f64
        }))
    };
    let config = NsaConfig { compress_keys: matrix(d), compress_values: matrix(dv), ..config.clone() };
    let windows = attnproof_oracle::nsa::complete_windows(len, l, config.compress_stride).map_err(|e| e.to_string())?;
    let flops = 2.0 * (l * (d * d + dv * dv) * windows * hkv) as f64;
    let shape = format!("\"(1,{hq},{len},{d})\",true");
    let count = |op: Operand| layer.expected_shape(op).iter().product::<usize>();
    let cmp = |op: Operand| compressed_shape(layer, &config, op).map(|s| s.iter().product::<usize>()).map_err(e);
    let (mut k_cmp, mut v_cmp) = (alloc(stream, cmp(Operand::K)?)?, alloc(stream, cmp(Operand::V)?)?);
    let ms = median_ms(stream, opts, |_| {
        compress_kv_device(stream, layer, &config, NSA_COMPRESS, k, v, &mut k_cmp, &mut v_cmp).map_err(e)
    })?;
    emit(out, format!("{shape},nsa-compress-matrix,hkv{hkv},1,{ms:.4},{:.1}\n", flops / ms / 1e9));
    let (mut dk, mut dv_tokens) = (alloc(stream, count(Operand::K))?, alloc(stream, count(Operand::V))?);
    let ms = median_ms(stream, opts, |_| {
        compress_kv_backward_device(stream, layer, &config, NSA_COMPRESS, up_k, up_v, &mut dk, &mut dv_tokens)
            .map_err(e)
    })?;
    emit(out, format!("{shape},nsa-compress-matrix-transpose,hkv{hkv},1,{ms:.4},{:.1}\n", flops / ms / 1e9));
    let grad = |cols: usize| stream.alloc_zeros::<f32>(l * cols * cols).map_err(|e| e.to_string());
    let (mut dw_k, mut dw_v) = (grad(d)?, grad(dv)?);
    let ms = median_ms(stream, opts, |_| {
        compress_map_gradient_device(stream, layer, &config, NSA_COMPRESS, Operand::K, k, up_k, &mut dw_k)
            .map_err(e)?;
        compress_map_gradient_device(stream, layer, &config, NSA_COMPRESS, Operand::V, v, up_v, &mut dw_v).map_err(e)
    })?;
    emit(out, format!("{shape},nsa-compress-matrix-grad,hkv{hkv},1,{ms:.4},{:.1}\n", flops / ms / 1e9));
    Ok(())
}

/// NSA's rows of one layer under one configuration (directions `{prefix}-compress`, ...), on the input sets `q`, `k`,
/// `v`.
fn run_nsa_config(
    opts: &Options,
    stream: &Arc<CudaStream>,
    out: &mut String,
    layer: &AttentionSpec,
    (prefix, config): (&str, &NsaConfig),
    [q, k, v]: [&Vec<CudaSlice<bf16>>; 3],
) -> Result<(), String> {
    let e = |e: attnproof_gpu::GpuError| e.to_string();
    let (d, hq, hkv, l) = (layer.head_dim, layer.n_heads_q, layer.n_heads_kv, layer.sequences()[0].len_q);
    let compressed = compressed_spec(layer, config).map_err(e)?;
    let count = |op: Operand| compressed.expected_shape(op).iter().product::<usize>();
    let (mut k_cmp, mut v_cmp) = (alloc(stream, count(Operand::K))?, alloc(stream, count(Operand::V))?);
    let mut o_cmp = alloc(stream, count(Operand::O))?;
    let mut lse = stream.alloc_zeros::<f32>(count(Operand::RowStat)).map_err(|e| e.to_string())?;
    let shape = format!("\"(1,{hq},{l},{d})\",true");
    let ms = median_ms(stream, opts, |s| {
        compress_kv_device(stream, layer, config, NSA_COMPRESS, &k[s], &v[s], &mut k_cmp, &mut v_cmp).map_err(e)
    })?;
    emit(out, format!("{shape},{prefix}-compress,hkv{hkv},1,{ms:.4},0.0\n"));
    if prefix == "nsa" {
        run_nsa_matrix(opts, stream, out, layer, config, [&k[0], &v[0]], [&k_cmp, &v_cmp])?;
    }
    // The windows each token sees, summed: the compressed products' length.
    let seen: f64 = (0..l).map(|t| strided_causal_keys(t, config.compress_len, config.compress_stride) as f64).sum();
    let score_flops = 2.0 * (d * hq) as f64 * seen;
    let ms = median_ms(stream, opts, |s| {
        flash_forward_device(stream, &compressed, &q[s], &k_cmp, &v_cmp, &mut o_cmp, &mut lse).map_err(e)
    })?;
    emit(out, format!("{shape},{prefix}-cmp-fwd,hkv{hkv},1,{ms:.4},{:.1}\n", 2.0 * score_flops / ms / 1e9));
    let mut scores = stream
        .alloc_zeros::<f32>(nsa_select::scores_shape(layer, config).map_err(e)?.iter().product())
        .map_err(|e| e.to_string())?;
    let mut lists = stream
        .alloc_zeros::<i32>(nsa_select::lists_shape(layer, config).iter().product())
        .map_err(|e| e.to_string())?;
    let lists_host = time_list_kernels(
        stream,
        opts,
        std::iter::once(NSA_SELECT).chain(opts.nsa_select_sources.iter().copied()),
        &mut lists,
        &format!("T = {l}, Hq = {hq}, selection"),
        out,
        |kernel, s, lists| {
            nsa_select::select_device(stream, layer, config, kernel, &q[s], &k_cmp, &lse, &mut scores, lists).map_err(e)
        },
        |suffix, default, ms| {
            format!("{shape},{prefix}-select,hkv{hkv}{suffix},{default},{ms:.4},{:.1}\n", score_flops / ms / 1e9)
        },
    )?;
    // The selected attention over the embedded selection's lists, with the FLOPs of the keys the lists show each
    // row (the work fla-core's kernel does too); the output stays in its own buffers, so `LSE_cmp` stays intact.
    let lists = stream.clone_htod(&lists_host).map_err(|e| e.to_string())?;
    let selected_flops = 4.0 * (d * hq / hkv) as f64 * selected_keys(&lists_host, config, l, hkv) as f64;
    let (mut o_slc, mut lse_slc) = (
        alloc(stream, count(Operand::O))?,
        stream.alloc_zeros::<f32>(count(Operand::RowStat)).map_err(|e| e.to_string())?,
    );
    // The embedded text at every tiling that holds the group (the default one is the row the peers compare), then
    // each other text at the default tiling; every run's output must equal the first's bit for bit.
    let group = hq / hkv;
    let default_tiling = SelectedTiling::for_group(group);
    let runs = SelectedTiling::for_group_all(group)
        .into_iter()
        .map(|t| (NSA_SELECTED, t))
        .chain(opts.nsa_selected_sources.iter().map(|&kernel| (kernel, default_tiling)));
    let mut first_out = None;
    for (kernel, tiling) in runs {
        let ms = median_ms(stream, opts, |s| {
            nsa_selected::selected_device_with(
                stream,
                layer,
                config,
                (kernel, Some(tiling)),
                (&q[s], &k[s], &v[s]),
                &lists,
                &mut o_slc,
                &mut lse_slc,
            )
            .map_err(e)
        })?;
        // Every run used the same sets in the same order, so the last outputs are of the same inputs.
        let got = stream.clone_dtoh(&o_slc).map_err(|e| e.to_string())?;
        let suffix = format!("-r{}{}", tiling.rows_per_cta, source_suffix(kernel, kernel.name == NSA_SELECTED.name));
        match &first_out {
            None => first_out = Some(got),
            Some(want) => eprintln!(
                "T = {l}, Hq = {hq}, selected attention{suffix}: output equals the first run's bit for bit: {}",
                want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits())
            ),
        }
        let default = u8::from(kernel.name == NSA_SELECTED.name && tiling == default_tiling);
        emit(
            out,
            format!(
                "{shape},{prefix}-selected-fwd,hkv{hkv}{suffix},{default},{ms:.4},{:.1}\n",
                selected_flops / ms / 1e9
            ),
        );
    }
    // The selected attention's backward over the same lists (atomic dQ; FLOPs 2.5 times the forward's: five products
    // of the recomputed tile instead of two), from the last forward's O and LSE and a dO of another input set.
    let mut grads = BackwardGrads::new(stream, layer)?;
    let ms = median_ms(stream, opts, |s| {
        selected_backward_device(
            stream,
            layer,
            config,
            NSA_SELECTED_BWD,
            BackwardDeviceInputs { q: &q[s], k: &k[s], v: &v[s], o: &o_slc, lse: &lse_slc, d_out: &q[(s + 1) % SETS] },
            &lists,
            grads.outputs(),
            GpuBackwardStrategy::KvOwnerAtomic,
        )
        .map_err(e)
    })?;
    emit(out, format!("{shape},{prefix}-selected-bwd,hkv{hkv},1,{ms:.4},{:.1}\n", 2.5 * selected_flops / ms / 1e9));
    // The compressed attention's backward (the dense backward under the strided causal mask; the pooling's transpose
    // onto the tokens is not on the GPU yet).
    let mut cmp_grads = BackwardGrads::new(stream, &compressed)?;
    let ms = median_ms(stream, opts, |s| {
        let inputs =
            BackwardDeviceInputs { q: &q[s], k: &k_cmp, v: &v_cmp, o: &o_cmp, lse: &lse, d_out: &q[(s + 1) % SETS] };
        flash_backward_device(stream, &compressed, inputs, cmp_grads.outputs(), GpuBackwardStrategy::KvOwnerAtomic)
            .map_err(e)
    })?;
    emit(out, format!("{shape},{prefix}-cmp-bwd,hkv{hkv},1,{ms:.4},{:.1}\n", 2.5 * 2.0 * score_flops / ms / 1e9));
    Ok(())
}

/// Gradient buffers of one backward problem, reused by every timed call.
struct BackwardGrads {
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    delta: CudaSlice<f32>,
}

impl BackwardGrads {
    fn new(stream: &Arc<CudaStream>, spec: &AttentionSpec) -> Result<Self, String> {
        let count = |op: Operand| spec.expected_shape(op).iter().product::<usize>();
        Ok(Self {
            dq: alloc(stream, count(Operand::Q))?,
            dk: alloc(stream, count(Operand::K))?,
            dv: alloc(stream, count(Operand::V))?,
            delta: stream.alloc_zeros::<f32>(count(Operand::RowStat)).map_err(|e| e.to_string())?,
        })
    }

    fn outputs(&mut self) -> BackwardDeviceOutputs<'_, bf16> {
        BackwardDeviceOutputs { dq: &mut self.dq, dk: &mut self.dk, dv: &mut self.dv, delta: &mut self.delta }
    }
}

/// The (query token, key) pairs the lists `[T, Hkv, n]` show one query head of each KV head, summed over the KV
/// heads: per listed block, its keys up to the token's own (`−1` entries end a list).
fn selected_keys(lists: &[i32], config: &NsaConfig, len: usize, n_heads_kv: usize) -> usize {
    let (n, block) = (config.n_selected, config.select_block);
    let mut pairs = 0;
    for t in 0..len {
        for h in 0..n_heads_kv {
            let list = &lists[(t * n_heads_kv + h) * n..][..n];
            for &b in list.iter().take_while(|&&b| b >= 0) {
                let start = b as usize * block;
                pairs += (start + block).min(t + 1).saturating_sub(start);
            }
        }
    }
    pairs
}

/// DSA's discovery rows: the indexer with its exact top-k at H_I = 64, d_I = 128, k = 2048 (see the module docs).
fn run_dsa(opts: &Options, stream: &Arc<CudaStream>, out: &mut String) -> Result<(), String> {
    const HEADS: usize = 64;
    const DIM: usize = 128;
    const TOP_K: usize = 2048;
    let ctx = stream.context();
    let ctas = resident_ctas(ctx).map_err(|e| e.to_string())?;
    for seq_len in [16384usize, 65536, 131072].into_iter().filter(|&t| t <= opts.dsa_max_t) {
        let shape = IndexerShape { seq_len, n_index_heads: HEADS, index_dim: DIM, top_k: TOP_K };
        let mut q = vec![];
        let mut k = vec![];
        let mut w = vec![];
        for set in 0..SETS as u64 {
            q.push(upload(stream, shape.q_len(), 7 * set + 1)?);
            k.push(upload(stream, shape.k_len(), 7 * set + 2)?);
            // Weights of one sign and unit scale, as a trained projection gives (their signs do not change the work).
            let weights: Vec<f32> =
                random_bf16(shape.weights_len(), 7 * set + 3).iter().map(|x| x.to_f32().abs()).collect();
            w.push(stream.clone_htod(&weights).map_err(|e| e.to_string())?);
        }
        let mut lists = stream.alloc_zeros::<i32>(shape.lists_len()).map_err(|e| e.to_string())?;
        let flops = 2.0 * (HEADS * DIM) as f64 * seq_len as f64 * (seq_len as f64 + 1.0) / 2.0;
        let mut reference: Option<Vec<i32>> = None;
        // Each text on the default grid, then the embedded text on the grids of `--dsa-ctas-per-sm` (label suffix).
        let sms = attnproof_gpu::common::multiprocessors(ctx).map_err(|e| e.to_string())?;
        let runs = [DSA_INDEX, DSA_INDEX_MMA_SYNC]
            .into_iter()
            .chain(opts.dsa_sources.iter().copied())
            .map(|kernel| (kernel, ctas, String::new()))
            .chain(opts.dsa_ctas_per_sm.iter().map(|&n| (DSA_INDEX, n * sms, format!("/ctas{n}"))));
        for (kernel, grid, grid_label) in runs {
            let default = kernel.source == DSA_INDEX.source && grid_label.is_empty();
            let mut work =
                stream.alloc_zeros::<f32>(dsa_index::workspace_len(&shape, grid)).map_err(|e| e.to_string())?;
            let mut run = |set: usize, lists: &mut CudaSlice<i32>| {
                let scores = ScoreRows::Workspace(&mut work);
                indexer_top_k_device(stream, kernel, &shape, &q[set], &k[set], &w[set], lists, scores)
                    .map_err(|e| e.to_string())
            };
            let ms = median_ms(stream, opts, |set| run(set, &mut lists))?;
            // The lists of input set 0, compared across texts and grids (on a cleared buffer: a run that writes
            // nothing must not pass for equal).
            stream.memset_zeros(&mut lists).map_err(|e| e.to_string())?;
            run(0, &mut lists)?;
            let host = stream.clone_dtoh(&lists).map_err(|e| e.to_string())?;
            match &reference {
                None => reference = Some(host),
                Some(r) => {
                    eprintln!("T = {seq_len}, {}{grid_label}: lists equal the default's: {}", kernel.name, *r == host)
                }
            }
            let suffix = source_suffix(kernel, kernel.source == DSA_INDEX.source);
            let line = format!(
                "\"({seq_len},{HEADS},{DIM},{TOP_K})\",true,dsa-index,fused{grid_label}{suffix},{},{ms:.4},{:.1}\n",
                u8::from(default),
                flops / ms / 1e9
            );
            emit(out, line);
        }
    }
    Ok(())
}

/// DSA's token-sparse attention rows: H = 64 query heads over one KV head, d = dv = 128, k = 2048 (see the module
/// docs).
fn run_dsa_sparse(opts: &Options, stream: &Arc<CudaStream>, out: &mut String) -> Result<(), String> {
    const HEADS: usize = 64;
    const DIM: usize = 128;
    const TOP_K: usize = 2048;
    let selection = TokenSelection { top_k: TOP_K, heads: ListSharing::Shared };
    for seq_len in [16384usize, 65536, 131072].into_iter().filter(|&t| t <= opts.dsa_max_t) {
        let spec = AttentionSpec::dense(1, HEADS, 1, seq_len, seq_len, DIM, DIM).with_mask(Mask::Causal);
        let (n_q, n_kv) = (seq_len * HEADS * DIM, seq_len * DIM);
        let mut sets = vec![];
        for set in 0..SETS as u64 {
            sets.push((
                upload(stream, n_q, 5 * set + 1)?,
                upload(stream, n_kv, 5 * set + 2)?,
                upload(stream, n_kv, 5 * set + 3)?,
            ));
        }
        let lists: Vec<i32> = (0..seq_len)
            .flat_map(|t| {
                (0..TOP_K).map(move |i| {
                    if t < TOP_K { if i <= t { i as i32 } else { -1 } } else { (i * (t + 1) / TOP_K) as i32 }
                })
            })
            .collect();
        let lists = stream.clone_htod(&lists).map_err(|e| e.to_string())?;
        let mut o = alloc(stream, n_q)?;
        let mut lse = stream.alloc_zeros::<f32>(HEADS * seq_len).map_err(|e| e.to_string())?;
        let pairs: f64 = (0..seq_len).map(|t| (t + 1).min(TOP_K) as f64).sum();
        let flops = 2.0 * (HEADS * 2 * DIM) as f64 * pairs;
        let mut reference: Option<Vec<u16>> = None;
        // The default (wgmma on Hopper), the same text on mma.sync, then the given texts.
        for kernel in [DSA_SPARSE, DSA_SPARSE_MMA_SYNC].into_iter().chain(opts.dsa_sparse_sources.iter().copied()) {
            let embedded = kernel.name == DSA_SPARSE.name && kernel.source == DSA_SPARSE.source;
            let ms = median_ms(stream, opts, |set| {
                let (q, k, v) = &sets[set];
                token_sparse_device(stream, &spec, selection, kernel, (q, k, v), &lists, &mut o, &mut lse)
                    .map_err(|e| e.to_string())
            })?;
            // The output of input set 0, compared across kernel texts (on a cleared buffer: a text that writes
            // nothing must not pass for equal).
            stream.memset_zeros(&mut o).map_err(|e| e.to_string())?;
            let (q, k, v) = &sets[0];
            token_sparse_device(stream, &spec, selection, kernel, (q, k, v), &lists, &mut o, &mut lse)
                .map_err(|e| e.to_string())?;
            let host: Vec<u16> =
                stream.clone_dtoh(&o).map_err(|e| e.to_string())?.iter().map(|x| x.to_bits()).collect();
            match &reference {
                None => reference = Some(host),
                Some(r) => {
                    eprintln!("T = {seq_len}, {}: output equals the embedded kernel's: {}", kernel.name, *r == host)
                }
            }
            let line = format!(
                "\"({seq_len},{HEADS},{DIM},{TOP_K})\",true,dsa-sparse-fwd,gather{},{},{ms:.4},{:.1}\n",
                source_suffix(kernel, embedded),
                u8::from(embedded),
                flops / ms / 1e9
            );
            emit(out, line);
        }
        // The backward from the embedded forward's O and LSE of input set 0 (every set reads them: the timing does
        // not depend on their values) and a random dO; its products are S, dP, dV, dK and dQ over the visited pairs.
        let (q, k, v) = &sets[0];
        token_sparse_device(stream, &spec, selection, DSA_SPARSE, (q, k, v), &lists, &mut o, &mut lse)
            .map_err(|e| e.to_string())?;
        let d_out = upload(stream, n_q, 99)?;
        let (mut dq, mut dk, mut dv) = (alloc(stream, n_q)?, alloc(stream, n_kv)?, alloc(stream, n_kv)?);
        let mut delta = stream.alloc_zeros::<f32>(HEADS * seq_len).map_err(|e| e.to_string())?;
        let ms = median_ms(stream, opts, |set| {
            let (q, k, v) = &sets[set];
            let inputs = BackwardDeviceInputs { q, k, v, o: &o, lse: &lse, d_out: &d_out };
            let outputs = BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta };
            let strategy = GpuBackwardStrategy::KvOwnerAtomic;
            token_sparse_backward_device(stream, &spec, selection, DSA_SPARSE_BWD, inputs, &lists, outputs, strategy)
                .map_err(|e| e.to_string())
        })?;
        let bwd_flops = 2.0 * (HEADS * (3 * DIM + 2 * DIM)) as f64 * pairs;
        let line = format!(
            "\"({seq_len},{HEADS},{DIM},{TOP_K})\",true,dsa-sparse-bwd,gather-atomic,1,{ms:.4},{:.1}\n",
            bwd_flops / ms / 1e9
        );
        emit(out, line);
        // The indexer loss on the same lists: V3.2's indexer (64 heads of 128, f32 weights) against the forward's
        // queries, keys and LSE as the teacher (their layout is the dense spec's, which the timing does not see).
        let index_shape = IndexerShape { seq_len, n_index_heads: 64, index_dim: 128, top_k: TOP_K };
        let loss_shape = LossShape { indexer: index_shape, n_heads: HEADS, n_heads_kv: 1, head_dim: DIM, scale: 0.088 };
        let (q_index, k_index) = (upload(stream, index_shape.q_len(), 97)?, upload(stream, index_shape.k_len(), 98)?);
        let weights: Vec<f32> = (0..index_shape.weights_len()).map(|i| 0.5 + (i % 7) as f32 / 16.0).collect();
        let weights = stream.clone_htod(&weights).map_err(|e| e.to_string())?;
        let f32s = |n: usize| stream.alloc_zeros::<f32>(n).map_err(|e| e.to_string());
        let (mut student, mut teacher) = (f32s(loss_shape.rows_len())?, f32s(loss_shape.rows_len())?);
        let (mut kl, mut student_lse) = (f32s(seq_len)?, f32s(seq_len)?);
        let (mut d_qi, mut d_w, mut d_ki) =
            (f32s(index_shape.q_len())?, f32s(index_shape.weights_len())?, f32s(index_shape.k_len())?);
        let ms = median_ms(stream, opts, |set| {
            let (q, k, _) = &sets[set];
            let inputs = LossInputsDevice {
                q_index: &q_index,
                k_index: &k_index,
                weights: &weights,
                lists: &lists,
                query: q,
                key: k,
                lse: &lse,
            };
            let rows =
                LossRows { student: &mut student, teacher: &mut teacher, kl: &mut kl, student_lse: &mut student_lse };
            let gradients = LossGradients { d_q_index: &mut d_qi, d_weights: &mut d_w, d_k_index: &mut d_ki };
            indexer_loss_device(stream, DSA_LOSS, &loss_shape, inputs, rows, Some(gradients)).map_err(|e| e.to_string())
        })?;
        let loss_flops = 2.0 * (4 * 64 * 128 + HEADS * DIM) as f64 * pairs;
        let line = format!(
            "\"({seq_len},{HEADS},{DIM},{TOP_K})\",true,dsa-loss,indexer-64x128,1,{ms:.4},{:.1}\n",
            loss_flops / ms / 1e9
        );
        emit(out, line);
    }
    Ok(())
}

/// PISA's tail rows: B = 1, H = 24, T = 32K, D = 128, causal, blocks of 64 queries and 64 keys, lists per query head
/// of the diagonal block and each earlier block with probability 0.15.
const TAIL_SHAPE: (usize, usize, usize) = (24, 32768, 128);
const TAIL_BLOCK: usize = 64;

/// PISA's tail forward (`pisa-tail-fwd`: the block-sparse forward over the exact lists, the statistics and the merge)
/// beside the block-sparse forward alone on the same exact lists (`bsa-fwd`, the tail's overhead), the FLOPs column
/// counting the visited blocks' as the block-sparse rows do.
fn run_pisa_tail(opts: &Options, stream: &Arc<CudaStream>, out: &mut String) -> Result<(), String> {
    let (h, l, d) = TAIL_SHAPE;
    let n = h * l * d;
    let inputs = upload_sets(stream, n)?;
    let (mut o, mut lse) = (alloc(stream, n)?, stream.alloc_zeros::<f32>(h * l).map_err(|e| e.to_string())?);
    let spec = AttentionSpec::dense(1, h, h, l, l, d, d).with_mask(Mask::Causal);
    let blocks = l / TAIL_BLOCK;
    let mut next = xorshift(l as u64);
    let mut lists = ndarray::Array4::from_elem((1, h, blocks, blocks), -1i32);
    let mut visited = 0usize;
    for head in 0..h {
        for a in 0..blocks {
            let chosen: Vec<usize> = (0..a).filter(|_| next() % 100 < 15).chain(std::iter::once(a)).collect();
            visited += chosen.len();
            for (w, &b) in chosen.iter().enumerate() {
                lists[[0, head, a, w]] = b as i32;
            }
        }
    }
    let lists = BlockLists { q_block: TAIL_BLOCK, kv_block: TAIL_BLOCK, heads: ListHeads::PerQueryHead, lists };
    let plan = TailPlan::new(stream, &spec, &lists).map_err(|e| e.to_string())?;
    let exact = plan.exact_lists();
    let density = visited as f64 / (h * blocks * (blocks + 1) / 2) as f64;
    eprintln!("pisa tail: {visited} visited blocks, {:.2}% of the causal blocks", 100.0 * density);
    let flops = 4.0 * (d * TAIL_BLOCK * TAIL_BLOCK) as f64 * visited as f64;
    let mut work = TailWorkspace::alloc(stream, &spec, TAIL_BLOCK).map_err(|e| e.to_string())?;
    let shape = format!("\"(1,{h},{l},{d})\",true");
    let ms = median_ms(stream, opts, |s| {
        block_sparse_forward_device(stream, &spec, exact, &inputs.q[s], &inputs.k[s], &inputs.v[s], &mut o, &mut lse)
            .map_err(|e| e.to_string())
    })?;
    emit(out, format!("{shape},bsa-fwd,p0.15+diag/c64,1,{ms:.4},{:.1}\n", flops / ms / 1e9));
    for kernel in std::iter::once(PISA_TAIL).chain(opts.tail_sources.iter().copied()) {
        let ms = median_ms(stream, opts, |s| {
            let (q, k, v) = (&inputs.q[s], &inputs.k[s], &inputs.v[s]);
            pisa_tail_forward_planned(stream, &plan, kernel, q, k, v, &mut o, &mut lse, &mut work)
                .map_err(|e| e.to_string())
        })?;
        let (suffix, default) = if kernel == PISA_TAIL { (String::new(), 1) } else { (format!("@{}", kernel.name), 0) };
        emit(out, format!("{shape},pisa-tail-fwd,p0.15+diag/c64{suffix},{default},{ms:.4},{:.1}\n", flops / ms / 1e9));
    }
    // The backward over the tail forward's O and LSE (the production text's, last run above), the upstream gradient
    // the queries of the same input set: the block-sparse backward alone on the exact lists, then the tail's backward
    // (both with the atomic dQ), FLOPs 2.5 times the forward's.
    let (mut dq, mut dk, mut dv) = (alloc(stream, n)?, alloc(stream, n)?, alloc(stream, n)?);
    let mut delta = stream.alloc_zeros::<f32>(h * l).map_err(|e| e.to_string())?;
    let mut grad_work = TailBackwardWorkspace::alloc(stream, &spec, TAIL_BLOCK).map_err(|e| e.to_string())?;
    let strategy = GpuBackwardStrategy::KvOwnerAtomic;
    let (q, k, v) = (&inputs.q[0], &inputs.k[0], &inputs.v[0]);
    pisa_tail_forward_planned(stream, &plan, PISA_TAIL, q, k, v, &mut o, &mut lse, &mut work)
        .map_err(|e| e.to_string())?;
    let backward_inputs = BackwardDeviceInputs { q, k, v, o: &o, lse: &lse, d_out: q };
    let ms = median_ms(stream, opts, |_| {
        let outputs = BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta };
        block_sparse_backward_device(stream, &spec, exact, backward_inputs, outputs, strategy)
            .map_err(|e| e.to_string())
    })?;
    emit(out, format!("{shape},bsa-bwd,p0.15+diag/c64,1,{ms:.4},{:.1}\n", 2.5 * flops / ms / 1e9));
    let ms = median_ms(stream, opts, |_| {
        let outputs = BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta };
        pisa_tail_backward_device(stream, &plan, backward_inputs, outputs, strategy, &work, &mut grad_work)
            .map_err(|e| e.to_string())
    })?;
    emit(out, format!("{shape},pisa-tail-bwd,p0.15+diag/c64,1,{ms:.4},{:.1}\n", 2.5 * flops / ms / 1e9));
    Ok(())
}

/// A zeroed bf16 device buffer of `n` elements.
fn alloc(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<bf16>, String> {
    stream.alloc_zeros::<bf16>(n).map_err(|e| e.to_string())
}

fn run(opts: &Options) -> Result<(), String> {
    let ctx = cuda_device().map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let device = compute_capability(&ctx).map_err(|e| e.to_string())?;
    let mut out = String::from("shape,causal,direction,tiling,default,ms,tflops\n");
    print!("{out}");
    if opts.nsa {
        run_nsa(opts, &stream, &mut out)?;
    }
    if opts.dsa_sparse {
        run_dsa_sparse(opts, &stream, &mut out)?;
    }
    if opts.dsa {
        run_dsa(opts, &stream, &mut out)?;
    }
    if opts.pisa_tail {
        run_pisa_tail(opts, &stream, &mut out)?;
    }
    if opts.block_sparse {
        if !opts.selection_only {
            run_block_sparse(opts, &stream, &mut out)?;
        }
        run_selection(opts, &stream, &mut out)?;
    }
    let dense_shapes = if opts.block_sparse || opts.nsa || opts.dsa || opts.dsa_sparse || opts.pisa_tail {
        &[][..]
    } else {
        &SHAPES[..]
    };
    for &(b, h, l, d) in dense_shapes.iter().filter(|s| opts.shape.is_none_or(|only| only == **s)) {
        let n = b * h * l * d;
        let inputs = upload_sets(&stream, n)?;
        let mut o = stream.alloc_zeros::<bf16>(n).map_err(|e| e.to_string())?;
        let mut lse = stream.alloc_zeros::<f32>(b * h * l).map_err(|e| e.to_string())?;
        let default = ForwardTiling::for_head_dims(d, d);
        let tilings: Vec<ForwardTiling> = if opts.all_tilings {
            ForwardTiling::ALL.into_iter().filter(|t| t.supports(d, d)).collect()
        } else {
            vec![default]
        };
        for causal in [false, true] {
            let mask = if causal { Mask::Causal } else { Mask::None };
            let spec = AttentionSpec::dense(b, h, h, l, l, d, d).with_mask(mask);
            let flops = 4.0 * (b * h * d) as f64 * (l as f64).powi(2) * if causal { 0.5 } else { 1.0 };
            // `flash_fwd` in each tiling, then on 9.0 the sm_90a kernel (suffix `/sm90`), then other texts of
            // `flash_fwd`; the row of the dense wrapper's choice (`production_forward`) is the default.
            let production = production_forward(&spec, device);
            let sm90 = (device == (9, 0)
                && forward_variant::<bf16>(&spec, ForwardTiling::WGMMA, FLASH_FWD_SM90).is_ok())
            .then_some((FLASH_FWD_SM90, ForwardTiling::WGMMA));
            let fwd_runs = std::iter::once(FLASH_FWD)
                .chain(opts.fwd_sources.iter().copied())
                .flat_map(|k| tilings.iter().map(move |&t| (k, t)))
                .chain(sm90);
            for (kernel, t) in fwd_runs {
                let embedded = kernel.source == FLASH_FWD.source || kernel == FLASH_FWD_SM90;
                let fwd = PreparedForward::<bf16>::new(&stream, &spec, kernel, t).map_err(|e| e.to_string())?;
                let ms = median_ms(&stream, opts, |s| {
                    fwd.launch(&stream, &inputs.q[s], &inputs.k[s], &inputs.v[s], &mut o, &mut lse)
                        .map_err(|e| e.to_string())
                })?;
                let suffix =
                    if kernel == FLASH_FWD_SM90 { "/sm90".to_owned() } else { source_suffix(kernel, embedded) };
                let line = format!(
                    "\"({b},{h},{l},{d})\",{causal},fwd,{}x{}{suffix},{},{ms:.4},{:.1}\n",
                    t.warps,
                    t.slices,
                    u8::from(embedded && (kernel, t) == production),
                    flops / ms / 1e9
                );
                emit(&mut out, line);
            }
            if opts.backward {
                let fwd =
                    PreparedForward::<bf16>::new(&stream, &spec, FLASH_FWD, default).map_err(|e| e.to_string())?;
                let extra = backward_inputs(&stream, &fwd, &inputs, n, b * h * l)?;
                let mut dq = stream.alloc_zeros::<bf16>(n).map_err(|e| e.to_string())?;
                let mut dk = stream.alloc_zeros::<bf16>(n).map_err(|e| e.to_string())?;
                let mut dv = stream.alloc_zeros::<bf16>(n).map_err(|e| e.to_string())?;
                let mut delta = stream.alloc_zeros::<f32>(b * h * l).map_err(|e| e.to_string())?;
                // Every tiling with --all-tilings, the default one otherwise; each with both timed strategies.
                let bwd_tilings: Vec<BackwardTiling> =
                    if opts.all_tilings { BackwardTiling::ALL.to_vec() } else { vec![BackwardTiling::DEFAULT] };
                // On 9.0 the wgmma backward beside `flash_bwd` (default tiling only: its KV tile is 128 keys).
                let sm90 = (device == (9, 0) && wgmma_backward_supports(&spec, BackwardTiling::DEFAULT))
                    .then_some(FLASH_BWD_SM90);
                let kernels = std::iter::once(FLASH_BWD).chain(sm90).chain(opts.bwd_sources.iter().copied());
                let runs = kernels.flat_map(|kernel| {
                    let tilings = if is_wgmma_backward(kernel) { &bwd_tilings[..1] } else { &bwd_tilings[..] };
                    tilings.iter().flat_map(move |&t| TIMED_STRATEGIES.map(|(s, name)| (kernel, t, s, name)))
                });
                let production = production_backward_kernel(&spec, BackwardTiling::DEFAULT, device);
                for (kernel, tiling, strategy, name) in runs {
                    let embedded = kernel.source == FLASH_BWD.source;
                    let ms = median_ms(&stream, opts, |s| {
                        let inputs = extra.device_inputs(&inputs, s);
                        let outputs =
                            BackwardDeviceOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv, delta: &mut delta };
                        flash_backward_device_with(&stream, &spec, kernel, tiling, inputs, outputs, strategy)
                            .map_err(|e| e.to_string())
                    })?;
                    // Five matrix products to the forward's two: 2.5 times its FLOPs, as the peers count them.
                    let line = format!(
                        "\"({b},{h},{l},{d})\",{causal},bwd,{name}/{}w{}{},{},{ms:.4},{:.1}\n",
                        tiling.kv_warps,
                        if kernel == FLASH_BWD_SM90 { "/sm90" } else { "" },
                        source_suffix(kernel, embedded || kernel == FLASH_BWD_SM90),
                        u8::from(
                            kernel == production
                                && strategy == GpuBackwardStrategy::KvOwnerAtomic
                                && tiling == BackwardTiling::DEFAULT
                        ),
                        2.5 * flops / ms / 1e9
                    );
                    emit(&mut out, line);
                }
            }
        }
    }
    if let Some(path) = &opts.csv {
        std::fs::write(path, &out).map_err(|e| format!("write {path}: {e}"))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let opts = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::FAILURE
        }
    }
}
