//! `cargo xtask llama-flags`: the options stock llama-server accepts, read from llama.cpp's
//! `common/arg.cpp`, written to `fixtures/llama-server-flags.json` for tern's flag-table test.
//!
//! arg.cpp registers every option with `add_opt(common_arg({spellings}, [{negative spellings},]
//! [VALUE_HINT,] help, handler).set_examples({...}).set_excludes({...}).set_env("NAME"))`. An
//! option reaches llama-server when its examples name LLAMA_EXAMPLE_SERVER, or name
//! LLAMA_EXAMPLE_COMMON (the default when set_examples is absent) without excluding the server
//! (arg.cpp's own `add_opt` filter).

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

/// One `add_opt(common_arg(...)...)` call, as source text split into its parts.
#[derive(Debug, Default)]
struct Opt {
    args: Vec<String>,
    neg: Vec<String>,
    value_hint: Option<String>,
    env: Option<String>,
    examples: Vec<String>,
    excludes: Vec<String>,
    /// void, bool, int, string or str_str (the handler's signature).
    kind: &'static str,
}

/// Index just past the bracket that closes the one at `open` (`(`, `{`), skipping string and
/// character literals and comments.
fn close_of(s: &[u8], open: usize) -> Result<usize> {
    let mut depth = 0i32;
    let mut i = open;
    while i < s.len() {
        match s[i] {
            b'"' | b'\'' => {
                let q = s[i];
                i += 1;
                while i < s.len() && s[i] != q {
                    if s[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            b'/' if s.get(i + 1) == Some(&b'/') => {
                while i < s.len() && s[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if s.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < s.len() && !(s[i] == b'*' && s[i + 1] == b'/') {
                    i += 1;
                }
                i += 1;
            }
            b'(' | b'{' | b'[' => depth += 1,
            b')' | b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Ok(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    bail!("unbalanced bracket at byte {open}")
}

/// Splits `s` (the inside of a bracket) at its top-level commas.
fn top_level_items(s: &str) -> Result<Vec<String>> {
    let b = s.as_bytes();
    let mut items = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'(' | b'{' | b'[' => {
                i = close_of(b, i)?;
                continue;
            }
            b'"' | b'\'' => {
                let q = b[i];
                i += 1;
                while i < b.len() && b[i] != q {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b',' => {
                items.push(s[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    let last = s[start..].trim();
    if !last.is_empty() {
        items.push(last.to_string());
    }
    Ok(items)
}

/// The string literals in `s`, unescaped only as far as these names need.
fn literals(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'"' {
            let mut lit = String::new();
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                lit.push(b[i] as char);
                i += 1;
            }
            out.push(lit);
        }
        i += 1;
    }
    out
}

fn is_string_item(item: &str) -> bool {
    item.starts_with('"')
}

/// `src` without its comments (string and character literals kept whole).
fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' | b'\'' => {
                let q = b[i];
                out.push(b[i]);
                i += 1;
                while i < b.len() && b[i] != q {
                    if b[i] == b'\\' {
                        out.push(b[i]);
                        i += 1;
                    }
                    if i < b.len() {
                        out.push(b[i]);
                    }
                    i += 1;
                }
                if i < b.len() {
                    out.push(b[i]);
                }
                i += 1;
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `static std::initializer_list<enum llama_example> NAME = {...};` lists that `set_examples`
/// may name instead of spelling the examples out.
fn example_lists(src: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for (at, _) in src.match_indices("std::initializer_list<enum llama_example>") {
        let rest = &src[at..];
        let Some(eq) = rest.find('=') else { continue };
        let Some(end) = rest.find(';') else { continue };
        let name = rest[..eq]
            .split_whitespace()
            .last()
            .unwrap_or("")
            .to_string();
        out.push((name, example_names(&rest[eq..end])));
    }
    out
}

fn example_names(s: &str) -> Vec<String> {
    s.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("LLAMA_EXAMPLE_"))
        .map(str::to_string)
        .collect()
}

fn parse_call(call: &str, lists: &[(String, Vec<String>)]) -> Result<Opt> {
    // call = `common_arg( ... )` followed by the chained setters.
    let b = call.as_bytes();
    let open = call.find('(').context("common_arg without '('")?;
    let close = close_of(b, open)?;
    let items = top_level_items(&call[open + 1..close - 1])?;
    let mut o = Opt {
        kind: "void",
        ..Default::default()
    };
    let mut it = items.iter().peekable();
    let args = it.next().context("common_arg without its spellings")?;
    o.args = literals(args);
    if it.peek().is_some_and(|s| s.starts_with('{')) {
        o.neg = literals(it.next().unwrap_or(&String::new()));
    }
    let rest: Vec<&String> = it.collect();
    let handler = rest.last().context("common_arg without a handler")?;
    let strings = &rest[..rest.len() - 1];
    // (hint, help) or (hint, hint2, help) when the item before the help is a plain literal.
    // A hint built by a call (`--spec-type`'s list of types) is kept as its source text.
    if strings.len() >= 2 {
        o.value_hint = if is_string_item(strings[0]) {
            literals(strings[0]).first().cloned()
        } else {
            Some(strings[0].to_string())
        };
    }
    let sig = handler
        .split_once(')')
        .map(|(a, _)| a)
        .unwrap_or(handler.as_str());
    o.kind = if strings.len() >= 3 {
        "str_str"
    } else if sig.contains("std::string") {
        "string"
    } else if sig.contains("int ") || sig.contains("int)") {
        "int"
    } else if sig.contains("bool") {
        "bool"
    } else {
        "void"
    };
    // The chained setters.
    let tail = &call[close..];
    let setter = |name: &str| -> Option<String> {
        let at = tail.find(name)?;
        let open = at + tail[at..].find('(')?;
        let close = close_of(tail.as_bytes(), open).ok()?;
        Some(tail[open + 1..close - 1].to_string())
    };
    if let Some(e) = setter(".set_examples(") {
        o.examples = match lists.iter().find(|(name, _)| name == e.trim()) {
            Some((_, l)) => l.clone(),
            None => example_names(&e),
        };
        if o.examples.is_empty() {
            bail!("set_examples({e}) names no example");
        }
    } else {
        o.examples = vec!["LLAMA_EXAMPLE_COMMON".into()];
    }
    if let Some(e) = setter(".set_excludes(") {
        o.excludes = example_names(&e);
    }
    if let Some(e) = setter(".set_env(") {
        o.env = literals(&e).first().cloned();
    }
    Ok(o)
}

fn in_server(o: &Opt) -> bool {
    let has = |e: &str| o.examples.iter().any(|x| x == e);
    (has("LLAMA_EXAMPLE_SERVER") || has("LLAMA_EXAMPLE_COMMON"))
        && !o.excludes.iter().any(|x| x == "LLAMA_EXAMPLE_SERVER")
}

/// Every llama-server option in `arg_cpp`, in registration order.
pub fn server_options(arg_cpp: &Path) -> Result<Vec<Value>> {
    let src = std::fs::read_to_string(arg_cpp)
        .with_context(|| format!("cannot read {}", arg_cpp.display()))?;
    // Only the parser's own function: the preset-only options after it are not flags.
    let end = src
        .find("void common_params_add_preset_options")
        .unwrap_or(src.len());
    let src = strip_comments(&src[..end]);
    let src = src.as_str();
    let lists = example_lists(src);
    let mut out: Vec<Value> = Vec::new();
    let mut from = 0;
    while let Some(at) = src[from..].find("add_opt(common_arg(") {
        let start = from + at;
        let open = start + "add_opt".len();
        let close = close_of(src.as_bytes(), open)?;
        let o = parse_call(&src[open + 1..close - 1], &lists)
            .with_context(|| format!("arg.cpp at byte {start}"))?;
        from = close;
        if o.args.is_empty() {
            bail!("arg.cpp at byte {start}: an option without spellings");
        }
        // `-np` is registered twice (server and the rest, chosen at run time): keep one.
        let dup = out.iter().any(|v| v["args"] == json!(o.args));
        if in_server(&o) && !dup {
            out.push(json!({
                "args": o.args,
                "neg": o.neg,
                "value": o.value_hint,
                "kind": o.kind,
                "env": o.env,
            }));
        }
    }
    if out.len() < 100 {
        bail!(
            "only {} server options found in {}: is it llama.cpp's common/arg.cpp?",
            out.len(),
            arg_cpp.display()
        );
    }
    Ok(out)
}

pub fn run(arg_cpp: &Path, out: &Path) -> Result<()> {
    let opts = server_options(arg_cpp)?;
    let n_spellings: usize = opts
        .iter()
        .map(|o| o["args"].as_array().map_or(0, Vec::len) + o["neg"].as_array().map_or(0, Vec::len))
        .sum();
    let doc = json!({
        "source": "llama.cpp common/arg.cpp (the options llama-server accepts)",
        "options": opts,
    });
    std::fs::write(out, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("cannot write {}", out.display()))?;
    println!(
        "wrote {}: {} options, {} spellings",
        out.display(),
        opts.len(),
        n_spellings
    );
    Ok(())
}
