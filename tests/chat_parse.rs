//! The output parser: reasoning split, Qwen3.5 tool-call blocks, and the streaming state
//! machine, on scripted text (the bundled model is random-weight and never emits these).

use serde_json::{json, Value};
use tern::chat::parse::parse_tool_block;
use tern::chat::{ChatParser, Delta, ParsedMessage, ParserConfig, ToolCall, ToolSpecs};

fn tools() -> ToolSpecs {
    ToolSpecs::from_openai(&json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "zip": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "extra": {"type": ["object", "null"]}
            }
        }}},
        {"type": "function", "function": {"name": "search", "parameters": {
            "type": "object", "properties": {"query": {"type": "string"}}
        }}}
    ]))
}

fn cfg(reasoning: bool, open: bool, with_tools: bool) -> ParserConfig {
    ParserConfig {
        reasoning,
        starts_in_reasoning: open,
        tools: with_tools.then(tools),
    }
}

fn ids(i: usize) -> String {
    format!("call_{i}")
}

fn parse(c: ParserConfig, text: &str) -> ParsedMessage {
    let mut p = ChatParser::with_ids(c, ids);
    p.push(text);
    p.finish();
    p.message().clone()
}

/// Feeds `text` in pieces of `n` chars; returns the deltas and the message.
fn stream(c: ParserConfig, text: &str, n: usize) -> (Vec<Delta>, ParsedMessage) {
    let mut p = ChatParser::with_ids(c, ids);
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    for piece in chars.chunks(n) {
        out.extend(p.push(&piece.iter().collect::<String>()));
    }
    out.extend(p.finish());
    (out, p.message().clone())
}

fn args(s: &str) -> Value {
    serde_json::from_str(s).expect("arguments are valid JSON")
}

const WEATHER_CALL: &str = "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis, France\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=extra>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>";

#[test]
fn the_prompt_decides_whether_output_starts_in_reasoning() {
    assert!(ParserConfig::prompt_opens_thinking(
        "<|im_start|>assistant\n<think>\n"
    ));
    assert!(!ParserConfig::prompt_opens_thinking(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ));
    assert!(!ParserConfig::prompt_opens_thinking(
        "<|im_start|>assistant\n"
    ));
}

#[test]
fn reasoning_then_content() {
    let m = parse(
        cfg(true, true, false),
        "The user asks 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.",
    );
    assert_eq!(m.reasoning, "The user asks 2+2.\nIt is 4.");
    assert_eq!(m.content, "The answer is 4.");
    assert!(m.tool_calls.is_empty());
}

#[test]
fn an_explicit_think_tag_opens_reasoning() {
    let m = parse(cfg(true, false, false), "\n<think>\nhmm\n</think>\nHi!");
    assert_eq!(m.reasoning, "hmm");
    assert_eq!(m.content, "Hi!");
    let m = parse(cfg(true, false, false), "No thinking here.");
    assert_eq!(m.reasoning, "");
    assert_eq!(m.content, "No thinking here.");
    // A prefix of <think> at the very end is text.
    let m = parse(cfg(true, false, false), "<thi");
    assert_eq!(m.content, "<thi");
}

#[test]
fn a_budget_that_ends_inside_thinking_leaves_content_empty() {
    let m = parse(
        cfg(true, true, false),
        "Let me think about this carefully and",
    );
    assert_eq!(m.reasoning, "Let me think about this carefully and");
    assert_eq!(m.content, "");
}

#[test]
fn reasoning_format_none_keeps_everything_as_content() {
    let text = "thinking\n</think>\n\nanswer";
    let m = parse(cfg(false, true, false), text);
    assert_eq!(m.reasoning, "");
    assert_eq!(m.content, text);
}

#[test]
fn one_tool_call_with_typed_arguments() {
    let text = format!("I'll check.\n</think>\n\n{WEATHER_CALL}");
    let m = parse(cfg(true, true, true), &text);
    assert_eq!(m.reasoning, "I'll check.");
    assert_eq!(m.content, "");
    assert_eq!(m.tool_calls.len(), 1);
    let c = &m.tool_calls[0];
    assert_eq!(
        (c.index, c.id.as_str(), c.name.as_str()),
        (0, "call_0", "get_weather")
    );
    // Strings stay strings (even "75001", declared a string); the rest keep their JSON type.
    assert_eq!(
        args(&c.arguments),
        json!({"location": "Paris, France", "zip": "75001", "days": 3, "metric": true, "extra": {"a": [1, 2]}})
    );
    // The key order is the model's.
    assert!(c.arguments.starts_with("{\"location\""), "{}", c.arguments);
}

#[test]
fn undeclared_parameters_parse_as_json_or_fall_back_to_strings() {
    let specs = ToolSpecs::default();
    let block = "<tool_call>\n<function=anything>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\nhello world\n</parameter>\n<parameter=multi>\nline one\nline two\n</parameter>\n<parameter=q>\n\"quoted\"\n</parameter>\n</function>\n</tool_call>";
    let (name, a) = parse_tool_block(block, &specs).unwrap();
    assert_eq!(name, "anything");
    assert_eq!(
        args(&a),
        json!({"n": 42, "s": "hello world", "multi": "line one\nline two", "q": "quoted"})
    );
    // No parameters at all.
    let (name, a) = parse_tool_block(
        "<tool_call>\n<function=ping>\n</function>\n</tool_call>",
        &specs,
    )
    .unwrap();
    assert_eq!((name.as_str(), a.as_str()), ("ping", "{}"));
}

#[test]
fn content_before_and_several_calls() {
    let text = format!(
        "Let me look both up.\n\n{WEATHER_CALL}\n<tool_call>\n<function=search>\n<parameter=query>\nRome weather\n</parameter>\n</function>\n</tool_call>\n"
    );
    let m = parse(cfg(false, false, true), &text);
    assert_eq!(m.content, "Let me look both up.");
    let names: Vec<_> = m.tool_calls.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["get_weather", "search"]);
    assert_eq!(m.tool_calls[1].index, 1);
    assert_eq!(m.tool_calls[1].id, "call_1");
    assert_eq!(
        args(&m.tool_calls[1].arguments),
        json!({"query": "Rome weather"})
    );
}

#[test]
fn a_tool_call_tag_ends_reasoning() {
    let text = format!("thinking about it\n{WEATHER_CALL}");
    let m = parse(cfg(true, true, true), &text);
    assert_eq!(m.reasoning, "thinking about it");
    assert_eq!(m.tool_calls.len(), 1);
}

#[test]
fn malformed_blocks_come_back_as_content() {
    for bad in [
        // No <function=…>.
        "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>",
        // Text between parameters.
        "<tool_call>\n<function=f>\nstray\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        // An unclosed parameter.
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>",
        // An empty name.
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        // No </function>.
        "<tool_call>\n<function=f>\n</tool_call>",
    ] {
        let m = parse(cfg(false, false, true), bad);
        assert!(m.tool_calls.is_empty(), "{bad}");
        assert_eq!(m.content, bad);
        // And the same streamed a character at a time.
        let (_, s) = stream(cfg(false, false, true), bad, 1);
        assert_eq!(s, m, "{bad}");
    }
}

#[test]
fn a_block_cut_off_by_the_budget_is_content() {
    let cut = &WEATHER_CALL[..WEATHER_CALL.len() - 20];
    let m = parse(cfg(false, false, true), &format!("Checking.\n{cut}"));
    assert!(m.tool_calls.is_empty());
    assert_eq!(m.content, format!("Checking.{cut}"));
}

#[test]
fn without_tools_blocks_are_plain_content() {
    let m = parse(cfg(false, false, false), WEATHER_CALL);
    assert!(m.tool_calls.is_empty());
    assert_eq!(m.content, WEATHER_CALL);
}

#[test]
fn text_after_a_call_is_content() {
    let text = format!("{WEATHER_CALL}\n\nDone.");
    let m = parse(cfg(false, false, true), &text);
    assert_eq!(m.tool_calls.len(), 1);
    assert_eq!(m.content, "Done.");
}

/// Every split of the text gives the same message as the whole text, and a stream's deltas add
/// up to it.
#[test]
fn streaming_matches_the_whole_text_at_every_split() {
    let texts = [
        (
            cfg(true, true, true),
            format!("Plan: call the tool.\n</think>\n\nSure.\n{WEATHER_CALL}\n"),
        ),
        (
            cfg(true, false, true),
            "<think>\nshort</think>\n\nHello <b>world</b> <tool_ca and more".to_string(),
        ),
        (
            cfg(true, true, false),
            "Reasoning with a fake </thin tag</think>Answer ends with spaces   ".to_string(),
        ),
        (
            cfg(false, false, true),
            format!("{WEATHER_CALL}{WEATHER_CALL}"),
        ),
        (
            cfg(true, true, true),
            "ünïcödé thoughts 🚀</think>\n\nrésumé".to_string(),
        ),
    ];
    for (c, text) in texts {
        let whole = parse(c.clone(), &text);
        for n in [1, 2, 3, 5, 7, 11, 64] {
            let (deltas, msg) = stream(c.clone(), &text, n);
            assert_eq!(msg, whole, "split {n} of {text:?}");
            let mut r = String::new();
            let mut content = String::new();
            let mut calls: Vec<ToolCall> = Vec::new();
            for d in deltas {
                match d {
                    Delta::Reasoning(s) => {
                        assert!(!s.is_empty());
                        r.push_str(&s)
                    }
                    Delta::Content(s) => {
                        assert!(!s.is_empty());
                        content.push_str(&s)
                    }
                    Delta::ToolCall(t) => calls.push(t),
                }
            }
            assert_eq!(
                (r, content, calls),
                (
                    whole.reasoning.clone(),
                    whole.content.clone(),
                    whole.tool_calls.clone()
                )
            );
        }
    }
}

/// Content streams as it comes: only a tail that may still become a tag is held back.
#[test]
fn streaming_releases_text_early_and_holds_back_partial_tags() {
    let mut p = ChatParser::with_ids(cfg(true, true, true), ids);
    assert_eq!(p.push("Thinking"), [Delta::Reasoning("Thinking".into())]);
    assert_eq!(p.push(" more</th"), [Delta::Reasoning(" more".into())]);
    assert!(p.in_reasoning());
    assert_eq!(p.push("ink>\n\nHi"), [Delta::Content("Hi".into())]);
    assert!(!p.in_reasoning());
    assert_eq!(p.push(" there <tool"), [Delta::Content(" there".into())]);
    // The block is held until it closes, then comes out as one tool call.
    assert!(p
        .push("_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n")
        .is_empty());
    let d = p.push("</tool_call>");
    assert_eq!(
        d,
        [Delta::ToolCall(ToolCall {
            index: 0,
            id: "call_0".into(),
            name: "search".into(),
            arguments: "{\"query\":\"x\"}".into()
        })]
    );
    assert!(p.finish().is_empty());
    assert_eq!(p.message().content, "Hi there");
}

#[test]
fn random_tool_call_ids_are_distinct() {
    let text = format!("{WEATHER_CALL}{WEATHER_CALL}");
    let m = ChatParser::parse_all(cfg(false, false, true), &text);
    assert_eq!(m.tool_calls.len(), 2);
    assert!(m.tool_calls[0].id.starts_with("call_"));
    assert_ne!(m.tool_calls[0].id, m.tool_calls[1].id);
}
