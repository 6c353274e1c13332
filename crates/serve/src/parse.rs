//! Model output into content, thinking and tool calls, as it streams: gemma4's
//! `<|channel>…<channel|>` thoughts and `<|tool_call>call:NAME{…}<tool_call|>` calls, GLM's
//! `<think>…</think>` and `<tool_call>NAME<arg_key>…</arg_key><arg_value>…</arg_value></tool_call>`
//! (the formats ollama's parsers read, `model/parsers`). A tag split across chunks is held back
//! until it is whole.

use serde_json::{json, Map, Value};

/// What one chunk of output added.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub thinking: String,
    /// ollama's `api.ToolCall` objects.
    pub tool_calls: Vec<Value>,
}

impl Parsed {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.thinking.is_empty() && self.tool_calls.is_empty()
    }
}

pub trait OutputParser: Send {
    fn add(&mut self, text: &str, done: bool) -> Parsed;
}

/// Stop strings a family's turns end with, besides the tokenizer's EOS ids.
pub fn stops(family: &str) -> &'static [&'static str] {
    match family {
        "gemma4" => &["<turn|>"],
        "glm-4.7" => &["<|user|>", "<|observation|>", "<|endoftext|>"],
        _ => &[],
    }
}

/// The parser for `family`'s output. `thinking`: the request has thinking on; `prompt`: what
/// the model continues (a prompt ending inside a thought starts the parser there).
pub fn parser(
    family: &str,
    tools: &[Value],
    thinking: bool,
    prompt: &str,
) -> Box<dyn OutputParser> {
    match family {
        "gemma4" => Box::new(Tagged::new(
            Syntax::Gemma4,
            tools,
            thinking,
            thinking && prompt.ends_with("<|channel>thought\n"),
        )),
        "glm-4.7" => Box::new(Tagged::new(
            Syntax::Glm,
            tools,
            true,
            prompt.ends_with("<think>"),
        )),
        _ => Box::new(Plain),
    }
}

/// Text as it comes.
struct Plain;

impl OutputParser for Plain {
    fn add(&mut self, text: &str, _done: bool) -> Parsed {
        Parsed {
            content: text.to_string(),
            ..Default::default()
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Syntax {
    Gemma4,
    Glm,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum State {
    Content,
    Thinking,
    Call,
}

struct Tagged {
    syntax: Syntax,
    tools: Vec<Value>,
    /// Thinking is returned (else a thought block is dropped, as ollama drops gemma4's).
    keep_thinking: bool,
    state: State,
    buf: String,
    /// Whitespace at the end of content or thinking, held until more text follows (text is
    /// trimmed at the tags around it).
    held_ws: String,
    /// Whitespace after a closing tag is dropped.
    skip_ws: bool,
    /// gemma4's optional channel name after `<|channel>`.
    strip_channel_name: bool,
    /// Just after a call: the markers a model may repeat there are noise, not content.
    after_call: bool,
    calls: usize,
}

struct Tags {
    think_open: &'static str,
    think_close: &'static str,
    call_open: &'static str,
    call_close: &'static str,
    /// Markers dropped from content.
    noise: &'static [&'static str],
}

impl Syntax {
    fn tags(self) -> Tags {
        match self {
            Syntax::Gemma4 => Tags {
                think_open: "<|channel>",
                think_close: "<channel|>",
                call_open: "<|tool_call>",
                call_close: "<tool_call|>",
                noise: &["<|tool_response>", "<tool_call|>"],
            },
            Syntax::Glm => Tags {
                think_open: "<think>",
                think_close: "</think>",
                call_open: "<tool_call>",
                call_close: "</tool_call>",
                noise: &[],
            },
        }
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of one of `tags`: text that
/// may be the start of a tag and must wait for the next chunk.
fn partial_tag(s: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for t in tags {
        for n in (1..t.len()).rev() {
            if n > best
                && s.len() >= n
                && s.is_char_boundary(s.len() - n)
                && t.starts_with(&s[s.len() - n..])
            {
                best = n;
                break;
            }
        }
    }
    best
}

impl Tagged {
    fn new(syntax: Syntax, tools: &[Value], keep_thinking: bool, in_thought: bool) -> Tagged {
        Tagged {
            syntax,
            tools: tools.to_vec(),
            keep_thinking,
            state: if in_thought {
                State::Thinking
            } else {
                State::Content
            },
            buf: String::new(),
            held_ws: String::new(),
            skip_ws: false,
            strip_channel_name: false,
            after_call: false,
            calls: 0,
        }
    }

    /// Emits `text` as content or thinking, trimming at tag boundaries.
    fn emit(&mut self, out: &mut Parsed, text: &str) {
        let text = if self.skip_ws {
            let t = text.trim_start();
            if t.is_empty() {
                return;
            }
            self.skip_ws = false;
            t
        } else {
            text
        };
        let body = text.trim_end();
        if body.is_empty() {
            self.held_ws.push_str(text);
            return;
        }
        let held = std::mem::take(&mut self.held_ws);
        self.held_ws = text[body.len()..].to_string();
        let target = match self.state {
            State::Thinking if !self.keep_thinking => return,
            State::Thinking => &mut out.thinking,
            _ => &mut out.content,
        };
        target.push_str(&held);
        target.push_str(body);
    }

    /// A tag ends the text before it: its held whitespace goes, and so does what follows.
    fn at_tag(&mut self) {
        self.held_ws.clear();
        self.skip_ws = true;
    }

    fn call(&mut self, body: &str) -> Option<Value> {
        let (name, args) = match self.syntax {
            Syntax::Gemma4 => gemma4_call(body)?,
            Syntax::Glm => glm_call(body, &self.tools)?,
        };
        let index = self.calls;
        self.calls += 1;
        Some(json!({
            "id": call_id(),
            "function": {"index": index, "name": name, "arguments": args},
        }))
    }
}

impl OutputParser for Tagged {
    fn add(&mut self, text: &str, done: bool) -> Parsed {
        let tags = self.syntax.tags();
        self.buf.push_str(text);
        let mut out = Parsed::default();
        loop {
            if self.strip_channel_name && self.state == State::Thinking {
                // `<|channel>thought\n`: the channel's name is not part of the thought.
                if "thought\n".starts_with(self.buf.as_str()) && !done {
                    break;
                }
                if let Some(rest) = self.buf.strip_prefix("thought\n") {
                    self.buf = rest.to_string();
                }
                self.strip_channel_name = false;
            }
            match self.state {
                State::Content => {
                    let mut openers = vec![tags.think_open, tags.call_open];
                    if self.after_call {
                        openers.extend(tags.noise);
                    }
                    let found = openers
                        .iter()
                        .filter_map(|t| self.buf.find(t).map(|i| (i, *t)))
                        .min_by_key(|(i, t)| (*i, std::cmp::Reverse(t.len())));
                    match found {
                        Some((i, tag)) => {
                            let before = self.buf[..i].to_string();
                            if !before.trim().is_empty() {
                                self.after_call = false;
                            }
                            self.emit(&mut out, &before);
                            self.buf.drain(..i + tag.len());
                            if tag == tags.think_open {
                                self.at_tag();
                                self.skip_ws = self.syntax == Syntax::Glm;
                                self.state = State::Thinking;
                                self.strip_channel_name = self.syntax == Syntax::Gemma4;
                            } else if tag == tags.call_open {
                                self.at_tag();
                                self.state = State::Call;
                            } else {
                                self.at_tag();
                            }
                        }
                        None => {
                            let keep = if done {
                                0
                            } else {
                                partial_tag(&self.buf, &openers)
                            };
                            let now: String = self.buf.drain(..self.buf.len() - keep).collect();
                            self.emit(&mut out, &now);
                            break;
                        }
                    }
                }
                State::Thinking => match self.buf.find(tags.think_close) {
                    Some(i) => {
                        let before = self.buf[..i].to_string();
                        self.emit(&mut out, &before);
                        self.buf.drain(..i + tags.think_close.len());
                        self.at_tag();
                        self.state = State::Content;
                    }
                    None => {
                        let keep = if done {
                            0
                        } else {
                            partial_tag(&self.buf, &[tags.think_close])
                        };
                        let now: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.emit(&mut out, &now);
                        break;
                    }
                },
                State::Call => match self.buf.find(tags.call_close) {
                    Some(i) => {
                        let body = self.buf[..i].to_string();
                        self.buf.drain(..i + tags.call_close.len());
                        match self.call(&body) {
                            Some(c) => out.tool_calls.push(c),
                            None => tracing::warn!(body = %body, "unreadable tool call dropped"),
                        }
                        self.at_tag();
                        self.after_call = true;
                        self.state = State::Content;
                    }
                    None if done => {
                        // The output ended inside a call (cut by a length limit, say). gemma4's
                        // is read as far as it goes, as ollama does; GLM's only when nothing but
                        // the closing tag is missing and the call is complete for its tool: a
                        // truncated argument must not become a call that acts.
                        let body = std::mem::take(&mut self.buf);
                        let complete =
                            self.syntax == Syntax::Gemma4 || glm_complete(&body, &self.tools);
                        match self.call(&body) {
                            Some(c) if complete => out.tool_calls.push(c),
                            _ => tracing::warn!(body = %body, "unfinished tool call dropped"),
                        }
                        break;
                    }
                    None => break,
                },
            }
        }
        if done {
            self.held_ws.clear();
        }
        out
    }
}

fn call_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let s: String = (0..8)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect();
    format!("call_{s}")
}

/// `call:NAME{key:value,...}` with `<|"|>` around strings and bare keys.
fn gemma4_call(body: &str) -> Option<(String, Value)> {
    let body = body.trim().strip_prefix("call:")?;
    let brace = body.find('{').unwrap_or(body.len());
    let name = body[..brace].trim().to_string();
    if name.is_empty() {
        return None;
    }
    let args = body[brace..].trim();
    if args.is_empty() {
        return Some((name, json!({})));
    }
    let json_text = gemma4_args_to_json(args);
    let mut value: Value = serde_json::from_str(&json_text)
        .or_else(|_| serde_json::from_str(&format!("{json_text}}}")))
        .ok()?;
    unsigned_zeros(&mut value);
    value.is_object().then_some((name, value))
}

/// JSON's `-0` reads as the float −0.0; as an argument it is the integer 0 (an integer schema
/// admits it, and a caller matching on integers must get one).
fn unsigned_zeros(v: &mut Value) {
    match v {
        Value::Number(n) if n.as_f64() == Some(0.0) && n.is_f64() => *v = Value::from(0),
        Value::Array(a) => a.iter_mut().for_each(unsigned_zeros),
        Value::Object(o) => o.values_mut().for_each(unsigned_zeros),
        _ => {}
    }
}

/// gemma4's argument syntax as JSON: `<|"|>…<|"|>` spans become JSON strings of their verbatim
/// text, bare keys after `{` or `,` are quoted, everything else passes through.
pub fn gemma4_args_to_json(s: &str) -> String {
    const Q: &str = "<|\"|>";
    let mut out = String::with_capacity(s.len() + 16);
    let mut rest = s;
    let mut after_open = false;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix(Q) {
            let end = r.find(Q).unwrap_or(r.len());
            out.push_str(&Value::from(&r[..end]).to_string());
            rest = r.get(end + Q.len()..).unwrap_or("");
            after_open = false;
            continue;
        }
        if rest.starts_with('"') {
            // A JSON string: copied whole.
            let mut end = 1;
            let bytes = rest.as_bytes();
            while end < bytes.len() && bytes[end] != b'"' {
                end += if bytes[end] == b'\\' { 2 } else { 1 };
            }
            let end = (end + 1).min(rest.len());
            out.push_str(&rest[..end]);
            rest = &rest[end..];
            after_open = false;
            continue;
        }
        let c = rest.chars().next().unwrap_or_default();
        if after_open && (c.is_ascii_alphanumeric() || c == '_') {
            let key_len = rest
                .find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                .unwrap_or(rest.len());
            if rest[key_len..].trim_start().starts_with(':') {
                out.push('"');
                out.push_str(&rest[..key_len]);
                out.push('"');
                rest = &rest[key_len..];
                after_open = false;
                continue;
            }
        }
        if c == '{' || c == ',' {
            after_open = true;
        } else if !c.is_whitespace() {
            after_open = false;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// `NAME<arg_key>k</arg_key><arg_value>v</arg_value>...`, values typed by the tool's schema.
fn glm_call(body: &str, tools: &[Value]) -> Option<(String, Value)> {
    let body = body.trim();
    let first = body.find("<arg_key>").unwrap_or(body.len());
    let name = body[..first].trim().to_string();
    if name.is_empty() {
        return None;
    }
    let schema = tools
        .iter()
        .find(|t| t["function"]["name"] == name.as_str())
        .map(|t| t["function"]["parameters"]["properties"].clone())
        .unwrap_or(Value::Null);
    let mut args = Map::new();
    let mut rest = &body[first..];
    while let Some(k) = rest.find("<arg_key>") {
        rest = &rest[k + "<arg_key>".len()..];
        let kend = rest.find("</arg_key>")?;
        let key = rest[..kend].trim().to_string();
        rest = &rest[kend + "</arg_key>".len()..];
        let Some(v) = rest.find("<arg_value>") else {
            args.insert(key, Value::Null);
            break;
        };
        rest = &rest[v + "<arg_value>".len()..];
        let vend = rest.find("</arg_value>").unwrap_or(rest.len());
        let raw = &rest[..vend];
        rest = rest.get(vend + "</arg_value>".len()..).unwrap_or("");
        let types = property_types(&schema[&key]);
        args.insert(key, typed_value(raw, &types));
    }
    Some((name, Value::Object(args)))
}

/// An unclosed GLM call that lacks only its closing tag: every value closed, the tool
/// declared (when tools were given) and its required arguments present.
fn glm_complete(body: &str, tools: &[Value]) -> bool {
    let body = body.trim_end();
    if body.matches("<arg_value>").count() != body.matches("</arg_value>").count()
        || body.matches("<arg_key>").count() != body.matches("</arg_key>").count()
        || body.ends_with("<")
        || body
            .rfind("</")
            .is_some_and(|i| !body[i..].ends_with("</arg_value>"))
    {
        return false;
    }
    let Some((name, args)) = glm_call(body, tools) else {
        return false;
    };
    if tools.is_empty() {
        return true;
    }
    let Some(tool) = tools
        .iter()
        .find(|t| t["function"]["name"] == name.as_str())
    else {
        return false;
    };
    tool["function"]["parameters"]["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .all(|r| args.get(r).is_some())
}

fn property_types(p: &Value) -> Vec<String> {
    let mut out = Vec::new();
    match &p["type"] {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => out.extend(a.iter().filter_map(|t| t.as_str().map(String::from))),
        _ => {}
    }
    if let Some(any) = p["anyOf"].as_array() {
        for branch in any {
            out.extend(property_types(branch));
        }
    }
    out
}

/// A GLM argument value by its declared types (ollama's `parseValue`): without a type it stays
/// a string; otherwise boolean, integer, number, array, object, string are tried in order.
fn typed_value(raw: &str, types: &[String]) -> Value {
    let v = raw.strip_prefix('\n').unwrap_or(raw);
    let v = v.strip_suffix('\n').unwrap_or(v);
    if types.is_empty() {
        return Value::from(v);
    }
    if v.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    let has = |t: &str| types.iter().any(|x| x == t);
    if has("boolean") {
        match v.to_ascii_lowercase().as_str() {
            "true" => return Value::Bool(true),
            "false" => return Value::Bool(false),
            _ if types.len() == 1 => return Value::Bool(false),
            _ => {}
        }
    }
    if has("integer") {
        if let Ok(n) = v.trim().parse::<i64>() {
            return Value::from(n);
        }
    }
    if has("number") {
        if let Ok(f) = v.trim().parse::<f64>() {
            return if f.fract() == 0.0 && f.abs() < 9e15 {
                Value::from(f as i64)
            } else {
                Value::from(f)
            };
        }
    }
    if has("array") || has("object") {
        if let Ok(j) = serde_json::from_str::<Value>(v) {
            if (has("array") && j.is_array()) || (has("object") && j.is_object()) {
                return j;
            }
        }
    }
    Value::from(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &mut dyn OutputParser, pieces: &[&str]) -> Parsed {
        let mut all = Parsed::default();
        for (i, piece) in pieces.iter().enumerate() {
            let got = p.add(piece, i + 1 == pieces.len());
            all.content.push_str(&got.content);
            all.thinking.push_str(&got.thinking);
            all.tool_calls.extend(got.tool_calls);
        }
        all
    }

    /// Every split of `text` into two chunks parses as the whole does.
    fn same_when_split(
        family: &str,
        tools: &[Value],
        thinking: bool,
        prompt: &str,
        text: &str,
    ) -> Parsed {
        let whole = run(&mut *parser(family, tools, thinking, prompt), &[text]);
        for cut in 0..=text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let split = run(
                &mut *parser(family, tools, thinking, prompt),
                &[&text[..cut], &text[cut..]],
            );
            assert_eq!(split.content, whole.content, "cut at {cut}");
            assert_eq!(split.thinking, whole.thinking, "cut at {cut}");
            assert_eq!(
                split.tool_calls.len(),
                whole.tool_calls.len(),
                "cut at {cut}"
            );
            for (a, b) in split.tool_calls.iter().zip(&whole.tool_calls) {
                assert_eq!(a["function"], b["function"], "cut at {cut}");
            }
        }
        whole
    }

    // Expectations from ollama's parser tests (model/parsers/gemma4_test.go, glm47_test.go).

    #[test]
    fn gemma4_thinking_then_answer() {
        let p = same_when_split(
            "gemma4",
            &[],
            true,
            "",
            "<|channel>thought\nLet me think about this...<channel|>The answer is 42.",
        );
        assert_eq!(p.thinking, "Let me think about this...");
        assert_eq!(p.content, "The answer is 42.");
    }

    #[test]
    fn gemma4_thoughts_are_dropped_when_thinking_is_off() {
        let p = same_when_split(
            "gemma4",
            &[],
            false,
            "",
            "<|channel>this is not thinking<channel|>actual content",
        );
        assert_eq!(
            (p.thinking.as_str(), p.content.as_str()),
            ("", "actual content")
        );
    }

    #[test]
    fn gemma4_tool_calls() {
        let p = same_when_split(
            "gemma4",
            &[],
            false,
            "",
            "Let me check that for you.<|tool_call>call:get_weather{location:<|\"|>Paris<|\"|>,units:<|\"|>metric<|\"|>}<tool_call|><|tool_response>",
        );
        assert_eq!(p.content, "Let me check that for you.");
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(
            p.tool_calls[0]["function"],
            json!({"index": 0, "name": "get_weather", "arguments": {"location": "Paris", "units": "metric"}})
        );
        let p = same_when_split(
            "gemma4",
            &[],
            false,
            "",
            "<|tool_call>call:set_optional{value:null,nested:{value:null},n:42,s:<|\"|>C:\\users\\bob<|\"|>}<tool_call|>",
        );
        assert_eq!(
            p.tool_calls[0]["function"]["arguments"],
            json!({"value": null, "nested": {"value": null}, "n": 42, "s": "C:\\users\\bob"})
        );
    }

    #[test]
    fn gemma4_after_a_tool_response_starts_in_thought() {
        let p = same_when_split(
            "gemma4",
            &[],
            true,
            "...<tool_response|><|channel>thought\n",
            "The user asked for files.<channel|>go.mod and go.sum",
        );
        assert_eq!(p.thinking, "The user asked for files.");
        assert_eq!(p.content, "go.mod and go.sum");
    }

    #[test]
    fn glm_thinking_content_and_typed_call() {
        let tools = [
            json!({"type": "function", "function": {"name": "calculate", "parameters": {"type": "object", "properties": {"count": {"type": "integer"}, "enabled": {"type": "boolean"}}}}}),
        ];
        let p = same_when_split(
            "glm-4.7",
            &tools,
            true,
            "<|assistant|><think>",
            "plan</think>Answer<tool_call>calculate<arg_key>count</arg_key><arg_value>3</arg_value><arg_key>enabled</arg_key><arg_value>true</arg_value></tool_call>",
        );
        assert_eq!(p.thinking, "plan");
        assert_eq!(p.content, "Answer");
        assert_eq!(
            p.tool_calls[0]["function"]["arguments"],
            json!({"count": 3, "enabled": true})
        );
    }

    #[test]
    fn glm_without_thinking_and_untyped_calls() {
        let p = same_when_split(
            "glm-4.7",
            &[],
            false,
            "<|assistant|></think>",
            "Plain answer",
        );
        assert_eq!(
            (p.thinking.as_str(), p.content.as_str()),
            ("", "Plain answer")
        );
        let p = same_when_split(
            "glm-4.7",
            &[],
            true,
            "<think>",
            "plan</think>\n<tool_call>first<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>\n<tool_call>second<arg_key>b</arg_key><arg_value>a < b && c > d</arg_value></tool_call>",
        );
        let f: Vec<_> = p.tool_calls.iter().map(|c| c["function"].clone()).collect();
        assert_eq!(
            f[0],
            json!({"index": 0, "name": "first", "arguments": {"a": "1"}})
        );
        assert_eq!(
            f[1],
            json!({"index": 1, "name": "second", "arguments": {"b": "a < b && c > d"}})
        );
        // Output that ends inside a call: kept only when nothing but the closing tag is
        // missing.
        let cut = |text: &str| {
            run(&mut *parser("glm-4.7", &[], false, ""), &[text])
                .tool_calls
                .len()
        };
        assert_eq!(
            cut("<tool_call>w\n<arg_key>city</arg_key>\n<arg_value>Paris"),
            0
        );
        assert_eq!(
            cut("<tool_call>w<arg_key>city</arg_key><arg_value>P</arg_value>"),
            1
        );
        assert_eq!(
            cut("<tool_call>w<arg_key>city</arg_key><arg_value>P</arg_value></tool"),
            0
        );
        let tools =
            [json!({"function": {"name": "w", "parameters": {"required": ["city", "day"]}}})];
        let p = run(
            &mut *parser("glm-4.7", &tools, false, ""),
            &["<tool_call>w<arg_key>city</arg_key><arg_value>P</arg_value>"],
        );
        assert!(p.tool_calls.is_empty(), "a required argument is missing");
        // Markers after a call are noise; the same text elsewhere is content.
        let p = run(
            &mut *parser("gemma4", &[], false, ""),
            &["<|tool_call>call:f{}<tool_call|><|tool_response>"],
        );
        assert_eq!((p.tool_calls.len(), p.content.as_str()), (1, ""));
        let p = run(
            &mut *parser("gemma4", &[], false, ""),
            &["a <|tool_response> b"],
        );
        assert_eq!(p.content, "a <|tool_response> b");
    }

    #[test]
    fn glm_values_follow_the_schema() {
        let t = |v: &str, types: &[&str]| {
            typed_value(v, &types.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(t("2.5", &["number"]), json!(2.5));
        assert_eq!(t("42", &["integer"]), json!(42));
        assert_eq!(t("[\"a\", \"b\"]", &["array"]), json!(["a", "b"]));
        assert_eq!(
            t("Error: could not load todos", &["array", "string"]),
            json!("Error: could not load todos")
        );
        assert_eq!(t("NULL", &["string"]), Value::Null);
        assert_eq!(t("7", &[]), json!("7"));
    }

    #[test]
    fn plain_text_passes_through() {
        let p = run(&mut *parser("", &[], true, ""), &["a <think> b", " c"]);
        assert_eq!(p.content, "a <think> b c");
    }
}
