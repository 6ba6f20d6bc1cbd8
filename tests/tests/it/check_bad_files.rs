//! Bad case files: each defect gives one error naming the tensor or key (exit 2 in the binary),
//! never a panic; and a proptest fuzzes the loader and checker with byte-level mutations of a
//! valid file (regressions in `proptest-regressions/check_bad_files.txt`).

use attnproof_harness::case::build::CaseBuilder;
use attnproof_harness::case::safetensors::{Dtype, RawTensor};
use attnproof_harness::case::{CaseError, OracleChoice, check, format};
use attnproof_harness::strategies::suite_config;
use ndarray::{ArrayD, Dimension};
use proptest::prelude::*;

fn tensor(shape: &[usize], seed: usize) -> ArrayD<f64> {
    ArrayD::from_shape_fn(shape.to_vec(), |i| {
        let k = i.slice().iter().fold(seed, |acc, &x| acc * 31 + x);
        ((k * 2_654_435_761) % 1000) as f64 / 500.0 - 1.0
    })
}

/// A small valid case: B = 1, H = 2, Lq = 5, Lk = 7, D = 4, with `o` and `lse` present.
fn valid() -> CaseBuilder {
    CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &tensor(&[1, 2, 5, 4], 1))
        .tensor("k", Dtype::Bf16, &tensor(&[1, 2, 7, 4], 2))
        .tensor("v", Dtype::Bf16, &tensor(&[1, 2, 7, 4], 3))
        .tensor("o", Dtype::Bf16, &tensor(&[1, 2, 5, 4], 4))
        .tensor("lse", Dtype::F32, &tensor(&[1, 2, 5], 5))
        .meta("format_version", "1")
        .meta("layout", "bhld")
        .meta("causal", "true")
        .meta("recipe", "bf16-in/f32-acc/p-bf16")
}

fn error_of(bytes: &[u8]) -> String {
    match format::from_bytes(bytes) {
        Ok(_) => panic!("a bad file loaded"),
        Err(e) => {
            let message = e.to_string();
            assert_reads_cleanly(&message);
            message
        }
    }
}

/// A message a person reads: no Rust `Option` printed as `Some(…)` or `None`, and every backquoted span a bare name
/// (no nested backquotes, no prose inside them).
fn assert_reads_cleanly(message: &str) {
    assert!(!message.contains("Some(") && !message.contains("None"), "debug formatting in {message:?}");
    let spans: Vec<&str> = message.split('`').collect();
    assert!(spans.len() % 2 == 1, "unbalanced backquotes in {message:?}");
    for name in spans.iter().skip(1).step_by(2) {
        let bare = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || "_.".contains(c));
        assert!(bare, "backquoted {name:?} is not a name in {message:?}");
    }
}

fn assert_names(bytes: &[u8], name: &str) {
    let e = error_of(bytes);
    assert!(e.contains(&format!("`{name}")), "error {e:?} should name `{name}`");
    assert!(!e.contains('\n'), "one line: {e:?}");
}

#[test]
fn the_valid_file_loads() {
    let case = format::from_bytes(&valid().bytes()).expect("valid");
    assert_eq!(case.outputs.len(), 2);
}

#[test]
fn truncated_files_name_the_header_or_the_tensor() {
    let bytes = valid().bytes();
    assert!(matches!(format::from_bytes(&bytes[..5]), Err(CaseError::Header { .. })));
    assert!(matches!(format::from_bytes(&bytes[..40]), Err(CaseError::Header { .. })));
    // Cut inside the data: the last tensor written (`lse`) runs past the end.
    assert_names(&bytes[..bytes.len() - 3], "lse");
}

#[test]
fn huge_header_length_is_refused_before_allocation() {
    let mut bytes = valid().bytes();
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = error_of(&bytes);
    assert!(e.contains("exceeds the limit"), "{e}");
}

#[test]
fn wrong_dtype_shape_and_missing_tensors_are_named() {
    let ints = RawTensor { dtype: Dtype::I32, shape: vec![1, 2, 5, 4], bytes: vec![0; 160] };
    assert_names(&valid().raw("q", ints).bytes(), "q");
    assert_names(&valid().tensor("k", Dtype::F16, &tensor(&[1, 2, 7, 4], 2)).bytes(), "k");
    assert_names(&valid().tensor("v", Dtype::Bf16, &tensor(&[1, 2, 6, 4], 3)).bytes(), "v");
    assert_names(&valid().tensor("o", Dtype::Bf16, &tensor(&[1, 2, 5, 3], 4)).bytes(), "o");
    assert_names(&valid().tensor("lse", Dtype::F32, &tensor(&[1, 2, 6], 4)).bytes(), "lse");
    assert_names(&valid().without("v").bytes(), "v");
    assert_names(&valid().tensor("dq", Dtype::Bf16, &tensor(&[1, 2, 5, 4], 6)).bytes(), "do");
    let lying = RawTensor { dtype: Dtype::Bf16, shape: vec![1, 2, 5, 4], bytes: vec![0; 10] };
    assert_names(&valid().raw("o", lying).bytes(), "o");
}

/// Head counts that do not divide, and zero head counts or head dims, are named before any arithmetic uses them.
#[test]
fn zero_and_indivisible_head_counts_are_named() {
    let kv = |heads: usize, d: usize| {
        valid().tensor("k", Dtype::Bf16, &tensor(&[1, heads, 7, d], 2)).tensor(
            "v",
            Dtype::Bf16,
            &tensor(&[1, heads, 7, d], 3),
        )
    };
    assert_names(&kv(3, 4).bytes(), "k");
    assert_names(&kv(0, 4).bytes(), "k");
    let zero_d = kv(2, 0).tensor("q", Dtype::Bf16, &tensor(&[1, 2, 5, 0], 1)).without("o");
    assert_names(&zero_d.bytes(), "q");
    let zero_dv = valid().tensor("v", Dtype::Bf16, &tensor(&[1, 2, 7, 0], 3)).without("o");
    assert_names(&zero_dv.bytes(), "q");
    // Each zero alone is refused by the zero check itself (a zero among nonzero sizes must not slip through to a
    // later, less precise error): d = 0 with dv = 4, dv = 0 with d = 4, and no query head over two KV heads.
    let zero_only_d = valid()
        .tensor("q", Dtype::Bf16, &tensor(&[1, 2, 5, 0], 1))
        .tensor("k", Dtype::Bf16, &tensor(&[1, 2, 7, 0], 2))
        .without("o");
    let no_query_head = valid()
        .tensor("q", Dtype::Bf16, &tensor(&[1, 0, 5, 4], 1))
        .tensor("o", Dtype::Bf16, &tensor(&[1, 0, 5, 4], 4))
        .tensor("lse", Dtype::F32, &tensor(&[1, 0, 5], 5));
    for (what, builder) in [("d = 0", zero_only_d), ("dv = 0", zero_dv), ("Hq = 0", no_query_head)] {
        let e = error_of(&builder.bytes());
        assert!(e.contains("tensor `q`: has a zero head count or head dimension"), "{what}: {e}");
    }
}

#[test]
fn non_finite_inputs_are_named() {
    let mut q = tensor(&[1, 2, 5, 4], 1);
    q[[0, 1, 2, 3]] = f64::NAN;
    let e = error_of(&valid().tensor("q", Dtype::Bf16, &q).bytes());
    assert!(e.contains("`q`") && e.contains("[0, 1, 2, 3]"), "{e}");
    let mut v = tensor(&[1, 2, 7, 4], 3);
    v[[0, 0, 0, 0]] = f64::INFINITY;
    assert_names(&valid().tensor("v", Dtype::Bf16, &v).bytes(), "v");
}

#[test]
fn inconsistent_metadata_is_named() {
    assert_names(&valid().meta("recipe", "f16-in/f32-acc/p-f16").bytes(), "recipe");
    assert_names(&valid().meta("recipe", "fp8-magic").bytes(), "recipe");
    assert_names(&valid().without_meta("recipe").bytes(), "recipe");
    assert_names(&valid().meta("causal_align", "diagonal").bytes(), "causal_align");
    assert_names(&valid().meta("causal", "maybe").bytes(), "causal");
    assert_names(&valid().meta("scale", "nan").bytes(), "scale");
    assert_names(&valid().meta("lse_base", "10").bytes(), "lse_base");
    assert_names(&valid().meta("layout", "thd").bytes(), "q");
    assert_names(&valid().meta("format_version", "7").bytes(), "format_version");
    assert_names(&valid().meta("window_left", "-3").bytes(), "window_left");
    let blocks = ArrayD::from_elem(vec![1, 2, 1, 1], 0.0);
    assert_names(&valid().tensor("block_indices", Dtype::I32, &blocks).bytes(), "block_q");
}

/// Every metadata value is honoured in both directions: each accepted spelling of each key loads as what it says,
/// and the opposite value as the opposite (a loader that ignored a key, or read it one way only, fails here).
#[test]
fn every_metadata_value_is_read_as_written() {
    use attnproof_harness::case::format::{CausalAlign, LseBase};
    use attnproof_oracle::Scale;
    let load = |b: CaseBuilder| format::from_bytes(&b.bytes()).expect("loads");
    for (value, causal) in [("true", true), ("1", true), ("YES", true), ("false", false), ("0", false), ("no", false)] {
        assert_eq!(load(valid().meta("causal", value)).mask.causal, causal, "causal = {value}");
    }
    assert!(!load(valid().without_meta("causal")).mask.causal, "no causal key: not causal");
    for (value, align) in [
        ("top_left", CausalAlign::TopLeft),
        ("Top-Left", CausalAlign::TopLeft),
        ("bottom_right", CausalAlign::BottomRight),
    ] {
        assert_eq!(load(valid().meta("causal_align", value)).mask.align, align, "causal_align = {value}");
    }
    assert_eq!(load(valid()).mask.align, CausalAlign::BottomRight, "the default alignment");
    for (value, base) in [
        ("e", LseBase::E),
        ("ln", LseBase::E),
        ("natural", LseBase::E),
        ("2", LseBase::Two),
        ("2.0", LseBase::Two),
        ("log2", LseBase::Two),
        ("base2", LseBase::Two),
    ] {
        assert_eq!(load(valid().meta("lse_base", value)).lse_base, base, "lse_base = {value}");
    }
    assert_eq!(load(valid()).lse_base, LseBase::E, "the default base");
    for (value, scale) in [
        ("0.5", Scale::Value(0.5)),
        ("-2", Scale::Value(-2.0)),
        ("default", Scale::InverseSqrtHeadDim),
        ("none", Scale::InverseSqrtHeadDim),
        ("", Scale::InverseSqrtHeadDim),
    ] {
        assert_eq!(load(valid().meta("scale", value)).spec.scale, scale, "scale = {value:?}");
    }
    assert_eq!(load(valid()).spec.scale, Scale::InverseSqrtHeadDim);
    for (value, window) in [("3", Some(3)), ("0", Some(0)), ("-1", None), ("none", None), ("", None)] {
        let case = load(valid().meta("window_left", value).meta("window_right", value));
        assert_eq!((case.mask.window_left, case.mask.window_right), (window, window), "window = {value:?}");
    }
}

/// A file above the size limit is refused by its size, before anything is read (the limit itself is a unit test of
/// the loader).
#[test]
fn files_above_the_size_limit_are_refused_by_their_size() {
    let dir = std::env::temp_dir().join(format!("attnproof-size-limit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("big.safetensors");
    let file = std::fs::File::create(&path).unwrap();
    // Sparse: no disk space is used for the zeros.
    file.set_len(format::MAX_FILE_BYTES + 1).unwrap();
    let above = format::load(&path).unwrap_err().to_string();
    assert!(above.contains("above the"), "{above}");
    drop(file);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Scales must be finite and non-zero; outputs take their own operand's shape (`dK` a key's, also when `d ≠ dv`);
/// only the LSE may carry cuDNN's trailing unit axis; block lists must be 4-D I32 tensors with positive tiles.
#[test]
fn scales_output_shapes_and_block_lists_are_checked() {
    for bad in ["0", "-0.0", "inf", "-inf"] {
        assert_names(&valid().meta("scale", bad).bytes(), "scale");
    }
    // d = 4, dv = 3: dK has K's shape, dV has V's.
    let dv3 = valid()
        .tensor("v", Dtype::Bf16, &tensor(&[1, 2, 7, 3], 3))
        .tensor("o", Dtype::Bf16, &tensor(&[1, 2, 5, 3], 4))
        .tensor("do", Dtype::Bf16, &tensor(&[1, 2, 5, 3], 6))
        .tensor("dq", Dtype::Bf16, &tensor(&[1, 2, 5, 4], 7))
        .tensor("dv", Dtype::Bf16, &tensor(&[1, 2, 7, 3], 8));
    let loaded = format::from_bytes(&dv3.clone().tensor("dk", Dtype::Bf16, &tensor(&[1, 2, 7, 4], 9)).bytes());
    assert!(loaded.is_ok_and(|c| c.outputs["dk"].shape() == [1, 2, 7, 4]));
    assert_names(&dv3.tensor("dk", Dtype::Bf16, &tensor(&[1, 2, 7, 3], 9)).bytes(), "dk");
    // A trailing unit axis: accepted on the LSE, refused anywhere else.
    let lse = format::from_bytes(&valid().tensor("lse", Dtype::F32, &tensor(&[1, 2, 5, 1], 5)).bytes());
    assert!(lse.is_ok_and(|c| c.outputs["lse"].shape() == [1, 2, 5]));
    assert_names(&valid().tensor("o", Dtype::Bf16, &tensor(&[1, 2, 5, 4, 1], 4)).bytes(), "o");
    // Block lists.
    let lists = |dtype, shape: &[usize]| {
        valid()
            .tensor("block_indices", dtype, &ArrayD::from_elem(shape.to_vec(), 0.0))
            .meta("block_q", "4")
            .meta("block_k", "4")
    };
    assert_names(&lists(Dtype::I32, &[1, 2, 2]).bytes(), "block_indices");
    assert_names(&lists(Dtype::F32, &[1, 2, 2, 1]).bytes(), "block_indices");
    assert_names(&lists(Dtype::I32, &[1, 2, 2, 1]).meta("block_q", "0").bytes(), "block_q");
    assert_names(&lists(Dtype::I32, &[1, 2, 2, 1]).meta("block_k", "-4").bytes(), "block_k");
}

/// Token lists: I32 `[B·Lq, list heads, κ]` (or `[B, Lq, list heads, κ]` in `bhld`) with 1, `Hkv` or `Hq` list heads,
/// each entry `−1` or a key of its sequence and none listed twice in a row; and never beside block lists. Each defect
/// is one error naming `token_indices` and saying what is wrong; a valid file with them loads.
#[test]
fn token_lists_are_checked() {
    let lists = |dtype, shape: &[usize], entries: &[(usize, i32)]| {
        let mut t = ArrayD::from_elem(shape.to_vec(), -1.0);
        for &(i, key) in entries {
            t.as_slice_mut().expect("standard layout")[i] = f64::from(key);
        }
        valid().tensor("token_indices", dtype, &t)
    };
    let message = |builder: CaseBuilder, words: &str| {
        let bytes = builder.bytes();
        assert_names(&bytes, "token_indices");
        let e = error_of(&bytes);
        assert!(e.contains(words), "error {e:?} should say {words:?}");
    };
    // B = 1, Lq = 5, Lk = 7, Hq = Hkv = 2: rows 5, list heads 1 or 2.
    assert!(format::from_bytes(&lists(Dtype::I32, &[5, 2, 3], &[(0, 6), (1, 0), (3, 2)]).bytes()).is_ok());
    assert!(format::from_bytes(&lists(Dtype::I32, &[1, 5, 1, 3], &[(2, 6)]).bytes()).is_ok());
    message(lists(Dtype::F32, &[5, 2, 3], &[]), "I32");
    message(lists(Dtype::I32, &[5, 6], &[]), "expected [5, list heads, κ]");
    message(lists(Dtype::I32, &[4, 2, 3], &[]), "expected [5, list heads, κ] or [1, 5, list heads, κ]");
    message(lists(Dtype::I32, &[5, 3, 3], &[]), "3 list heads");
    message(lists(Dtype::I32, &[5, 2, 3], &[(4, -2)]), "entry [0, 1, 1] = -2");
    message(
        lists(Dtype::I32, &[5, 2, 3], &[(29, 7)]),
        "entry [4, 1, 2] = 7 is neither -1 nor a key of its sequence (0..7)",
    );
    message(lists(Dtype::I32, &[5, 2, 3], &[(6, 3), (8, 3)]), "entry [1, 0, 2] lists key 3 again (first at slot 0)");
    message(lists(Dtype::I32, &[5, 2, 3], &[(0, 0), (2, 0)]), "entry [0, 0, 2] lists key 0 again (first at slot 0)");
    let both = lists(Dtype::I32, &[5, 2, 3], &[])
        .tensor("block_indices", Dtype::I32, &ArrayD::from_elem(vec![1, 2, 2, 1], 0.0))
        .meta("block_q", "4")
        .meta("block_k", "4");
    message(both, "not both");
}

/// Kernel parameters: positive integers (or for `kernel_exp` a known exponential form), each error naming its key; a
/// stated one-key tile needs its split count; unset, empty or `unknown` values state nothing.
#[test]
fn kernel_parameters_are_checked_and_named() {
    for key in ["kernel_kv_tile", "kernel_q_tile", "kernel_mma_k", "kernel_split_kv"] {
        for bad in ["0", "-3", "1.5", "many"] {
            assert_names(&valid().meta(key, bad).bytes(), key);
        }
    }
    assert_names(&valid().meta("kernel_exp", "exp10").bytes(), "kernel_exp");
    assert_names(&valid().meta("kernel_kv_tile", "1").bytes(), "kernel_split_kv");
    let load = |b: CaseBuilder| format::from_bytes(&b.bytes()).expect("valid").recipe.params;
    use attnproof_harness::case::recipe::{ExpForm, KernelParams};
    assert_eq!(load(valid().meta("kernel_kv_tile", "unknown").meta("kernel_exp", "")), KernelParams::default());
    let stated = load(
        valid()
            .meta("kernel_kv_tile", "128")
            .meta("kernel_q_tile", "64")
            .meta("kernel_mma_k", "16")
            .meta("kernel_exp", "EX2")
            .meta("kernel_split_kv", "3"),
    );
    let want = KernelParams {
        kv_tile: Some(128),
        q_tile: Some(64),
        mma_k: Some(16),
        exp: Some(ExpForm::Exp2Approx),
        split_kv: Some(3),
    };
    assert_eq!(stated, want);
    assert_eq!(load(valid().meta("kernel_kv_tile", "1").meta("kernel_split_kv", "2")).kv_tile, Some(1));
}

/// `masked_lse = +inf` reads a `+∞` LSE as the oracle's `−∞` (FlashAttention's value for a row that sees no key);
/// unstated, or `-inf`, a `+∞` stays as written; anything else is an error naming the key.
#[test]
fn the_masked_lse_convention_is_read_as_stated() {
    let mut lse = tensor(&[1, 2, 5], 5);
    lse[[0, 1, 3]] = f64::INFINITY;
    let with = |value: Option<&str>| {
        let b = valid().tensor("lse", Dtype::F32, &lse);
        let b = match value {
            Some(v) => b.meta("masked_lse", v),
            None => b,
        };
        format::from_bytes(&b.bytes()).expect("valid").outputs["lse"][[0, 1, 3]]
    };
    assert_eq!(with(Some("+inf")), f64::NEG_INFINITY);
    assert_eq!(with(Some("inf")), f64::NEG_INFINITY);
    assert_eq!(with(None), f64::INFINITY);
    assert_eq!(with(Some("-inf")), f64::INFINITY);
    assert_names(&valid().meta("masked_lse", "nan").bytes(), "masked_lse");
}

fn packed() -> CaseBuilder {
    let cu = |v: &[f64]| ArrayD::from_shape_vec(vec![v.len()], v.to_vec()).expect("1-D");
    CaseBuilder::new()
        .tensor("q", Dtype::Bf16, &tensor(&[6, 2, 4], 1))
        .tensor("k", Dtype::Bf16, &tensor(&[8, 2, 4], 2))
        .tensor("v", Dtype::Bf16, &tensor(&[8, 2, 4], 3))
        .tensor("cu_seqlens_q", Dtype::I32, &cu(&[0.0, 2.0, 6.0]))
        .tensor("cu_seqlens_k", Dtype::I32, &cu(&[0.0, 5.0, 8.0]))
        .meta("layout", "thd")
        .meta("recipe", "bf16-in/f32-acc/p-bf16")
}

#[test]
fn cu_seqlens_out_of_range_are_named() {
    format::from_bytes(&packed().bytes()).expect("the packed case is valid");
    let cu = |v: &[f64]| ArrayD::from_shape_vec(vec![v.len()], v.to_vec()).expect("1-D");
    assert_names(&packed().tensor("cu_seqlens_q", Dtype::I32, &cu(&[0.0, 2.0, 9.0])).bytes(), "cu_seqlens_q");
    assert_names(&packed().tensor("cu_seqlens_k", Dtype::I32, &cu(&[0.0, 9.0, 8.0])).bytes(), "cu_seqlens_k");
    assert_names(&packed().tensor("cu_seqlens_k", Dtype::I32, &cu(&[1.0, 5.0, 8.0])).bytes(), "cu_seqlens_k");
    assert_names(&packed().tensor("cu_seqlens_k", Dtype::I32, &cu(&[0.0, 8.0])).bytes(), "cu_seqlens_k");
    assert_names(&packed().tensor("cu_seqlens_q", Dtype::F32, &cu(&[0.0, 2.0, 6.0])).bytes(), "cu_seqlens_q");
    assert_names(&packed().without("cu_seqlens_k").bytes(), "cu_seqlens_k");
}

/// One byte-level mutation of a file.
#[derive(Clone, Debug)]
enum Mutation {
    /// Replace the byte at (index mod len).
    Set(usize, u8),
    /// Keep only the first (n mod len) bytes.
    Truncate(usize),
    /// Insert bytes at (index mod len).
    Insert(usize, Vec<u8>),
    /// Overwrite the header length.
    HeaderLength(u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..8)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => any::<u64>().prop_map(Mutation::HeaderLength),
    ]
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let len = bytes.len().max(1);
        match m {
            Mutation::Set(i, b) if !bytes.is_empty() => bytes[i % len] = *b,
            Mutation::Set(..) => {}
            Mutation::Truncate(n) => bytes.truncate(n % len),
            Mutation::Insert(i, b) => {
                let at = i % len;
                bytes.splice(at..at, b.iter().copied());
            }
            Mutation::HeaderLength(n) if bytes.len() >= 8 => bytes[..8].copy_from_slice(&n.to_le_bytes()),
            Mutation::HeaderLength(_) => {}
        }
    }
    bytes
}

proptest! {
    #![proptest_config(suite_config("check_bad_files", 96))]

    /// Whatever the bytes, loading gives a case or an error, and a loaded case checks to a
    /// report: no panic.
    #[test]
    fn mutated_files_never_panic(
        packed_layout in any::<bool>(),
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let base = if packed_layout { packed() } else { valid() };
        let bytes = mutate(base.bytes(), &mutations);
        if let Ok(case) = format::from_bytes(&bytes) {
            let report = check(&case, OracleChoice::F64);
            prop_assert!(!report.outputs.is_empty() || case.outputs.is_empty());
        }
    }
}
