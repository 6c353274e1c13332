//! Our family templates against the prompts ollama's own renderers produce for the same
//! conversations (the expected strings are those of `model/renderers/gemma4_reference_test.go`
//! and `glm47_test.go`).

use serde_json::{json, Value};
use serve::template::{builtin, render, Context};

fn gemma4(messages: &[Value], tools: &[Value], think: Option<bool>) -> String {
    let ctx = Context {
        messages,
        tools: (!tools.is_empty()).then_some(tools),
        add_generation_prompt: true,
        bos_token: "<bos>",
        eos_token: "<eos>",
        enable_thinking: think,
    };
    render(builtin("gemma4").unwrap(), &ctx).unwrap()
}

fn glm(messages: &[Value], tools: &[Value], think: Option<bool>) -> String {
    let ctx = Context {
        messages,
        tools: (!tools.is_empty()).then_some(tools),
        add_generation_prompt: true,
        bos_token: "",
        eos_token: "",
        enable_thinking: think,
    };
    render(builtin("glm-4.7").unwrap(), &ctx).unwrap()
}

fn bash_tool() -> Value {
    json!({"type": "function", "function": {"name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "required": ["command"],
            "properties": {"command": {"type": "string", "description": "The command"}}}}})
}

const Q: &str = "<|\"|>";

fn bash_decl() -> String {
    format!("<|tool>declaration:bash{{description:{Q}Run a command{Q},parameters:{{properties:{{command:{{description:{Q}The command{Q},type:{Q}STRING{Q}}}}},required:[{Q}command{Q}],type:{Q}OBJECT{Q}}}}}<tool|>")
}

#[test]
fn gemma4_plain_turns() {
    let user = [json!({"role": "user", "content": "Hello"})];
    assert_eq!(
        gemma4(&user, &[], None),
        "<bos><|turn>user\nHello<turn|>\n<|turn>model\n"
    );
    let sys = [
        json!({"role": "system", "content": "You are helpful."}),
        json!({"role": "user", "content": "Hi"}),
    ];
    assert_eq!(
        gemma4(&sys, &[], None),
        "<bos><|turn>system\nYou are helpful.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    );
    let hi = [json!({"role": "user", "content": "Hi"})];
    assert_eq!(
        gemma4(&hi, &[], Some(true)),
        "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    );
    assert_eq!(
        gemma4(&hi, &[], Some(false)),
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    );
    assert_eq!(
        gemma4(&sys, &[bash_tool()], Some(true)),
        format!(
            "<bos><|turn>system\n<|think|>\nYou are helpful.{}<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n",
            bash_decl()
        )
    );
    let strip = [
        json!({"role": "user", "content": "2+2?"}),
        json!({"role": "assistant", "content": "<|channel>thought\nThinking...<channel|>4"}),
        json!({"role": "user", "content": "ok"}),
    ];
    assert!(gemma4(&strip, &[], None).contains("<|turn>model\n4<turn|>\n"));
}

#[test]
fn gemma4_tool_round_trip() {
    let msgs = [
        json!({"role": "system", "content": "You are helpful."}),
        json!({"role": "user", "content": "List files"}),
        json!({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}]}),
        json!({"role": "tool", "tool_name": "bash", "content": "file1.txt\nfile2.txt"}),
    ];
    let head = format!(
        "<bos><|turn>system\nYou are helpful.{}<turn|>\n<|turn>user\nList files<turn|>\n<|turn>model\n<|tool_call>call:bash{{command:{Q}ls{Q}}}<tool_call|><|tool_response>response:bash{{value:{Q}file1.txt\nfile2.txt{Q}}}<tool_response|>",
        bash_decl()
    );
    // Ends on the tool result: the model continues its turn (in a thought when thinking).
    assert_eq!(gemma4(&msgs, &[bash_tool()], Some(false)), head);
    assert_eq!(
        gemma4(&msgs, &[bash_tool()], Some(true)),
        head.replace("<|turn>system\n", "<|turn>system\n<|think|>\n") + "<|channel>thought\n"
    );
    let mut more = msgs.to_vec();
    more.push(json!({"role": "assistant", "content": "Here are the files."}));
    more.push(json!({"role": "user", "content": "Read file1.txt"}));
    assert_eq!(
        gemma4(&more, &[bash_tool()], Some(false)),
        format!(
            "{head}Here are the files.<turn|>\n<|turn>user\nRead file1.txt<turn|>\n<|turn>model\n"
        )
    );
    // A call without its result yet.
    let pending = [
        json!({"role": "user", "content": "List files"}),
        json!({"role": "assistant", "content": "Let me check.", "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}]}),
    ];
    assert!(gemma4(&pending, &[], Some(false)).ends_with(&format!(
        "<|turn>model\n<|tool_call>call:bash{{command:{Q}ls{Q}}}<tool_call|>Let me check.<|tool_response>"
    )));
    // Results are named by the call they answer, in the order given; thinking after the last
    // user turn is kept.
    let ids = [
        json!({"role": "user", "content": "List files, then read config."}),
        json!({"role": "assistant", "content": "", "thinking": "Need the listing.", "tool_calls": [
            {"id": "call_bash", "function": {"name": "bash", "arguments": {"command": "ls -la"}}},
            {"id": "call_read", "function": {"name": "read", "arguments": {"path": "config.json"}}}]}),
        json!({"role": "tool", "tool_call_id": "call_read", "content": "{\"debug\": true}"}),
        json!({"role": "tool", "tool_call_id": "call_bash", "content": "config.json\nmain.go"}),
        json!({"role": "assistant", "content": "Config loaded."}),
    ];
    let out = gemma4(&ids, &[], Some(true));
    assert!(out.ends_with(&format!(
        "<|turn>model\n<|channel>thought\nNeed the listing.\n<channel|><|tool_call>call:bash{{command:{Q}ls -la{Q}}}<tool_call|><|tool_call>call:read{{path:{Q}config.json{Q}}}<tool_call|><|tool_response>response:read{{value:{Q}{{\"debug\": true}}{Q}}}<tool_response|><|tool_response>response:bash{{value:{Q}config.json\nmain.go{Q}}}<tool_response|>Config loaded.<turn|>\n<|turn>model\n"
    )), "{out}");
}

#[test]
fn gemma4_argument_syntax() {
    use serve::families::gemma4_value;
    assert_eq!(
        gemma4_value(&json!({"config": {"db": {"port": 5432, "host": "localhost"}}})),
        format!("{{config:{{db:{{host:{Q}localhost{Q},port:5432}}}}}}")
    );
    assert_eq!(
        gemma4_value(&json!({"ids": ["a", 1, true]})),
        format!("{{ids:[{Q}a{Q},1,true]}}")
    );
    assert_eq!(gemma4_value(&json!({"value": 2.5})), "{value:2.5}");
    assert_eq!(
        gemma4_value(&json!({"value": null, "nested": {"value": null}})),
        "{nested:{value:null},value:null}"
    );
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Get weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}})
}

#[test]
fn glm_turns() {
    let hello = [json!({"role": "user", "content": "Hello"})];
    assert_eq!(
        glm(&hello, &[], Some(true)),
        "[gMASK]<sop><|user|>Hello<|assistant|><think>"
    );
    assert_eq!(
        glm(&hello, &[], None),
        "[gMASK]<sop><|user|>Hello<|assistant|><think>"
    );
    assert_eq!(
        glm(&hello, &[], Some(false)),
        "[gMASK]<sop><|user|>Hello<|assistant|></think>"
    );
    let multi = [
        json!({"role": "user", "content": "Hi"}),
        json!({"role": "assistant", "content": "Hello there"}),
        json!({"role": "user", "content": "How are you?"}),
    ];
    assert_eq!(
        glm(&multi, &[], Some(true)),
        "[gMASK]<sop><|user|>Hi<|assistant|></think>Hello there<|user|>How are you?<|assistant|><think>"
    );
    let thought = [
        json!({"role": "user", "content": "Think step by step"}),
        json!({"role": "assistant", "content": "Here's my answer.", "thinking": "Let me think..."}),
        json!({"role": "user", "content": "Continue"}),
    ];
    assert_eq!(
        glm(&thought, &[], Some(true)),
        "[gMASK]<sop><|user|>Think step by step<|assistant|><think>Let me think...</think>Here's my answer.<|user|>Continue<|assistant|><think>"
    );
}

#[test]
fn glm_tool_round_trip() {
    let msgs = [
        json!({"role": "user", "content": "Weather?"}),
        json!({"role": "assistant", "content": "Let me check", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"location": "Tokyo"}}}]}),
        json!({"role": "tool", "content": "{\"temperature\":22}"}),
        json!({"role": "assistant", "content": "It is 22C."}),
    ];
    let expected = "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get weather\", \"parameters\": {\"type\": \"object\", \"required\": [\"location\"], \"properties\": {\"location\": {\"type\": \"string\"}}}}}\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call><|user|>Weather?<|assistant|></think>Let me check<tool_call>get_weather<arg_key>location</arg_key><arg_value>Tokyo</arg_value></tool_call><|observation|><tool_response>{\"temperature\":22}</tool_response><|assistant|></think>It is 22C.<|assistant|><think>";
    assert_eq!(glm(&msgs, &[weather_tool()], Some(true)), expected);
    let two = [
        json!({"role": "user", "content": "Compare weather"}),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"location": "Tokyo"}}},
            {"function": {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius", "days": 3}}}]}),
        json!({"role": "tool", "content": "{\"temperature\":22}"}),
        json!({"role": "tool", "content": "{\"temperature\":18}"}),
    ];
    assert!(glm(&two, &[weather_tool()], Some(true)).ends_with("<|user|>Compare weather<|assistant|></think><tool_call>get_weather<arg_key>location</arg_key><arg_value>Tokyo</arg_value></tool_call><tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value><arg_key>unit</arg_key><arg_value>celsius</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call><|observation|><tool_response>{\"temperature\":22}</tool_response><tool_response>{\"temperature\":18}</tool_response><|assistant|><think>"));
}
