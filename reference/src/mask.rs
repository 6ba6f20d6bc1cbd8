//! The visibility rule (E1a) and the GQA head map (E1b) as a kernel evaluates them, from index
//! arithmetic. Deliberately not the oracle's code: if the schedules called the oracle's mask, a
//! mistake in it would appear on both sides of every comparison and no test could see it.

use attnproof_oracle::spec::{Mask, Pair};

/// Whether key `key` is visible to query `query` in a sequence of `len_q` queries and `len_k`
/// keys: causal and windows are aligned bottom-right (`i + Lk − Lq`); NSA's strided causal mask compares window
/// ends with the query's own position.
pub fn visible(mask: &Mask, query: usize, key: usize, len_q: usize, len_k: usize) -> bool {
    let diagonal = query as i64 + len_k as i64 - len_q as i64;
    let key = key as i64;
    match mask {
        Mask::None => true,
        Mask::Causal => key <= diagonal,
        Mask::Window { left, right } => key >= diagonal - *left as i64 && key <= diagonal + *right as i64,
        // Window `key` covers tokens key·stride ..= key·stride + len − 1 and is visible once the query has passed its
        // last token; the query's own position, not the aligned diagonal, since the keys are windows.
        Mask::StridedCausal { len, stride } => key * (*stride as i64) + *len as i64 - 1 <= query as i64,
        Mask::Predicate(p) => (p.visible)(Pair { query, key: key as usize, len_q, len_k }),
        Mask::And(parts) => parts.iter().all(|m| visible(m, query, key as usize, len_q, len_k)),
    }
}

/// The KV head that query head `head` reads: consecutive query heads share a KV head.
pub fn kv_head(head: usize, n_heads_q: usize, n_heads_kv: usize) -> usize {
    head / (n_heads_q / n_heads_kv)
}
