//! A small, defensive reader and writer of the safetensors container: an 8-byte little-endian
//! header length, a JSON header (`{"__metadata__": {str: str}, name: {"dtype", "shape",
//! "data_offsets"}}`), then the tensor bytes. Every size is checked before it is used, so a
//! truncated or hostile file gives an error naming what is wrong, never a panic or a huge
//! allocation.

use std::collections::BTreeMap;

use super::error::CaseError;

/// Largest header accepted (the safetensors library's own limit is 100 MB; case headers are a
/// few kilobytes).
pub const MAX_HEADER_BYTES: u64 = 1 << 20;
/// Deepest JSON nesting accepted (a case header nests three levels).
const MAX_DEPTH: usize = 16;

/// Element types of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// IEEE double.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned (booleans are stored so).
    U8,
    /// Boolean (one byte).
    Bool,
}

impl Dtype {
    /// The safetensors name.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I32 => "I32",
            Dtype::I64 => "I64",
            Dtype::U8 => "U8",
            Dtype::Bool => "BOOL",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::U8 | Dtype::Bool => 1,
        }
    }

    fn parse(s: &str) -> Option<Dtype> {
        [Dtype::Bf16, Dtype::F16, Dtype::F32, Dtype::F64, Dtype::I32, Dtype::I64, Dtype::U8, Dtype::Bool]
            .into_iter()
            .find(|d| d.name() == s)
    }
}

/// One tensor of a file: its type, shape and little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct RawTensor {
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// The elements' bytes.
    pub bytes: Vec<u8>,
}

impl RawTensor {
    /// Elements, as a float each (integers exactly up to 2^53).
    pub fn to_f64(&self) -> Vec<f64> {
        let n = self.dtype.size();
        self.bytes
            .chunks_exact(n)
            .map(|c| match self.dtype {
                Dtype::Bf16 => f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64,
                Dtype::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
                Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                Dtype::F64 => f64::from_le_bytes(c.try_into().unwrap_or([0; 8])),
                Dtype::I32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                Dtype::I64 => i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64,
                Dtype::U8 | Dtype::Bool => c[0] as f64,
            })
            .collect()
    }
}

/// A parsed file: tensors by name and the string metadata.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SafeTensors {
    /// Tensors by name.
    pub tensors: BTreeMap<String, RawTensor>,
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
}

/// Parses a whole file.
pub fn parse(bytes: &[u8]) -> Result<SafeTensors, CaseError> {
    let header_error = |reason: String| CaseError::Header { reason };
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(header_error(format!("file is {} bytes, shorter than the 8-byte header length", bytes.len())));
    };
    let header_len = u64::from_le_bytes(len_bytes.try_into().unwrap_or([0; 8]));
    if header_len > MAX_HEADER_BYTES {
        return Err(header_error(format!("header length {header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes")));
    }
    let header_end = 8 + header_len as usize;
    let Some(header) = bytes.get(8..header_end) else {
        return Err(header_error(format!(
            "header length {header_len} runs past the end of the {}-byte file (truncated?)",
            bytes.len()
        )));
    };
    let header = std::str::from_utf8(header).map_err(|e| header_error(format!("header is not UTF-8: {e}")))?;
    let json = Parser { text: header.as_bytes(), at: 0 }.document()?;
    let data = &bytes[header_end..];
    let Json::Object(entries) = json else {
        return Err(header_error("header is not a JSON object".into()));
    };
    let mut out = SafeTensors::default();
    let mut covered: Vec<(usize, usize, String)> = Vec::new();
    for (name, value) in entries {
        if name == "__metadata__" {
            let Json::Object(fields) = value else {
                return Err(CaseError::Key { key: "__metadata__".into(), reason: "is not an object".into() });
            };
            for (key, v) in fields {
                let Json::String(s) = v else {
                    return Err(CaseError::Key { key, reason: "metadata values must be strings".into() });
                };
                out.metadata.insert(key, s);
            }
            continue;
        }
        let tensor = tensor_entry(&name, value, data)?;
        covered.push((tensor.1, tensor.2, name.clone()));
        out.tensors.insert(name, tensor.0);
    }
    covered.sort();
    for pair in covered.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(CaseError::Tensor {
                name: pair[1].2.clone(),
                reason: format!("its data overlaps tensor `{}`", pair[0].2),
            });
        }
    }
    Ok(out)
}

fn tensor_entry(name: &str, value: Json, data: &[u8]) -> Result<(RawTensor, usize, usize), CaseError> {
    let bad = |reason: String| CaseError::Tensor { name: name.to_string(), reason };
    let Json::Object(fields) = value else {
        return Err(bad("header entry is not an object".into()));
    };
    let field = |key: &str| fields.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    let dtype = match field("dtype") {
        Some(Json::String(s)) => Dtype::parse(s).ok_or_else(|| bad(format!("unsupported dtype {s:?}")))?,
        _ => return Err(bad("missing or non-string `dtype`".into())),
    };
    let shape = match field("shape") {
        Some(Json::Array(dims)) => dims
            .iter()
            .map(|d| d.as_index().ok_or_else(|| bad("`shape` holds a non-integer or negative entry".into())))
            .collect::<Result<Vec<usize>, _>>()?,
        _ => return Err(bad("missing or non-array `shape`".into())),
    };
    let (begin, end) = match field("data_offsets") {
        Some(Json::Array(o)) if o.len() == 2 => match (o[0].as_index(), o[1].as_index()) {
            (Some(b), Some(e)) if b <= e => (b, e),
            _ => return Err(bad("`data_offsets` must be two non-decreasing integers".into())),
        },
        _ => return Err(bad("missing or malformed `data_offsets`".into())),
    };
    let elements = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    let expected = elements.and_then(|n| n.checked_mul(dtype.size()));
    if expected != Some(end - begin) {
        return Err(bad(format!(
            "shape {shape:?} of {} needs {} bytes but `data_offsets` span {}",
            dtype.name(),
            expected.map_or("too many".to_string(), |n| n.to_string()),
            end - begin
        )));
    }
    let Some(bytes) = data.get(begin..end) else {
        return Err(bad(format!(
            "data {begin}..{end} runs past the end of the {}-byte data section (truncated?)",
            data.len()
        )));
    };
    Ok((RawTensor { dtype, shape, bytes: bytes.to_vec() }, begin, end))
}

/// Serializes tensors (in the order given) and metadata into a file.
pub fn write(tensors: &[(&str, &RawTensor)], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut header = String::from("{");
    let mut fields = Vec::new();
    if !metadata.is_empty() {
        let m: Vec<String> = metadata.iter().map(|(k, v)| format!("{}:{}", json_string(k), json_string(v))).collect();
        fields.push(format!("\"__metadata__\":{{{}}}", m.join(",")));
    }
    let mut offset = 0;
    for (name, t) in tensors {
        let shape: Vec<String> = t.shape.iter().map(usize::to_string).collect();
        fields.push(format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            json_string(name),
            t.dtype.name(),
            shape.join(","),
            offset,
            offset + t.bytes.len()
        ));
        offset += t.bytes.len();
    }
    header.push_str(&fields.join(","));
    header.push('}');
    // The data section starts 8-byte aligned, as the reference implementation pads it.
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    for (_, t) in tensors {
        out.extend_from_slice(&t.bytes);
    }
    out
}

/// A JSON string literal.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The JSON values a header can hold (numbers kept as text until used).
#[derive(Clone, Debug, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Number(String),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    fn as_index(&self) -> Option<usize> {
        match self {
            Json::Number(s) => s.parse::<usize>().ok(),
            _ => None,
        }
    }
}

struct Parser<'a> {
    text: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn error(&self, what: &str) -> CaseError {
        CaseError::Header { reason: format!("invalid JSON at byte {}: {what}", self.at) }
    }

    fn document(mut self) -> Result<Json, CaseError> {
        let v = self.value(0)?;
        self.skip_space();
        if self.at != self.text.len() {
            return Err(self.error("trailing characters after the header object"));
        }
        Ok(v)
    }

    fn skip_space(&mut self) {
        while matches!(self.text.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.skip_space();
        if self.text.get(self.at) == Some(&c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json, CaseError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting too deep"));
        }
        self.skip_space();
        match self.text.get(self.at) {
            Some(b'{') => {
                self.at += 1;
                let mut fields: Vec<(String, Json)> = Vec::new();
                if self.eat(b'}') {
                    return Ok(Json::Object(fields));
                }
                loop {
                    self.skip_space();
                    let key = self.string()?;
                    if fields.iter().any(|(k, _)| *k == key) {
                        return Err(self.error(&format!("duplicate key {key:?}")));
                    }
                    if !self.eat(b':') {
                        return Err(self.error("expected ':'"));
                    }
                    let v = self.value(depth + 1)?;
                    fields.push((key, v));
                    if self.eat(b'}') {
                        return Ok(Json::Object(fields));
                    }
                    if !self.eat(b',') {
                        return Err(self.error("expected ',' or '}'"));
                    }
                }
            }
            Some(b'[') => {
                self.at += 1;
                let mut items = Vec::new();
                if self.eat(b']') {
                    return Ok(Json::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    if self.eat(b']') {
                        return Ok(Json::Array(items));
                    }
                    if !self.eat(b',') {
                        return Err(self.error("expected ',' or ']'"));
                    }
                }
            }
            Some(b'"') => Ok(Json::String(self.string()?)),
            Some(b't') => self.literal("true", Json::Bool(true)),
            Some(b'f') => self.literal("false", Json::Bool(false)),
            Some(b'n') => self.literal("null", Json::Null),
            Some(b'-' | b'0'..=b'9') => {
                let start = self.at;
                while matches!(self.text.get(self.at), Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')) {
                    self.at += 1;
                }
                Ok(Json::Number(String::from_utf8_lossy(&self.text[start..self.at]).into_owned()))
            }
            _ => Err(self.error("expected a value")),
        }
    }

    fn literal(&mut self, word: &str, v: Json) -> Result<Json, CaseError> {
        if self.text[self.at..].starts_with(word.as_bytes()) {
            self.at += word.len();
            Ok(v)
        } else {
            Err(self.error("expected a value"))
        }
    }

    fn string(&mut self) -> Result<String, CaseError> {
        if self.text.get(self.at) != Some(&b'"') {
            return Err(self.error("expected a string"));
        }
        self.at += 1;
        let mut out: Vec<u8> = Vec::new();
        loop {
            match self.text.get(self.at) {
                None => return Err(self.error("unterminated string")),
                Some(b'"') => {
                    self.at += 1;
                    return String::from_utf8(out).map_err(|_| self.error("string is not UTF-8"));
                }
                Some(b'\\') => {
                    let esc = self.text.get(self.at + 1).copied();
                    self.at += 2;
                    match esc {
                        Some(b'"') => out.push(b'"'),
                        Some(b'\\') => out.push(b'\\'),
                        Some(b'/') => out.push(b'/'),
                        Some(b'n') => out.push(b'\n'),
                        Some(b't') => out.push(b'\t'),
                        Some(b'r') => out.push(b'\r'),
                        Some(b'b') => out.push(8),
                        Some(b'f') => out.push(12),
                        Some(b'u') => {
                            let hex =
                                self.text.get(self.at..self.at + 4).ok_or_else(|| self.error("short \\u escape"))?;
                            let code = std::str::from_utf8(hex)
                                .ok()
                                .and_then(|h| u32::from_str_radix(h, 16).ok())
                                .ok_or_else(|| self.error("bad \\u escape"))?;
                            self.at += 4;
                            // Surrogate halves are replaced: case keys and values are ASCII.
                            let c = char::from_u32(code).unwrap_or('\u{fffd}');
                            out.extend_from_slice(c.to_string().as_bytes());
                        }
                        _ => return Err(self.error("bad escape")),
                    }
                }
                Some(&c) => {
                    out.push(c);
                    self.at += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `header` (the JSON text as given) followed by `data`.
    fn file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    /// Two F32 tensors of two elements at the given byte ranges, over 16 bytes of data.
    fn two_tensors(a: [usize; 2], b: [usize; 2]) -> Vec<u8> {
        let entry = |name: &str, [begin, end]: [usize; 2]| {
            format!("\"{name}\":{{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[{begin},{end}]}}")
        };
        file(&format!("{{{},{}}}", entry("a", a), entry("b", b)), &[0u8; 16])
    }

    fn error_of(bytes: &[u8]) -> String {
        match parse(bytes) {
            Ok(_) => panic!("a bad file parsed"),
            Err(e) => e.to_string(),
        }
    }

    fn json(text: &str) -> Result<Json, CaseError> {
        Parser { text: text.as_bytes(), at: 0 }.document()
    }

    /// Literals, numbers, nested arrays and every escape of a string parse to what they say, and the parser resumes
    /// after each at the right byte (a following field still parses).
    #[test]
    fn the_parser_reads_every_value_kind_and_escape() {
        let text =
            r#"{"t":true,"f":false,"n":null,"x":[1,-2.5e3,[]],"s":"a\"b\\c\/d\ne\tf\rg\bh\fi\u0041\u00e9j","z":0}"#;
        let Json::Object(fields) = json(text).unwrap() else { panic!("an object") };
        let get = |k: &str| fields.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()).unwrap();
        assert_eq!(get("t"), Json::Bool(true));
        assert_eq!(get("f"), Json::Bool(false));
        assert_eq!(get("n"), Json::Null);
        assert_eq!(
            get("x"),
            Json::Array(vec![Json::Number("1".into()), Json::Number("-2.5e3".into()), Json::Array(vec![])])
        );
        assert_eq!(get("s"), Json::String("a\"b\\c/d\ne\tf\rg\u{8}h\u{c}iA\u{e9}j".into()));
        assert_eq!(get("z"), Json::Number("0".into()));
        for bad in
            [r#"{"a":tru}"#, r#"{"a":"\q"}"#, r#"{"a":"\u00"}"#, r#"{"a":"\u00zz"}"#, r#"{"a":"x"#, r#"{"a":1} x"#]
        {
            assert!(json(bad).is_err(), "{bad}");
        }
    }

    /// Nesting is refused one level past the limit, objects and arrays alike, and accepted at it.
    #[test]
    fn nesting_is_limited_at_exactly_max_depth() {
        let nested =
            |open: &str, close: &str, levels: usize| format!("{}1{}", open.repeat(levels), close.repeat(levels));
        // The document's outer object is depth 0, its field's value depth 1: inside `levels` arrays (or objects) the
        // innermost value `1` is at depth `levels + 1`, refused above `MAX_DEPTH`.
        let arrays = |levels| format!("{{\"a\":{}}}", nested("[", "]", levels));
        let objects = |levels| format!("{{\"a\":{}}}", nested("{\"b\":", "}", levels));
        assert!(json(&arrays(MAX_DEPTH - 1)).is_ok());
        assert!(json(&arrays(MAX_DEPTH)).unwrap_err().to_string().contains("nesting too deep"));
        assert!(json(&objects(MAX_DEPTH - 1)).is_ok());
        assert!(json(&objects(MAX_DEPTH)).unwrap_err().to_string().contains("nesting too deep"));
    }

    /// The writer escapes every control character, not only the three with short escapes.
    #[test]
    fn json_strings_escape_every_control_character() {
        assert_eq!(json_string("a\u{1}b\u{1f}\n\"\\"), r#""a\u0001b\u001f\n\"\\""#);
        assert_eq!(json_string(" ~"), r#"" ~""#);
    }

    #[test]
    fn a_header_at_the_size_limit_is_read_and_one_byte_more_is_refused() {
        let limit = MAX_HEADER_BYTES as usize;
        // JSON allows the padding spaces, as the writer's own alignment relies on.
        let at_limit = format!("{{}}{}", " ".repeat(limit - 2));
        assert!(parse(&file(&at_limit, &[])).is_ok());
        let above = format!("{at_limit} ");
        assert!(error_of(&file(&above, &[])).contains("exceeds the limit"));
    }

    #[test]
    fn tensors_may_touch_but_not_overlap() {
        assert!(parse(&two_tensors([0, 8], [8, 16])).is_ok());
        assert!(parse(&two_tensors([8, 16], [0, 8])).is_ok(), "order in the header does not matter");
        assert!(error_of(&two_tensors([0, 8], [4, 12])).contains("overlaps tensor `a`"));
        assert!(error_of(&two_tensors([4, 12], [0, 8])).contains("overlaps tensor `b`"));
    }

    #[test]
    fn data_offsets_are_exactly_two_non_decreasing_integers() {
        let one = |offsets: &str| {
            file(&format!("{{\"a\":{{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":{offsets}}}}}"), &[0u8; 16])
        };
        assert!(parse(&one("[0,8]")).is_ok());
        assert!(error_of(&one("[0,8,16]")).contains("malformed `data_offsets`"));
        assert!(error_of(&one("[8]")).contains("malformed `data_offsets`"));
        assert!(error_of(&one("[8,0]")).contains("two non-decreasing integers"));
    }

    /// The writer pads the header with spaces to a multiple of 8 bytes, whatever the names' lengths, and what it writes
    /// parses back to the same tensors and metadata.
    #[test]
    fn written_headers_are_8_byte_aligned_and_read_back() {
        let tensor = RawTensor { dtype: Dtype::F32, shape: vec![1], bytes: 1.5f32.to_le_bytes().to_vec() };
        for name_len in 1..=9 {
            let name = "x".repeat(name_len);
            let metadata = BTreeMap::from([("k".to_owned(), "v".to_owned())]);
            let bytes = write(&[(name.as_str(), &tensor)], &metadata);
            let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
            assert_eq!(header_len % 8, 0, "name of {name_len} bytes");
            let back = parse(&bytes).expect("the writer's output parses");
            assert_eq!(back.tensors.get(&name), Some(&tensor));
            assert_eq!(back.metadata, metadata);
        }
    }
}
