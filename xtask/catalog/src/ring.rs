//! Mutants of the GPU ring attention's Rust code (`gpu/src/ring/`), run as scratch builds.
//!
//! Each entry patches GPU-side Rust source, so it uses [`Runner::ScratchGpu`](crate::Runner::ScratchGpu):
//! `cargo xtask gpu-bundle` builds the named test binary in release from a patched scratch copy of the tree into
//! `gpu-bundle/mutants/<name>/`, and the bundle's `run.sh` (modes `mutants` and `all`) runs it on a GPU host and
//! counts the mutant killed when that binary fails. Start from a base entry for the file mutated and override the
//! name, the description and the change.
//!
//! Every ring mutant is killed by the same test: the threaded GPU ring (one stream per simulated device, blocks
//! copied between them) must give the one-stream ring's bits, `O` and LSE, over contiguous and zigzag layouts of 2
//! and 4 devices on causal problems, and pass the verifier.

use crate::{Mutant, Runner};

/// The GPU test that kills every ring mutant: the threaded ring against the one-stream ring, bit for bit.
const THREADED_RING_TEST: Runner = Runner::ScratchGpu {
    package: "attnproof-gpu",
    target: "it",
    filter: Some("ring_state::threaded_ring_on_streams_matches_the_one_stream_ring_bitwise"),
};

/// Base entry for mutants of the travelling block and the chunk pairs a device attends.
const BLOCK: Mutant = Mutant {
    name: "",
    description: "",
    file: "gpu/src/ring/block.rs",
    find: "",
    replace: "",
    runner: THREADED_RING_TEST,
};

/// Base entry for mutants of the ring forward's worker and its set-up.
const FORWARD: Mutant = Mutant { file: "gpu/src/ring/forward.rs", ..BLOCK };

/// Base entry for mutants of the simulated devices' stream-ordered link.
const LINK: Mutant = Mutant { file: "gpu/src/ring/link.rs", ..BLOCK };

/// The ring mutants, in the order the bundle builds them.
pub const MUTANTS: &[Mutant] = &[
    Mutant {
        name: "gpu-ring-diagonal-unmasked",
        description: "a chunk pair on the diagonal (same first position) is attended without its mask's right reach: \
                      future keys leak into causal rows",
        find: "    ChunkWindow::for_pair(&spec.mask, lens, q, (c.start, c.len))\n",
        replace: "    ChunkWindow::for_pair(&spec.mask, lens, q, (c.start, c.len))\n        \
                  .map(|w| if q.0 == c.start { ChunkWindow { right: None, ..w } } else { w })\n",
        ..BLOCK
    },
    Mutant {
        name: "gpu-ring-merged-twice",
        description: "every visible chunk pair's partial state is merged into its query chunk's running state twice",
        find: "merge_states(&self.stream, &mut q.state, &part)?;",
        replace: "merge_states(&self.stream, &mut q.state, &part)?;\n                \
                  merge_states(&self.stream, &mut q.state, &part)?;",
        ..FORWARD
    },
    Mutant {
        name: "gpu-ring-zigzag-swapped",
        description: "under zigzag, each device's two key chunks carry each other's positions (chunks g and 2G - 1 - g \
                      swapped where their lengths agree)",
        find: "        setups.push((worker, GpuKvBlock::new(device, kv)));",
        replace: "        if kv.len() == 2 && kv[0].len == kv[1].len {\n            \
                  let (a, b) = (kv[0].start, kv[1].start);\n            \
                  (kv[0].start, kv[1].start) = (b, a);\n        \
                  }\n        \
                  setups.push((worker, GpuKvBlock::new(device, kv)));",
        ..FORWARD
    },
    Mutant {
        name: "gpu-ring-stale-receive-buffer",
        description: "the link keeps the K and V of the first block it sent and sends them again at every later hop, \
                      relabelled with the current owner: the routing check sees the right owner, the contents are stale",
        find: "        let mut chunks = Vec::with_capacity(outgoing.chunks.len());",
        replace: "        let first = kv;\n        \
                  let kv = first\n            \
                  .iter()\n            \
                  .map(|(k, v)| Ok((self.comm.clone_dtod(k)?, self.comm.clone_dtod(v)?)))\n            \
                  .collect::<Result<Vec<_>, GpuRingError>>()?;\n        \
                  self.prefetched = Some(first);\n        \
                  let mut chunks = Vec::with_capacity(outgoing.chunks.len());",
        ..LINK
    },
];
