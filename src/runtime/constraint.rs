//! Constrained decoding: a grammar per slot (llguidance, the library llama.cpp links for this)
//! whose token mask the engine computes on a worker thread while the forward runs.
//!
//! [`Grammars`] is built once per vocabulary: a token trie over tern's own tokenizer, built as
//! llama.cpp's `common/llguidance.cpp` builds it from its vocab (each token's bytes as
//! detokenized without specials; a token that renders empty is a special token, marked 0xFF and
//! named by its text; tokenizing parses specials). It compiles a [`GrammarSpec`] into a
//! [`Constraint`], or a [`ConstraintError`] naming what llguidance rejected.
//!
//! A [`Constraint`] may start dormant: with a prompt that leaves `<think>` open, the thinking
//! block stays free and the grammar applies from the token after `</think>`.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::tokenizer::Tokenizer;

#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum ConstraintError {
    #[error("{what}: {why}")]
    Grammar { what: String, why: String },
    #[error("the vocabulary cannot drive a grammar: {0}")]
    Vocabulary(String),
}

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format.json_schema.schema`, llama-server's `json_schema`).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark syntax (llama-server's `grammar` with `%llguidance`).
    Lark(String),
    /// A GBNF grammar (llama-server's `grammar`), converted to Lark ([`gbnf_to_lark`]).
    Gbnf(String),
}

impl GrammarSpec {
    /// The Lark text llguidance compiles; `leading_ws` lets whitespace precede the grammar's
    /// own start (after `</think>` the model writes a newline or two first).
    pub fn to_lark(&self, leading_ws: bool) -> Result<String, ConstraintError> {
        let body = match self {
            GrammarSpec::JsonObject => format!(
                "start: %json {}\n",
                llama_spacing(&serde_json::json!({"type": "object"}))
            ),
            GrammarSpec::JsonSchema(s) => format!("start: %json {}\n", llama_spacing(s)),
            GrammarSpec::Lark(g) => g.clone(),
            GrammarSpec::Gbnf(g) => gbnf_to_lark(g)?,
        };
        if !leading_ws {
            return Ok(body);
        }
        // Rename the user's start and put optional whitespace in front of it.
        Ok(format!(
            "start: LEADING_WS? tern_start\nLEADING_WS: /[ \\t\\r\\n]+/\n{}",
            rename_start(&body)
        ))
    }

    fn what(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject => "response_format json_object",
            GrammarSpec::JsonSchema(_) => "json_schema",
            GrammarSpec::Lark(_) => "grammar (lark)",
            GrammarSpec::Gbnf(_) => "grammar (gbnf)",
        }
    }
}

/// The whitespace llama.cpp's JSON-schema grammars allow between JSON tokens (its
/// `SPACE_RULE`: nothing, a space, or one or two newlines and up to 20 spaces or tabs), unless
/// the schema sets llguidance's own `x-guidance` options. llguidance's default (any run of
/// whitespace) lets a weak model pad the output until it runs out of tokens.
fn llama_spacing(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(o) = &mut s {
        o.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_pattern": "[ ]|\\n{1,2}[ \\t]{0,20}"}),
        );
    }
    s
}

/// `start:` at the beginning of a line becomes `tern_start:` (a `start` used as a reference
/// elsewhere is renamed too).
fn rename_start(lark: &str) -> String {
    let mut out = String::with_capacity(lark.len() + 16);
    let b = lark.as_bytes();
    let mut i = 0;
    let mut in_str: Option<u8> = None;
    while i < b.len() {
        let c = b[i];
        if let Some(q) = in_str {
            out.push(c as char);
            if c == b'\\' && i + 1 < b.len() {
                out.push(b[i + 1] as char);
                i += 2;
                continue;
            }
            if c == q {
                in_str = None;
            }
            i += 1;
            continue;
        }
        if c == b'"' || c == b'/' {
            in_str = Some(c);
            out.push(c as char);
            i += 1;
            continue;
        }
        let word_start = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if word_start && lark[i..].starts_with("start") {
            let end = i + 5;
            if end >= b.len() || !(b[end].is_ascii_alphanumeric() || b[end] == b'_') {
                out.push_str("tern_start");
                i = end;
                continue;
            }
        }
        // Multi-byte UTF-8: copy the whole char.
        let ch = lark[i..].chars().next().expect("in bounds");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// tern's tokenizer as llguidance sees it.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // llama.cpp's callback tokenizes with parse_special on; the trie's greedy fallback
        // covers bytes that are not UTF-8.
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tok.encode(s, false, true).unwrap_or_default()
        })
    }
}

/// The grammar compiler for one vocabulary (built at the first constrained request).
pub struct Grammars {
    factory: ParserFactory,
    /// `</think>` when the vocabulary has it as one token.
    think_end: Option<u32>,
    n_vocab: usize,
}

impl Grammars {
    pub fn new(tok: Arc<Tokenizer>) -> Result<Grammars, ConstraintError> {
        let n = tok.n_vocab();
        let mut bytes = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let plain = tok.decode_bytes(&[id], true).unwrap_or_default();
            if !plain.is_empty() {
                bytes.push(plain);
                continue;
            }
            let shown = tok.decode_bytes(&[id], false).unwrap_or_default();
            if shown.is_empty() {
                bytes.push(Vec::new());
            } else {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(&shown);
                bytes.push(b);
            }
        }
        let mut eog: Vec<u32> = (0..n as u32).filter(|&i| tok.is_eog(i)).collect();
        // llama.cpp gives llguidance the end-of-turn token, else eos; every EOG token ends.
        let primary = tok
            .token_id("<|im_end|>")
            .filter(|&t| tok.is_eog(t))
            .or(tok.eos())
            .or(eog.first().copied())
            .ok_or_else(|| ConstraintError::Vocabulary("no end-of-generation token".into()))?;
        eog.retain(|&t| t != primary);
        eog.insert(0, primary);
        let info = TokRxInfo::new(n as u32, primary);
        let mut trie = TokTrie::from(&info, &bytes);
        if eog.len() > 1 {
            trie = trie.with_eos_tokens(&eog);
        }
        let think_end = tok.token_id(crate::chat::parse::THINK_CLOSE);
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstraintError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Grammars {
            factory,
            think_end,
            n_vocab: n,
        })
    }

    /// Built once per process for a tokenizer (the trie of a 248k vocabulary takes a moment).
    pub fn shared(tok: &Arc<Tokenizer>) -> Result<Arc<Grammars>, ConstraintError> {
        static CELL: OnceLock<Result<Arc<Grammars>, ConstraintError>> = OnceLock::new();
        let r = CELL.get_or_init(|| Grammars::new(tok.clone()).map(Arc::new));
        match r {
            Ok(g) if g.n_vocab == tok.n_vocab() => Ok(g.clone()),
            // Another tokenizer in the same process (tests): build its own.
            Ok(_) => Grammars::new(tok.clone()).map(Arc::new),
            Err(e) => Err(e.clone()),
        }
    }

    /// Compiles `spec`; `after_think`: the prompt leaves `<think>` open, so the grammar waits
    /// for `</think>`.
    pub fn compile(
        &self,
        spec: &GrammarSpec,
        after_think: bool,
    ) -> Result<Constraint, ConstraintError> {
        let dormant = after_think && self.think_end.is_some();
        let lark = spec.to_lark(dormant)?;
        let err = |why: String| ConstraintError::Grammar {
            what: spec.what().to_string(),
            why,
        };
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| err(e.to_string()))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(err(e));
        }
        Ok(Constraint {
            m,
            dormant,
            think_end: self.think_end,
            words: self.n_vocab.div_ceil(32),
            cost: Duration::ZERO,
        })
    }
}

/// One request's grammar state.
#[derive(Clone)]
pub struct Constraint {
    m: Matcher,
    /// Waiting for `</think>`.
    dormant: bool,
    think_end: Option<u32>,
    words: usize,
    /// How long the last `masks_for` took (the engine's grammar-cost metric).
    cost: Duration,
}

/// A mask per verify row: `masks[i]` holds for row i (row 0 after the last sampled token, row
/// i after the first i drafts); a draft the mask forbids ends the list.
pub type Masks = Vec<Vec<u32>>;

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("dormant", &self.dormant)
            .field("stopped", &self.m.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// An independent copy of this state (another choice of the same request).
    pub fn fork(&self) -> Constraint {
        Constraint {
            m: self.m.deep_clone(),
            dormant: self.dormant,
            think_end: self.think_end,
            words: self.words,
            cost: self.cost,
        }
    }

    pub fn is_active(&self) -> bool {
        !self.dormant
    }

    /// The grammar is complete and allows nothing more.
    pub fn is_done(&self) -> bool {
        !self.dormant && self.m.is_stopped()
    }

    pub fn error(&self) -> Option<String> {
        self.m.get_error()
    }

    fn mask_now(&mut self) -> Result<Vec<u32>, String> {
        let v = self.m.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let mut w = v.as_slice().to_vec();
        w.resize(self.words, 0);
        Ok(w)
    }

    /// The masks for a verify batch `[last, drafts..]`: row 0 from the current state, then
    /// after each draft in turn (the drafts are consumed tentatively and rolled back). The engine
    /// runs it beside the forward, as a job in the forward's thread pool. Dormant: no masks.
    pub fn masks_for(&mut self, drafts: &[u32]) -> Result<Masks, String> {
        if self.dormant {
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        let r = self.masks_after(drafts);
        self.cost = t0.elapsed();
        r
    }

    /// How long the last `masks_for` took.
    pub fn mask_cost(&self) -> Duration {
        self.cost
    }

    fn masks_after(&mut self, drafts: &[u32]) -> Result<Masks, String> {
        let mut out = vec![self.mask_now()?];
        let mut consumed = 0;
        for &d in drafts {
            let ok = out.last().is_some_and(|m| {
                m.get(d as usize / 32)
                    .is_some_and(|w| w >> (d % 32) & 1 == 1)
            });
            if !ok || self.m.is_stopped() || self.m.consume_token(d).is_err() {
                break;
            }
            consumed += 1;
            if self.m.is_stopped() {
                break;
            }
            out.push(self.mask_now()?);
        }
        if consumed > 0 {
            self.m.rollback(consumed).map_err(|e| e.to_string())?;
        }
        Ok(out)
    }

    /// How many of `drafts` the grammar accepts in a row (nothing is consumed): a draft is
    /// cut there before it costs verify rows.
    pub fn valid_prefix(&mut self, drafts: &[u32]) -> usize {
        if self.dormant {
            // Only up to and including `</think>` is certain to be free.
            return drafts
                .iter()
                .position(|&d| Some(d) == self.think_end)
                .map_or(drafts.len(), |i| i + 1);
        }
        self.m.validate_tokens(drafts).unwrap_or(0)
    }

    /// Records a sampled token. Returns true when this token woke the grammar (it was
    /// `</think>`): masks computed before it no longer hold.
    pub fn commit(&mut self, id: u32) -> Result<bool, String> {
        if self.dormant {
            if Some(id) == self.think_end {
                self.dormant = false;
                return Ok(true);
            }
            return Ok(false);
        }
        if self.m.is_stopped() {
            return Ok(false);
        }
        self.m.consume_token(id).map_err(|e| e.to_string())?;
        Ok(false)
    }
}

/// GBNF (llama.cpp's grammar format) as llguidance Lark: `a ::= b` rules become `a: b`,
/// dashes in names become underscores, `root` is the start, character classes and `.` become
/// regexes, literals are re-quoted; repetition (`*`, `+`, `?`, `{m,n}`), grouping and
/// alternation carry over.
pub fn gbnf_to_lark(src: &str) -> Result<String, ConstraintError> {
    let err = |why: String| ConstraintError::Grammar {
        what: "grammar (gbnf)".into(),
        why,
    };
    #[derive(Debug, PartialEq)]
    enum T {
        Name(String),
        Def,
        Text(String),
    }
    let b: Vec<char> = src.chars().collect();
    let mut toks: Vec<T> = Vec::new();
    let mut i = 0;
    let name = |s: &str| s.replace('-', "_").to_ascii_lowercase();
    while i < b.len() {
        let c = b[i];
        if c == '#' {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c.is_whitespace() {
            i += 1;
        } else if c == ':' && b.get(i + 1) == Some(&':') && b.get(i + 2) == Some(&'=') {
            toks.push(T::Def);
            i += 3;
        } else if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
            let s = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '-' || b[i] == '_') {
                i += 1;
            }
            toks.push(T::Name(b[s..i].iter().collect()));
        } else if c == '"' {
            let mut lit = String::new();
            i += 1;
            loop {
                let Some(&ch) = b.get(i) else {
                    return Err(err("unterminated string literal".into()));
                };
                i += 1;
                match ch {
                    '"' => break,
                    '\\' => {
                        let (v, n) = gbnf_escape(&b[i..]).map_err(err)?;
                        lit.push(v);
                        i += n;
                    }
                    ch => lit.push(ch),
                }
            }
            toks.push(T::Text(
                serde_json::to_string(&lit).expect("a string serializes"),
            ));
        } else if c == '[' {
            let mut class = String::from("[");
            i += 1;
            if b.get(i) == Some(&'^') {
                class.push('^');
                i += 1;
            }
            loop {
                let Some(&ch) = b.get(i) else {
                    return Err(err("unterminated character class".into()));
                };
                i += 1;
                match ch {
                    ']' => break,
                    '\\' => {
                        let (v, n) = gbnf_escape(&b[i..]).map_err(err)?;
                        i += n;
                        push_class_char(&mut class, v);
                    }
                    '-' => class.push('-'),
                    ch => push_class_char(&mut class, ch),
                }
            }
            class.push(']');
            toks.push(T::Text(format!("/{class}/")));
        } else if c == '.' {
            toks.push(T::Text("/(?s:.)/".into()));
            i += 1;
        } else if "()|*+?".contains(c) {
            toks.push(T::Text(c.to_string()));
            i += 1;
        } else if c == '{' {
            let s = i;
            while i < b.len() && b[i] != '}' {
                i += 1;
            }
            if i >= b.len() {
                return Err(err("unterminated {m,n} repetition".into()));
            }
            i += 1;
            let rep: String = b[s..i].iter().filter(|c| !c.is_whitespace()).collect();
            toks.push(T::Text(rep));
        } else {
            return Err(err(format!("unexpected character {c:?}")));
        }
    }
    let mut out = String::new();
    let mut has_root = false;
    let mut k = 0;
    while k < toks.len() {
        let (T::Name(n), Some(T::Def)) = (&toks[k], toks.get(k + 1)) else {
            return Err(err(format!(
                "expected a rule `name ::= ...`, found {:?}",
                toks[k]
            )));
        };
        has_root |= n == "root";
        out.push_str(&name(n));
        out.push(':');
        k += 2;
        while k < toks.len() {
            if let (T::Name(_), Some(T::Def)) = (&toks[k], toks.get(k + 1)) {
                break;
            }
            let glued = matches!(&toks[k], T::Text(t) if matches!(t.as_str(), "*" | "+" | "?") || t.starts_with('{'));
            if !glued {
                out.push(' ');
            }
            match &toks[k] {
                T::Name(r) => out.push_str(&name(r)),
                T::Text(t) => out.push_str(t),
                T::Def => return Err(err("misplaced ::=".into())),
            }
            k += 1;
        }
        out.push('\n');
    }
    if !has_root {
        return Err(err("no `root` rule".into()));
    }
    Ok(format!("start: root\n{out}"))
}

fn push_class_char(class: &mut String, c: char) {
    if "\\]^[-/".contains(c) {
        class.push('\\');
        class.push(c);
    } else if c == '\n' {
        class.push_str("\\n");
    } else if c == '\r' {
        class.push_str("\\r");
    } else if c == '\t' {
        class.push_str("\\t");
    } else {
        class.push(c);
    }
}

/// A GBNF escape after its backslash: the char and how many chars it used.
fn gbnf_escape(b: &[char]) -> Result<(char, usize), String> {
    let hex = |n: usize| -> Result<(char, usize), String> {
        let s: String = b
            .get(1..1 + n)
            .ok_or("a short \\x/\\u escape")?
            .iter()
            .collect();
        let v = u32::from_str_radix(&s, 16).map_err(|_| format!("bad escape \\{}{s}", b[0]))?;
        Ok((
            char::from_u32(v).ok_or(format!("bad code point {v:#x}"))?,
            1 + n,
        ))
    };
    match b.first() {
        Some('n') => Ok(('\n', 1)),
        Some('r') => Ok(('\r', 1)),
        Some('t') => Ok(('\t', 1)),
        Some('x') => hex(2),
        Some('u') => hex(4),
        Some('U') => hex(8),
        Some(&c) => Ok((c, 1)),
        None => Err("a trailing backslash".into()),
    }
}

/// The Lark grammar that forces Qwen3.5's tool-call block for one of `tools` (OpenAI-shaped),
/// each parameter in the order its schema lists it, required ones always, string values
/// verbatim and the others as JSON their schema validates.
pub fn tool_call_lark(tools: &[&Value]) -> Result<String, ConstraintError> {
    let err = |why: String| ConstraintError::Grammar {
        what: "tool_choice".into(),
        why,
    };
    let mut rules = String::new();
    let mut alts = Vec::new();
    for (ti, t) in tools.iter().enumerate() {
        let f = t.get("function").unwrap_or(t);
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| err(format!("tools[{ti}] has no function name")))?;
        let params = f.get("parameters");
        let props = params
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object);
        let required: Vec<&str> = params
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let q = |s: &str| serde_json::to_string(s).expect("a string serializes");
        let mut body = vec![q(&format!("<tool_call>\n<function={name}>\n"))];
        for (pi, (pname, schema)) in props.into_iter().flatten().enumerate() {
            let rule = format!("t{ti}_p{pi}");
            let is_string = matches!(schema.get("type"), Some(Value::String(s)) if s == "string");
            // The parser takes a string parameter's text verbatim (as llama.cpp's XML tool
            // format does), so a string enum is its values written raw, not as JSON strings.
            let choices: Option<Vec<&str>> = match (schema.get("const"), schema.get("enum")) {
                (Some(c), _) => c.as_str().map(|c| vec![c]),
                (None, Some(e)) => e
                    .as_array()
                    .and_then(|a| a.iter().map(Value::as_str).collect()),
                (None, None) => None,
            };
            let constrained = schema.get("const").is_some() || schema.get("enum").is_some();
            if let (true, Some(choices)) = (is_string, choices.filter(|c| !c.is_empty())) {
                let alts: Vec<String> = choices.iter().map(|c| q(c)).collect();
                rules.push_str(&format!(
                    "{rule}: {} ({}) {}\n",
                    q(&format!("<parameter={pname}>\n")),
                    alts.join(" | "),
                    q("\n</parameter>\n"),
                ));
            } else if is_string && !constrained {
                // Written verbatim up to the closing tag; `minLength`/`maxLength` bound it.
                let len = |k: &str| schema.get(k).and_then(Value::as_u64);
                let body = match (len("minLength"), len("maxLength")) {
                    (None, None) => "*".to_string(),
                    (lo, Some(hi)) => format!("{{{},{hi}}}", lo.unwrap_or(0)),
                    (Some(lo), None) => format!("{{{lo},}}"),
                };
                rules.push_str(&format!(
                    "{rule}: {} {rule}_v\n{rule}_v[suffix={}]: /(?s:.{body})/\n",
                    q(&format!("<parameter={pname}>\n")),
                    q("\n</parameter>\n"),
                ));
            } else {
                rules.push_str(&format!(
                    "{rule}: {} %json {} {}\n",
                    q(&format!("<parameter={pname}>\n")),
                    llama_spacing(schema),
                    q("\n</parameter>\n"),
                ));
            }
            body.push(if required.contains(&pname.as_str()) {
                rule
            } else {
                format!("{rule}?")
            });
        }
        body.push(q("</function>\n</tool_call>"));
        rules.push_str(&format!("tool{ti}: {}\n", body.join(" ")));
        alts.push(format!("tool{ti}"));
    }
    if alts.is_empty() {
        return Err(err("no tools to call".into()));
    }
    Ok(format!("start: {}\n{rules}", alts.join(" | ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_converts_rules_classes_and_literals() {
        let g = gbnf_to_lark(
            "root ::= \"yes\" | \"no\" item-list # a comment\nitem-list ::= [a-z0-9_\\-]+ (\",\" [^\\n\"])* .{1,3}\n",
        )
        .unwrap();
        assert_eq!(
            g,
            "start: root\nroot: \"yes\" | \"no\" item_list\nitem_list: /[a-z0-9_\\-]/+ ( \",\" /[^\\n\"]/ )* /(?s:.)/{1,3}\n"
        );
        assert!(gbnf_to_lark("item ::= \"x\"")
            .unwrap_err()
            .to_string()
            .contains("root"));
        assert!(gbnf_to_lark("root ::= \"x")
            .unwrap_err()
            .to_string()
            .contains("unterminated"));
    }

    #[test]
    fn start_is_renamed_outside_strings() {
        assert_eq!(
            rename_start("start: \"start\" starts | start\n"),
            "tern_start: \"start\" starts | tern_start\n"
        );
    }

    #[test]
    fn tool_call_grammar_lists_parameters() {
        let t = serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer"}}, "required": ["city"]}}});
        let g = tool_call_lark(&[&t]).unwrap();
        assert!(g.starts_with("start: tool0\n"));
        assert!(g.contains("t0_p0_v[suffix=\"\\n</parameter>\\n\"]: /(?s:.*)/"));
        assert!(g.contains("%json {\"type\":\"integer\",\"x-guidance\":"));
        assert!(g.contains("tool0: \"<tool_call>\\n<function=get_weather>\\n\" t0_p0 t0_p1? "));
    }

    #[test]
    fn a_string_enum_is_written_raw() {
        let t = serde_json::json!({"type": "function", "function": {"name": "w",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "unit": {"type": "string", "const": "C"},
                "n": {"enum": [1, 2]}}}}});
        let g = tool_call_lark(&[&t]).unwrap();
        assert!(
            g.contains(
                "t0_p0: \"<parameter=city>\\n\" (\"Paris\" | \"Oslo\") \"\\n</parameter>\\n\"\n"
            ),
            "{g}"
        );
        assert!(g.contains("t0_p1: \"<parameter=unit>\\n\" (\"C\") "), "{g}");
        // Not a string parameter: the parser reads it as JSON, so the grammar writes JSON.
        assert!(g.contains("t0_p2: \"<parameter=n>\\n\" %json "), "{g}");
    }
}
