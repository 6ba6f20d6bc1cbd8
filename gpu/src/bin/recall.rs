//! What the block selectors lose (E30) on the GPU: Recall@K and the attention-mass ratio of BSA's selector and of the
//! pyramid under each scoring, against the exact top-K by block mass, at several sequence lengths, as CSV on stdout
//! (and in `--csv PATH`) for the book's figure (`fixtures/measured/pyramid_recall.csv`).
//!
//! Usage: `recall [--lengths 4096,8192,...] [--csv PATH] [--seed N]`.
//!
//! The problem: B = 1, 16 query heads over 2 KV heads, D = 128, causal, bf16, query blocks and leaves of 64, K = 8
//! with the first, previous and current leaves forced (BSA: `force_first`, `force_local = 2`, top-8; the pyramid: β =
//! 4). Random Gaussian inputs give every leaf about the same mass, so no selector can be told from another; the inputs
//! here are structured, and synthetic (no model's activations travel to the GPU machine): each KV head has 8 topic
//! directions; every leaf belongs to one topic; a quarter of the leaves hold two *needle* keys (Gaussian noise plus
//! 0.5 √d times the topic's unit direction: a few large scores in an otherwise ordinary leaf), another quarter are
//! *shifted* (every key plus 0.15 √d times the direction: a leaf whose mean stands out), the rest plain noise; each
//! query block reads one topic (every row and head: noise plus the direction), so its mass sits in the needle and
//! shifted leaves of its topic. Means see shifted leaves and miss needles; the LSE over a leaf's keys sees both.
//!
//! The masses come from `attnproof_gpu::pisa::diagnostics` (`pisa_mass.cu`, f64), the lists from the production
//! selectors; columns: `length,selector,keep,blocks,recall,mass_ratio,worst_mass_ratio`, the means over every
//! (KV head, query block) that sees a key.

use std::io::Write;
use std::process::ExitCode;

use attnproof_gpu::block_sparse::select::select_blocks;
use attnproof_gpu::pisa::diagnostics::{MassConfig, block_masses, diagnose, summarize};
use attnproof_gpu::pisa::select::{PyramidSelectConfig, select_pyramid};
use attnproof_oracle::bsa::BsaConfig;
use attnproof_oracle::inputs::uniform;
use attnproof_oracle::pyramid::{PyramidConfig, Scoring};
use attnproof_oracle::{AttentionSpec, Mask};
use half::bf16;
use ndarray::{ArrayD, IxDyn};

const HEADS_Q: usize = 16;
const HEADS_KV: usize = 2;
const HEAD_DIM: usize = 128;
const BLOCK: usize = 64;
const KEEP: usize = 8;
const TOPICS: usize = 8;

struct Options {
    lengths: Vec<usize>,
    csv: Option<String>,
    seed: u64,
}

fn options() -> Result<Options, String> {
    let mut o = Options { lengths: vec![4096, 8192, 16384, 32768, 65536], csv: None, seed: 1 };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--lengths" => {
                o.lengths = value()?
                    .split(',')
                    .map(|s| s.parse::<usize>().map_err(|e| format!("--lengths {s}: {e}")))
                    .collect::<Result<_, _>>()?;
            }
            "--csv" => o.csv = Some(value()?),
            "--seed" => o.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            other => {
                return Err(format!(
                    "unknown argument {other}; usage: recall [--lengths L,...] [--csv PATH] [--seed N]"
                ));
            }
        }
    }
    if o.lengths.iter().any(|&l| l < 3 * BLOCK) {
        return Err(format!("every length must hold the three forced leaves: at least {} keys", 3 * BLOCK));
    }
    Ok(o)
}

/// Standard-normal values from [`uniform`] (Box–Muller over pairs).
fn gaussian(seed: u64, n: usize) -> Vec<f64> {
    let u = uniform(seed, 2 * n);
    (0..n)
        .map(|i| {
            let (a, b) = ((u[2 * i] + 1.0) / 2.0, (u[2 * i + 1] + 1.0) / 2.0);
            (-2.0 * (1.0 - a).ln()).sqrt() * (std::f64::consts::TAU * b).cos()
        })
        .collect()
}

/// The structured inputs of the module docs: Q `[1, Hq, L, D]` and K `[1, Hkv, L, D]`.
fn inputs(length: usize, seed: u64) -> (ArrayD<bf16>, ArrayD<bf16>) {
    let d = HEAD_DIM;
    let root_d = (d as f64).sqrt();
    let mut directions = vec![0.0; HEADS_KV * TOPICS * d];
    for (i, chunk) in gaussian(seed, HEADS_KV * TOPICS * d).chunks(d).enumerate() {
        let norm = chunk.iter().map(|x| x * x).sum::<f64>().sqrt();
        for c in 0..d {
            directions[i * d + c] = chunk[c] / norm;
        }
    }
    let direction = |kv: usize, topic: usize, c: usize| directions[(kv * TOPICS + topic) * d + c];
    let leaves = length.div_ceil(BLOCK);
    // Per leaf: its topic and kind (0 plain, 1 needles, 2 shifted); per query block: its topic.
    let leaf_draws = uniform(seed + 1, 2 * leaves);
    let leaf_topic = |b: usize| (((leaf_draws[2 * b] + 1.0) / 2.0 * TOPICS as f64) as usize).min(TOPICS - 1);
    let leaf_kind = |b: usize| (((leaf_draws[2 * b + 1] + 1.0) * 2.0) as usize).min(3);
    let block_draws = uniform(seed + 2, leaves);
    let block_topic = |a: usize| (((block_draws[a] + 1.0) / 2.0 * TOPICS as f64) as usize).min(TOPICS - 1);

    let noise_k = gaussian(seed + 3, HEADS_KV * length * d);
    let mut k = ArrayD::from_elem(IxDyn(&[1, HEADS_KV, length, d]), bf16::ZERO);
    for kv in 0..HEADS_KV {
        for j in 0..length {
            let b = j / BLOCK;
            let strength = match leaf_kind(b) {
                1 if j % BLOCK < 2 => 0.5 * root_d,
                2 => 0.15 * root_d,
                _ => 0.0,
            };
            for c in 0..d {
                let x = noise_k[(kv * length + j) * d + c] + strength * direction(kv, leaf_topic(b), c);
                k[[0, kv, j, c]] = bf16::from_f64(x);
            }
        }
    }
    let noise_q = gaussian(seed + 4, HEADS_Q * length * d);
    let group = HEADS_Q / HEADS_KV;
    let mut q = ArrayD::from_elem(IxDyn(&[1, HEADS_Q, length, d]), bf16::ZERO);
    for h in 0..HEADS_Q {
        for i in 0..length {
            let topic = block_topic(i / BLOCK);
            for c in 0..d {
                let x = 0.5 * noise_q[(h * length + i) * d + c] + root_d * direction(h / group, topic, c);
                q[[0, h, i, c]] = bf16::from_f64(x);
            }
        }
    }
    (q, k)
}

fn run(o: &Options) -> Result<Vec<String>, String> {
    let ctx = attnproof_gpu::cuda_device().map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let mut rows = vec!["length,selector,keep,blocks,recall,mass_ratio,worst_mass_ratio".to_owned()];
    for &length in &o.lengths {
        let spec =
            AttentionSpec::dense(1, HEADS_Q, HEADS_KV, length, length, HEAD_DIM, HEAD_DIM).with_mask(Mask::Causal);
        let (q, k) = inputs(length, o.seed);
        let started = std::time::Instant::now();
        let masses = block_masses(&stream, &spec, &MassConfig { q_block: BLOCK, leaf_size: BLOCK }, q.view(), k.view())
            .map_err(|e| format!("masses at {length}: {e}"))?;
        eprintln!("recall: masses at L = {length} in {:.2} s", started.elapsed().as_secs_f64());
        let bsa = BsaConfig { q_block: BLOCK, kv_block: BLOCK, top_k: KEEP, force_first: true, force_local: 2 };
        let mut selections = vec![(
            "bsa".to_owned(),
            select_blocks(&stream, &spec, &bsa, q.view(), k.view()).map_err(|e| format!("BSA at {length}: {e}"))?,
        )];
        for (name, scoring) in [("pisa-lse", Scoring::Lse), ("pisa1", Scoring::Pisa1), ("pisa2", Scoring::Pisa2)] {
            let config = PyramidSelectConfig {
                q_block: BLOCK,
                pyramid: PyramidConfig { leaf_size: BLOCK, branching: 4, keep: KEEP, scoring },
            };
            let selection = select_pyramid(&stream, &spec, &config, q.view(), k.view())
                .map_err(|e| format!("{name} at {length}: {e}"))?;
            selections.push((name.to_owned(), selection.lists));
        }
        for (name, lists) in &selections {
            let diagnosed = diagnose(&spec, &masses, lists, KEEP).map_err(|e| format!("{name} at {length}: {e}"))?;
            let s = summarize(&diagnosed).ok_or(format!("no query block at {length}"))?;
            rows.push(format!(
                "{length},{name},{KEEP},{},{:.6},{:.6},{:.6}",
                s.blocks, s.recall, s.mass_ratio, s.worst_mass_ratio
            ));
            eprintln!("{}", rows.last().expect("a row"));
        }
    }
    Ok(rows)
}

fn main() -> ExitCode {
    let result = options().and_then(|o| {
        let rows = run(&o)?;
        let text = rows.join("\n") + "\n";
        print!("{text}");
        if let Some(path) = &o.csv {
            std::fs::File::create(path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .map_err(|e| format!("{path}: {e}"))?;
        }
        Ok(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("recall: {e}");
            ExitCode::FAILURE
        }
    }
}
