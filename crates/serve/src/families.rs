//! The pieces of gemma4's and GLM's prompt formats that Jinja cannot write simply: gemma4's
//! tool declarations and argument syntax (`<|"|>` strings, bare sorted keys), GLM's tool JSON
//! (Go's field order and escaping, a space after every `:` and `,`).

use serde_json::{Map, Value};

const Q: &str = "<|\"|>";

/// A value in gemma4's argument syntax: `{k:v,...}` with sorted bare keys, strings between
/// `<|"|>`, whole numbers without a fraction.
pub fn gemma4_value(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{Q}{s}{Q}"),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
            _ => n.to_string(),
        },
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(gemma4_value).collect::<Vec<_>>().join(",")
        ),
        Value::Object(m) => {
            let mut keys: Vec<_> = m.keys().collect();
            keys.sort();
            format!(
                "{{{}}}",
                keys.iter()
                    .map(|k| format!("{k}:{}", gemma4_value(&m[*k])))
                    .collect::<Vec<_>>()
                    .join(",")
            )
        }
        other => other.to_string(),
    }
}

fn upper_type(t: &Value) -> String {
    match t {
        Value::String(s) => s.to_uppercase(),
        Value::Array(items) => format!(
            "[{}]",
            items
                .iter()
                .map(|i| format!("'{}'", i.as_str().unwrap_or_default().to_uppercase()))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => String::new(),
    }
}

fn quoted_list(v: &Value) -> String {
    format!(
        "[{}]",
        v.as_array()
            .into_iter()
            .flatten()
            .map(|i| match i {
                Value::String(s) => format!("{Q}{s}{Q}"),
                other => gemma4_value(other),
            })
            .collect::<Vec<_>>()
            .join(",")
    )
}

fn properties(props: &Map<String, Value>) -> String {
    let mut keys: Vec<_> = props.keys().collect();
    keys.sort();
    keys.iter()
        .map(|k| format!("{k}:{{{}}}", property(&props[*k])))
        .collect::<Vec<_>>()
        .join(",")
}

fn property(p: &Value) -> String {
    let mut fields = Vec::new();
    if let Some(d) = p["description"].as_str().filter(|d| !d.is_empty()) {
        fields.push(format!("description:{Q}{d}{Q}"));
    }
    let ty = match (&p["type"], p["anyOf"].as_array()) {
        (Value::Null, Some(any)) => Value::Array(any.iter().map(|b| b["type"].clone()).collect()),
        (t, _) => t.clone(),
    };
    match upper_type(&ty).as_str() {
        "STRING" if p["enum"].is_array() => {
            fields.push(format!("enum:{}", quoted_list(&p["enum"])))
        }
        "ARRAY" => {
            if let Some(items) = p["items"].as_object().filter(|i| !i.is_empty()) {
                let mut keys: Vec<_> = items.keys().collect();
                keys.sort();
                let inner: Vec<String> = keys
                    .iter()
                    .filter(|k| !items[**k].is_null())
                    .map(|k| match k.as_str() {
                        "properties" => format!(
                            "properties:{{{}}}",
                            items[*k].as_object().map(properties).unwrap_or_default()
                        ),
                        "required" => format!("required:{}", quoted_list(&items[*k])),
                        "type" => format!("type:{Q}{}{Q}", upper_type(&items[*k])),
                        _ => format!("{k}:{}", gemma4_value(&items[*k])),
                    })
                    .collect();
                fields.push(format!("items:{{{}}}", inner.join(",")));
            }
        }
        "OBJECT" => {
            fields.push(format!(
                "properties:{{{}}}",
                p["properties"]
                    .as_object()
                    .map(properties)
                    .unwrap_or_default()
            ));
            if p["required"].as_array().is_some_and(|r| !r.is_empty()) {
                fields.push(format!("required:{}", quoted_list(&p["required"])));
            }
        }
        _ => {}
    }
    if p["nullable"] == Value::Bool(true) {
        fields.push("nullable:true".into());
    }
    if !ty.is_null() {
        fields.push(format!("type:{Q}{}{Q}", upper_type(&ty)));
    }
    fields.join(",")
}

/// `<|tool>declaration:NAME{description:…,parameters:{…}}<tool|>`.
pub fn gemma4_declaration(tool: &Value) -> String {
    let f = &tool["function"];
    let mut fields = Vec::new();
    if let Some(d) = f["description"].as_str() {
        fields.push(format!("description:{Q}{d}{Q}"));
    }
    let params = &f["parameters"];
    if params.is_object() && !(params["properties"].is_null() && params["type"].is_null()) {
        let mut inner = Vec::new();
        if let Some(props) = params["properties"].as_object() {
            inner.push(format!("properties:{{{}}}", properties(props)));
        }
        if params["required"].as_array().is_some_and(|r| !r.is_empty()) {
            inner.push(format!("required:{}", quoted_list(&params["required"])));
        }
        if !params["type"].is_null() {
            inner.push(format!("type:{Q}{}{Q}", upper_type(&params["type"])));
        }
        fields.push(format!("parameters:{{{}}}", inner.join(",")));
    }
    format!(
        "<|tool>declaration:{}{{{}}}<tool|>",
        f["name"].as_str().unwrap_or_default(),
        fields.join(",")
    )
}

/// An assistant's earlier text without its thoughts (`<|channel>…<channel|>`), trimmed.
pub fn gemma4_strip_thinking(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("<|channel>") {
        out.push_str(&rest[..i]);
        rest = match rest[i..].find("<channel|>") {
            Some(j) => &rest[i + j + "<channel|>".len()..],
            None => "",
        };
    }
    out.push_str(rest);
    out.trim().to_string()
}

/// Go's `json.Marshal`: compact, `<`, `>` and `&` escaped.
pub fn go_json(v: &Value) -> String {
    serde_json::to_string(v)
        .unwrap_or_default()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
}

/// Keys of `v` in `order`, those present; other keys dropped (Go's struct fields).
/// A field and how its value is written.
type Field<'a> = (&'a str, fn(&Value) -> Value);

fn ordered(v: &Value, order: &[Field]) -> Value {
    let mut m = Map::new();
    for (k, f) in order {
        if let Some(x) = v.get(*k).filter(|x| !x.is_null()) {
            m.insert(k.to_string(), f(x));
        }
    }
    Value::Object(m)
}

fn same(v: &Value) -> Value {
    v.clone()
}

fn go_property(p: &Value) -> Value {
    ordered(
        p,
        &[
            ("anyOf", |v| {
                Value::Array(
                    v.as_array()
                        .into_iter()
                        .flatten()
                        .map(go_property)
                        .collect(),
                )
            }),
            ("type", same),
            ("items", same),
            ("description", same),
            ("enum", same),
            ("properties", go_properties),
            ("required", same),
        ],
    )
}

fn go_properties(v: &Value) -> Value {
    Value::Object(
        v.as_object()
            .into_iter()
            .flatten()
            .map(|(k, p)| (k.clone(), go_property(p)))
            .collect(),
    )
}

/// A tool as GLM's template lists it: Go's `json.Marshal(api.Tool)` with a space after every
/// `:` and `,` outside strings.
pub fn glm_tool_json(tool: &Value) -> String {
    let params = &tool["function"]["parameters"];
    let mut p = ordered(
        params,
        &[
            ("type", same),
            ("$defs", same),
            ("items", same),
            ("required", same),
        ],
    );
    p.as_object_mut().expect("an object").insert(
        "properties".into(),
        params
            .get("properties")
            .map(go_properties)
            .unwrap_or(Value::Null),
    );
    let mut f = ordered(&tool["function"], &[("name", same), ("description", same)]);
    let fm = f.as_object_mut().expect("an object");
    fm.entry("name").or_insert(Value::from(""));
    fm.insert("parameters".into(), p);
    let mut t = Map::new();
    t.insert(
        "type".into(),
        tool.get("type").cloned().unwrap_or(Value::from("function")),
    );
    if let Some(items) = tool.get("items").filter(|i| !i.is_null()) {
        t.insert("items".into(), items.clone());
    }
    t.insert("function".into(), f);
    spaced(&go_json(&Value::Object(t)))
}

fn spaced(json: &str) -> String {
    let mut out = String::with_capacity(json.len() + json.len() / 8);
    let (mut in_str, mut escaped) = (false, false);
    for c in json.chars() {
        out.push(c);
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_str = false,
                _ => {}
            }
        } else if c == '"' {
            in_str = true;
        } else if c == ':' || c == ',' {
            out.push(' ');
        }
    }
    out
}
