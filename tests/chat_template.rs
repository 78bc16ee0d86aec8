//! The real Qwen3.5 chat template (../shared/data/qwen3.5-chat-template.jinja) rendered by
//! tern's minijinja setup, compared byte for byte with what jinja2 3.1.6 renders when set up as
//! transformers sets it up (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
//! loopcontrols, `tojson` = `json.dumps(ensure_ascii=False)`, `raise_exception`).

use serde_json::{json, Value};
use tern::chat::template::python_json;
use tern::chat::{map_reasoning_effort, ChatTemplate, TemplateError, TemplateInputs};

const QWEN35: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/data/qwen3.5-chat-template.jinja"
);

fn qwen35() -> ChatTemplate {
    let src = std::fs::read_to_string(QWEN35).expect("the shared Qwen3.5 template");
    ChatTemplate::new(&src).expect("the template compiles")
}

/// Renders a case given as jinja2 received it: `messages`, `tools`, `add_generation_prompt`
/// and any other variables.
fn render(t: &ChatTemplate, case: Value) -> Result<String, TemplateError> {
    let mut m = case.as_object().cloned().unwrap_or_default();
    let messages = m.remove("messages").unwrap_or(Value::Null);
    let tools = m.remove("tools");
    let agp = m
        .remove("add_generation_prompt")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    t.render(&TemplateInputs {
        messages,
        tools,
        add_generation_prompt: agp,
        kwargs: m,
        bos_token: String::new(),
        eos_token: "<|im_end|>".into(),
    })
}

#[test]
fn system_user() {
    let case: Value = serde_json::from_str(r##"{"messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}], "add_generation_prompt": true}"##).unwrap();
    let expected = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n";
    assert_eq!(render(&qwen35(), case).unwrap(), expected);
}

#[test]
fn thinking_off() {
    let case: Value = serde_json::from_str(r##"{"messages": [{"role": "user", "content": "What is 2+2?"}], "add_generation_prompt": true, "enable_thinking": false}"##).unwrap();
    let expected =
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    assert_eq!(render(&qwen35(), case).unwrap(), expected);
}

#[test]
fn assistant_reasoning() {
    let case: Value = serde_json::from_str(r##"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "The user greets me."}, {"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "<think>\nA pun works.\n</think>\n\nWhy did the chicken cross the road?"}], "add_generation_prompt": false}"##).unwrap();
    let expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n<think>\nA pun works.\n</think>\n\nWhy did the chicken cross the road?<|im_end|>\n";
    assert_eq!(render(&qwen35(), case).unwrap(), expected);
}

#[test]
fn tools() {
    let case: Value = serde_json::from_str(r##"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get the user's weather in °C & more <now>", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}, "days": {"type": "integer"}}, "required": ["location"]}}}], "add_generation_prompt": true}"##).unwrap();
    let expected = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the user's weather in °C & more <now>\", \"parameters\": {\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \"description\": \"City name\"}, \"days\": {\"type\": \"integer\"}}, \"required\": [\"location\"]}}}\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n";
    assert_eq!(render(&qwen35(), case).unwrap(), expected);
}

#[test]
fn tool_results() {
    let case: Value = serde_json::from_str(r##"{"messages": [{"role": "user", "content": "Weather in Paris and Rome?"}, {"role": "assistant", "content": "", "reasoning_content": "I need the weather.", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris", "days": 3, "metric": true, "opts": {"a": [1, 2]}}}}, {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Rome"}}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}, {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 25}"}], "add_generation_prompt": true}"##).unwrap();
    let expected = "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n<think>\nI need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=location>\nRome\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n{\"temp\": 25}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n";
    assert_eq!(render(&qwen35(), case).unwrap(), expected);
}

#[test]
fn text_parts() {
    let case: Value = serde_json::from_str(r##"{"messages": [{"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": " Part two."}]}], "add_generation_prompt": true}"##).unwrap();
    let expected =
        "<|im_start|>user\nPart one. Part two.<|im_end|>\n<|im_start|>assistant\n<think>\n";
    assert_eq!(render(&qwen35(), case).unwrap(), expected);
}

#[test]
fn no_user() {
    let case: Value = serde_json::from_str(r##"{"messages": [{"role": "system", "content": "Only a system message."}], "add_generation_prompt": true}"##).unwrap();
    let err = render(&qwen35(), case).unwrap_err();
    assert_eq!(
        err,
        TemplateError::Render("No user query found in messages.".into())
    );
}

/// A template that, like the Ternary-Bonsai-2 variant, takes only xhigh|medium|low.
const EFFORT_TEMPLATE: &str = "{%- if reasoning_effort is defined %}{%- if reasoning_effort not in ['xhigh', 'medium', 'low'] %}{{- raise_exception('reasoning_effort must be xhigh, medium or low') }}{%- endif %}effort={{ reasoning_effort }}{%- endif %}|{{ messages[0].content }}";

#[test]
fn reasoning_effort_maps_to_an_accepted_level() {
    assert_eq!(map_reasoning_effort("low"), ("low".into(), None));
    assert_eq!(map_reasoning_effort("medium"), ("medium".into(), None));
    assert_eq!(map_reasoning_effort("xhigh"), ("xhigh".into(), None));
    assert_eq!(map_reasoning_effort("XHIGH").0, "xhigh");
    for (asked, got) in [
        ("minimal", "low"),
        ("high", "xhigh"),
        ("max", "xhigh"),
        ("turbo", "medium"),
        ("", "medium"),
    ] {
        let (level, note) = map_reasoning_effort(asked);
        assert_eq!(level, got, "{asked:?}");
        let note = note.expect("a mapped level is logged");
        assert!(
            note.contains(got) && note.contains("xhigh|medium|low"),
            "{note}"
        );
    }
    // Every mapped level renders through a template that raises on anything else.
    let t = ChatTemplate::new(EFFORT_TEMPLATE).unwrap();
    for asked in ["minimal", "low", "medium", "high", "xhigh", "bogus"] {
        let (level, _) = map_reasoning_effort(asked);
        let out = render(
            &t,
            json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": level}),
        )
        .unwrap();
        assert_eq!(out, format!("effort={level}|hi"));
    }
    // Unmapped, the template raises (which the server would otherwise answer with an error).
    let err = render(
        &t,
        json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}),
    )
    .unwrap_err();
    assert_eq!(
        err,
        TemplateError::Render("reasoning_effort must be xhigh, medium or low".into())
    );
}

#[test]
fn tojson_writes_what_python_json_dumps_writes() {
    let v = json!({"b": 1, "a": [1.5, true, null, "it's <ok> & \"q\"\n°"], "e": {}, "f": [], "g": 1e-5, "h": 2.0});
    assert_eq!(
        python_json(&v, None),
        r#"{"b": 1, "a": [1.5, true, null, "it's <ok> & \"q\"\n°"], "e": {}, "f": [], "g": 1e-05, "h": 2.0}"#
    );
    assert_eq!(
        python_json(&json!({"a": [1, {"b": null}], "c": []}), Some(2)),
        "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"c\": []\n}"
    );
    let t = ChatTemplate::new(
        "{{ x | tojson }}|{{ x | tojson(indent=1) }}|{{ b | string }}|{{ n | string }}",
    )
    .unwrap();
    let out = render(&t, json!({"x": {"k": "v"}, "b": false, "n": null})).unwrap();
    assert_eq!(out, "{\"k\": \"v\"}|{\n \"k\": \"v\"\n}|False|None");
}

#[test]
fn a_template_that_does_not_parse_is_refused_at_load() {
    let err = ChatTemplate::new("{% if %}").unwrap_err();
    assert!(matches!(err, TemplateError::Syntax(_)), "{err:?}");
}
