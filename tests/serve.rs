//! `mlx-runner serve` end to end: the real binary as the parent, spawning real runners over
//! loopback HTTP, driven through ollama's and OpenAI's APIs on fixture models in a temporary
//! store.

mod common;

use common::serve::Serve;
use common::{fixture, wait_timeout};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};

use std::time::{Duration, Instant};

fn greedy(n: i64) -> Value {
    json!({"temperature": 0, "num_predict": n})
}

fn text(lines: &[Value], key: &str) -> String {
    lines
        .iter()
        .map(|l| {
            l.pointer(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

#[test]
fn ollama_api_generate_chat_and_models() {
    let s = Serve::start(&[]);
    assert_eq!(
        ureq::head(&s.url("/")).call().unwrap().status(),
        200,
        "HEAD / answers"
    );
    assert!(s.get("/api/version")["version"].is_string());
    let tags = s.get("/api/tags");
    let names: Vec<&str> = tags["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gem:latest", "glm:latest"]);
    assert_eq!(tags["models"][0]["details"]["format"], "safetensors");

    // Streaming and not give the same text; the final object carries ollama's metrics.
    let body =
        json!({"model": "gem", "prompt": "Hello there", "options": greedy(12), "think": false});
    let (code, one) = s.post("/api/generate", &json!({"stream": false, "model": "gem", "prompt": "Hello there", "options": greedy(12), "think": false}));
    assert_eq!(code, 200, "{one}");
    let lines = s.stream("/api/generate", &body);
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(text(&lines, "/response"), one["response"].as_str().unwrap());
    assert_eq!(one["done_reason"], "length");
    assert_eq!(one["eval_count"], 12);
    for k in [
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "eval_duration",
    ] {
        assert!(one[k].as_u64().unwrap() > 0, "{k} in {one}");
    }

    // A stop string ends the answer before it, reason "stop".
    let full = one["response"].as_str().unwrap();
    let cut = full.char_indices().nth(4).map(|(i, _)| i).unwrap();
    let stop: String = full[cut..].chars().take(2).collect();
    let (_, stopped) = s.post(
        "/api/generate",
        &json!({"stream": false, "model": "gem", "prompt": "Hello there", "think": false,
                "options": {"temperature": 0, "num_predict": 12, "stop": [stop]}}),
    );
    assert!(full.starts_with(stopped["response"].as_str().unwrap()));
    assert!(stopped["response"].as_str().unwrap().len() <= cut);
    assert_eq!(stopped["done_reason"], "stop");

    // Seeded sampling is reproducible.
    let seeded = json!({"stream": false, "model": "glm", "messages": [{"role": "user", "content": "Tell me"}],
                        "options": {"temperature": 0.9, "seed": 42, "num_predict": 10}});
    let (_, a) = s.post("/api/chat", &seeded);
    let (_, b) = s.post("/api/chat", &seeded);
    assert_eq!(a["message"], b["message"]);
    assert_eq!(a["message"]["role"], "assistant");

    // Chat streams its thinking and content apart (GLM starts in a thought when thinking).
    let lines = s.stream(
        "/api/chat",
        &json!({"model": "glm", "messages": [{"role": "user", "content": "Hi"}], "options": greedy(6)}),
    );
    assert!(lines.iter().all(|l| l["message"]["role"] == "assistant"));
    assert_eq!(lines.last().unwrap()["done"], true);

    // Both loaded; show and ps describe them.
    let ps = s.get("/api/ps");
    assert_eq!(ps["models"].as_array().unwrap().len(), 2, "{ps}");
    assert!(ps["models"][0]["expires_at"].is_string());
    assert!(ps["models"][0]["context_length"].as_u64().unwrap() > 0);
    let (_, show) = s.post("/api/show", &json!({"model": "gem"}));
    assert!(show["template"].as_str().unwrap().contains("<|turn>"));
    assert!(show["capabilities"]
        .as_array()
        .unwrap()
        .contains(&json!("completion")));
    assert_eq!(show["details"]["quantization_level"], "F32");

    // Copy, then delete the copy; the original stays.
    assert_eq!(
        s.post(
            "/api/copy",
            &json!({"source": "gem", "destination": "gem2:v1"})
        )
        .0,
        200
    );
    let (_, g2) = s.post("/api/generate", &json!({"stream": false, "model": "gem2:v1", "prompt": "Hello there", "options": greedy(12), "think": false}));
    assert_eq!(g2["response"], one["response"]);
    assert_eq!(
        s.send(
            "DELETE",
            "/api/delete",
            &json!({"model": "gem2:v1"}).to_string()
        )
        .0,
        200
    );
    assert_eq!(
        s.send(
            "DELETE",
            "/api/delete",
            &json!({"model": "gem2:v1"}).to_string()
        )
        .0,
        404
    );
    assert_eq!(s.get("/api/tags")["models"].as_array().unwrap().len(), 2);

    // An empty prompt loads; keep_alive 0 unloads.
    let (_, load) = s.post("/api/generate", &json!({"model": "gem"}));
    assert_eq!(load["done_reason"], "load");
    let (_, unload) = s.post("/api/generate", &json!({"model": "gem", "keep_alive": 0}));
    assert_eq!(unload["done_reason"], "unload");
    let ps = s.get("/api/ps");
    assert_eq!(ps["models"].as_array().unwrap().len(), 1, "{ps}");
}

#[test]
fn bad_requests_get_ollama_and_openai_errors() {
    let s = Serve::start(&[]);
    let cases = [
        (json!({"model": "nope", "prompt": "x"}), 404, "not found"),
        (
            json!({"model": "../etc", "prompt": "x"}),
            400,
            "invalid model name",
        ),
        (json!({"prompt": "x"}), 400, "model is required"),
        (
            json!({"model": "gem", "prompt": "x", "options": {"top_k": "a"}}),
            400,
            "top_k",
        ),
        (
            json!({"model": "gem", "prompt": "x", "images": ["aGk="]}),
            400,
            "images",
        ),
        (
            json!({"model": "gem", "prompt": "x", "keep_alive": "soon"}),
            400,
            "keep_alive",
        ),
        (
            json!({"model": "gem", "prompt": "x", "think": "lots"}),
            400,
            "think",
        ),
        (json!({"model": "gem", "prompt": 3}), 400, "prompt"),
        (
            json!({"model": "gem", "prompt": "x", "format": {"type": "integer", "minimum": 5, "maximum": 1}}),
            400,
            "",
        ),
    ];
    for (body, code, needle) in cases {
        let (got, v) = s.post("/api/generate", &body);
        assert_eq!(got, code, "{body} -> {v}");
        let msg = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{body} -> {v}"));
        assert!(msg.contains(needle), "{body} -> {msg}");
    }
    let (code, v) = s.send("POST", "/api/chat", "{not json");
    assert_eq!(code, 400);
    assert!(v["error"].as_str().unwrap().contains("invalid JSON"));
    let (code, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(code, 404);
    assert_eq!(v["error"]["type"], "not_found_error");
    let (code, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "gem", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}]}]}),
    );
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // Still serving.
    let (code, _) = s.post(
        "/api/generate",
        &json!({"stream": false, "model": "gem", "prompt": "x", "options": greedy(2)}),
    );
    assert_eq!(code, 200);
}

#[test]
fn host_origin_and_size_checks() {
    let s = Serve::start(&[("MLX_RUNNER_ORIGINS", "https://ok.example")]);
    let status = |req: ureq::Request| match req.call() {
        Ok(r) => (
            r.status(),
            r.header("access-control-allow-origin").map(String::from),
        ),
        Err(ureq::Error::Status(c, r)) => {
            (c, r.header("access-control-allow-origin").map(String::from))
        }
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        status(ureq::get(&s.url("/api/tags")).set("Host", "evil.example")).0,
        403
    );
    assert_eq!(
        status(ureq::get(&s.url("/api/tags")).set("Host", "localhost:1")).0,
        200
    );
    assert_eq!(
        status(ureq::get(&s.url("/api/tags")).set("Origin", "https://evil.example")).0,
        403
    );
    assert_eq!(
        status(ureq::get(&s.url("/api/tags")).set("Origin", "https://ok.example")),
        (200, Some("https://ok.example".into()))
    );
    assert_eq!(
        status(
            ureq::request("OPTIONS", &s.url("/api/chat")).set("Origin", "http://localhost:3000")
        )
        .0,
        204
    );
    // A body announced past the limit is refused before it is read.
    let head = format!(
        "POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{",
        40 << 20
    );
    let answer =
        common::raw_http(s.port, head.as_bytes(), Duration::from_secs(5)).unwrap_or_default();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
}

#[test]
fn openai_chat_completions_and_models() {
    let s = Serve::start(&[]);
    let body = json!({"model": "gem", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                      "max_tokens": 8, "temperature": 0, "reasoning_effort": "none"});
    let (code, one) = s.post("/v1/chat/completions", &body);
    assert_eq!(code, 200, "{one}");
    assert_eq!(one["object"], "chat.completion");
    assert_eq!(one["choices"][0]["finish_reason"], "length");
    assert_eq!(one["usage"]["completion_tokens"], 8);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = ureq::post(&s.url("/v1/chat/completions"))
        .send_string(&streamed.to_string())
        .unwrap();
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let mut sse = String::new();
    r.into_reader().read_to_string(&mut sse).unwrap();
    let events: Vec<&str> = sse
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        content,
        one["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 8);

    // Legacy completions send the prompt as it is.
    let (code, c) = s.post(
        "/v1/completions",
        &json!({"model": "glm", "prompt": "Once", "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(code, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["usage"]["completion_tokens"], 5);

    // response_format: a schema the answer keeps to.
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false});
    let (code, j) = s.post(
        "/v1/chat/completions",
        &json!({"model": "gem", "messages": [{"role": "user", "content": "A number"}], "temperature": 0.7, "seed": 3,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}),
    );
    assert_eq!(code, 200, "{j}");
    let answer: Value =
        serde_json::from_str(j["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert!(answer["n"].as_i64().unwrap() <= 9, "{answer}");

    let models = s.get("/v1/models");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"].as_array().unwrap().len(), 2);
    assert_eq!(s.get("/v1/models/glm:latest")["id"], "glm:latest");
}

#[test]
fn runners_are_spawned_watched_and_stopped() {
    let mut s = Serve::start(&[
        ("MLX_RUNNER_MAX_LOADED_MODELS", "1"),
        ("MLX_RUNNER_KEEP_ALIVE", "5m"),
    ]);
    let gen = |s: &Serve, model: &str, n: i64| {
        s.post("/api/generate", &json!({"stream": false, "model": model, "prompt": "Hello", "options": greedy(n), "think": false}))
    };
    let (_, first) = gen(&s, "gem", 6);
    let before = s.runners();
    assert_eq!(before.len(), 1);

    // One model at a time: glm unloads gem (idle, least recently used).
    assert_eq!(gen(&s, "glm", 4).0, 200);
    let ps = s.get("/api/ps");
    assert_eq!(ps["models"].as_array().unwrap().len(), 1);
    assert_eq!(ps["models"][0]["name"], "glm:latest");
    assert_eq!(s.runners().len(), 1);

    // A runner killed mid-answer: the stream ends with an error, the next request gets a new
    // runner with the same answer.
    assert_eq!(gen(&s, "gem", 2).0, 200);
    let victim = s.runners()[0];
    let r = ureq::post(&s.url("/api/generate"))
        .send_string(
            &json!({"model": "gem", "prompt": "Hello", "options": greedy(4000), "think": false})
                .to_string(),
        )
        .unwrap();
    let mut lines = BufReader::new(r.into_reader()).lines();
    let _first_line = lines.next().unwrap().unwrap();
    // SAFETY: kill with a pid we just read from /proc.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let rest: Vec<Value> = lines
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    let last = rest.last().unwrap();
    assert!(last["error"].as_str().unwrap().contains("runner"), "{last}");
    let (code, again) = gen(&s, "gem", 6);
    assert_eq!(code, 200, "{again}");
    assert_eq!(again["response"], first["response"]);
    assert_ne!(s.runners(), vec![victim]);

    // A client that goes away mid-stream does not wedge anything.
    let r = ureq::post(&s.url("/api/chat"))
        .send_string(&json!({"model": "gem", "messages": [{"role": "user", "content": "Hi"}], "options": greedy(4000)}).to_string())
        .unwrap();
    let mut reader = BufReader::new(r.into_reader());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    drop(reader);
    assert_eq!(gen(&s, "gem", 6).1["response"], first["response"]);

    // serve stops its runners when it stops.
    let runners = s.runners();
    assert_eq!(runners.len(), 1);
    // SAFETY: as above.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let status = wait_timeout(&mut s.child, Duration::from_secs(20)).expect("serve did not stop");
    assert!(status.success());
    for p in runners {
        let alive =
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|st| !st.contains(") Z "));
        assert!(!alive, "runner {p} outlived serve");
    }
}

#[test]
fn idle_models_unload_after_keep_alive() {
    let s = Serve::start(&[]);
    let (code, _) = s.post(
        "/api/generate",
        &json!({"stream": false, "model": "gem", "prompt": "Hello", "options": greedy(2), "keep_alive": "1s"}),
    );
    assert_eq!(code, 200);
    assert_eq!(s.runners().len(), 1);
    let start = Instant::now();
    while !s.runners().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "model stayed loaded"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(start.elapsed() >= Duration::from_millis(500));
    // The process is gone; serve forgets it once its reaper has read its last words.
    let gone = Instant::now();
    while !s.get("/api/ps")["models"].as_array().unwrap().is_empty() {
        assert!(
            gone.elapsed() < Duration::from_secs(5),
            "ps still lists the model"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // keep_alive 0, request after request: each one finds a runner (a stopping one is never
    // handed out).
    for i in 0..6 {
        let (code, v) = s.post(
            "/api/generate",
            &json!({"stream": false, "model": "gem", "prompt": format!("n{i}"), "options": greedy(2), "keep_alive": 0}),
        );
        assert_eq!(code, 200, "request {i}: {v}");
    }
    // An unload asked for while the model is busy happens when it becomes idle.
    let r = ureq::post(&s.url("/api/generate"))
        .send_string(
            &json!({"model": "gem", "prompt": "Hello", "options": greedy(40), "keep_alive": "1h"})
                .to_string(),
        )
        .unwrap();
    let (_, unload) = s.post("/api/generate", &json!({"model": "gem", "keep_alive": 0}));
    assert_eq!(unload["done_reason"], "unload");
    let mut body = String::new();
    r.into_reader().read_to_string(&mut body).unwrap();
    assert!(body.contains("\"done\":true"), "{body}");
    let start = Instant::now();
    while !s.runners().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "busy model not unloaded after its request"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Negative keep_alive: kept.
    s.post("/api/generate", &json!({"model": "gem", "keep_alive": -1}));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(s.runners().len(), 1);
}

#[test]
fn concurrent_clients_get_what_they_get_alone() {
    let s = Serve::start(&[]);
    let prompts = [
        "One",
        "Two words",
        "Three more words",
        "Four words here now",
    ];
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| {
            s.post("/api/generate", &json!({"stream": false, "model": "gem", "prompt": p, "options": greedy(16), "think": false}))
                .1["response"]
                .clone()
        })
        .collect();
    let url = s.url("/api/generate");
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (url, p) = (url.clone(), p.to_string());
            std::thread::spawn(move || {
                let r: Value = serde_json::from_str(
                    &ureq::post(&url)
                        .send_string(&json!({"stream": false, "model": "gem", "prompt": p, "options": greedy(16), "think": false}).to_string())
                        .unwrap()
                        .into_string()
                        .unwrap(),
                )
                .unwrap();
                r["response"].clone()
            })
        })
        .collect();
    let together: Vec<Value> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(together, alone);
}

#[test]
fn required_tool_calls_round_trip() {
    let s = Serve::start(&[]);
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "required": ["city"], "properties": {
                "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}}}}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
    ]);
    // The fixture's context (512 tokens of a byte-level vocabulary) does not hold GLM's long
    // tool preamble: a Modelfile TEMPLATE lists the tools briefly (the family still decides how
    // calls are written and read).
    s.create(
        "glmt",
        &format!(
            "FROM {}\nTEMPLATE \"\"\"{{% for t in tools or [] %}}{{{{ t.function.name }}}} {{% endfor %}}{{% for m in messages %}}<|{{{{ m.role }}}}|>{{{{ m.content }}}}{{% endfor %}}<|assistant|></think>\"\"\"\n",
            fixture("glm4_moe_lite").display()
        ),
    );
    for model in ["gem", "glmt"] {
        for seed in 0..4 {
            let messages = json!([{"role": "user", "content": "Weather in Paris?"}]);
            let (code, r) = s.post(
                "/v1/chat/completions",
                &json!({"model": model, "messages": messages, "tools": tools, "seed": seed, "temperature": 1.0,
                        "max_tokens": 200, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
            );
            assert_eq!(code, 200, "{r}");
            let choice = &r["choices"][0];
            assert_eq!(choice["finish_reason"], "tool_calls", "{model} {r}");
            let call = &choice["message"]["tool_calls"][0];
            assert_eq!(call["type"], "function");
            assert_eq!(call["function"]["name"], "get_weather");
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(args["city"].is_string(), "{model} {args}");
            if let Some(d) = args.get("days") {
                assert!(d.is_i64(), "{model} {args}");
            }
            if let Some(u) = args.get("unit") {
                assert!(u == "c" || u == "f", "{model} {args}");
            }
            // The result goes back; the model answers in text.
            let (code, answer) = s.post(
                "/v1/chat/completions",
                &json!({"model": model, "tools": tools, "max_tokens": 6, "temperature": 0, "messages": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": null, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "{\"temp\": 21}"}]}),
            );
            assert_eq!(code, 200, "{answer}");
            assert!(answer["choices"][0]["message"]["content"].is_string());
        }
        // "required" with any of the tools.
        let (code, r) = s.post(
            "/v1/chat/completions",
            &json!({"model": model, "messages": [{"role": "user", "content": "Do something"}], "tools": tools,
                    "tool_choice": "required", "max_tokens": 200, "seed": 9, "temperature": 1.0}),
        );
        assert_eq!(code, 200, "{r}");
        let name = r["choices"][0]["message"]["tool_calls"][0]["function"]["name"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(name == "get_weather" || name == "noop", "{r}");
    }
    let (code, r) = s.post(
        "/v1/chat/completions",
        &json!({"model": "gem", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
    );
    assert_eq!(code, 400, "{r}");
}
