//! DSA (DeepSeek Sparse Attention, E16) on the GPU: the lightning indexer fused with an exact causal top-k
//! ([`index`]) and the token-sparse attention over its selection ([`sparse`]).
//!
//! The indexer scores every earlier token of a sequence, `I_ts = Σ_a w_ta · ReLU(q^I_ta · k^I_s)` for `s ≤ t`, and
//! each token keeps the `k` best (ties to the lower index) as an ascending `i32` row, `−1`-padded where fewer than `k`
//! tokens are visible: the convention of `attnproof_oracle::dsa::causal_top_k`, whose lists the GPU's must equal when
//! both read the same f32 scores.
//!
//! The attention then runs over those lists: each token's query heads attend to the listed tokens only, with one
//! softmax over them; its K and V rows are gathered once for every head that shares the list. Its backward
//! ([`sparse_backward`]) walks the same lists again, owning each token's dQ and adding dK and dV to the gathered rows.
//! The indexer is trained toward the main attention on the same lists ([`loss`]: the KL between the head-summed
//! teacher and the indexer's softmax, and its gradients with respect to the indexer's inputs).

pub mod index;
pub mod loss;
pub mod sparse;
pub mod sparse_backward;
