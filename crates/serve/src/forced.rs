//! OpenAI's `tool_choice: "required"` (or a named function): the answer must be a tool call, so
//! the runner is given a grammar (its Lark `Format`) that admits exactly the family's call
//! syntax, with each argument typed by the tool's schema. The call is then parsed back as any
//! other would be.

use serde_json::Value;

/// Which calls a request forces.
#[derive(Debug, Clone, PartialEq)]
pub enum Forced {
    Any,
    Named(String),
}

/// Marks the family writes its calls with, as grammar items: a special token by id when the
/// tokenizer has the mark as one token (a real checkpoint), else the literal text.
pub struct Marks<'a> {
    pub special: &'a dyn Fn(&str) -> Option<u32>,
}

impl Marks<'_> {
    fn item(&self, text: &str) -> String {
        match (self.special)(text) {
            Some(id) => format!("<[{id}]>"),
            None => lit(text),
        }
    }
}

fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}

/// An integer argument: an i64 as JSON writes it (no `-0`, which JSON readers take for a float).
const INTEGER: &str = "/(0|-?[1-9][0-9]{0,17})/";

/// A number argument: JSON's syntax, within what an f64 holds (at most 15 digits before the
/// point and after it, a two-digit exponent).
const NUMBER: &str = "/-?(0|[1-9][0-9]{0,14})(\\.[0-9]{1,15})?([eE][-+]?[0-9]{1,2})?/";

/// The largest integer every parser reads back exactly (JSON readers that go through f64
/// included): 2^53 - 1.
const SAFE_INTEGER: i64 = (1 << 53) - 1;

fn has_bounds(schema: &Value) -> bool {
    ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]
        .iter()
        .any(|k| schema.get(*k).is_some())
}

/// A schema whose values the call parsers read back as the types it declares: objects that
/// list their properties have only those (as a `format` does), and numbers have bounds, so
/// llguidance's JSON never writes one an f64 or i64 cannot hold (`1e999`, forty digits).
fn readable(schema: &Value) -> Value {
    let mut s = schema.clone();
    ::grammar::closed_objects(&mut s);
    bound_numbers(&mut s);
    s
}

fn bound_numbers(v: &mut Value) {
    match v {
        Value::Object(o) => {
            let ty = |t: &str| match o.get("type") {
                Some(Value::String(s)) => s == t,
                Some(Value::Array(a)) => a.iter().any(|x| x == t),
                _ => false,
            };
            let bounds = if ty("integer") {
                Some((Value::from(-SAFE_INTEGER), Value::from(SAFE_INTEGER)))
            } else if ty("number") {
                Some((Value::from(-1e15), Value::from(1e15)))
            } else {
                None
            };
            if let Some((min, max)) = bounds {
                if !o.contains_key("maximum") && !o.contains_key("exclusiveMaximum") {
                    o.insert("maximum".into(), max);
                }
                if !o.contains_key("minimum") && !o.contains_key("exclusiveMinimum") {
                    o.insert("minimum".into(), min);
                }
            }
            o.values_mut().for_each(bound_numbers);
        }
        Value::Array(a) => a.iter_mut().for_each(bound_numbers),
        _ => {}
    }
}

/// A value's grammar by its schema, delimited so it cannot run into the closing mark.
fn value(schema: &Value, string: &dyn Fn(&str) -> String) -> String {
    if let Some(options) = schema["enum"].as_array() {
        let alts: Vec<String> = options
            .iter()
            .map(|o| match o {
                Value::String(s) => string(&lit(s)),
                other => lit(&other.to_string()),
            })
            .collect();
        if !alts.is_empty() {
            return format!("({})", alts.join(" | "));
        }
    }
    let ty = match &schema["type"] {
        Value::String(t) => t.as_str(),
        Value::Array(ts) => ts.iter().find_map(Value::as_str).unwrap_or("string"),
        _ => "string",
    };
    match ty {
        // JSON's own syntax (no leading zeros), and sizes the parsers read back exactly: an
        // i64, a finite f64. A bounded schema goes through llguidance's JSON, which keeps to
        // its minimum and maximum.
        "integer" | "number" if has_bounds(schema) => format!("%json {}", readable(schema)),
        "integer" => INTEGER.into(),
        "number" => NUMBER.into(),
        "boolean" => "(\"true\" | \"false\")".into(),
        "null" => "\"null\"".into(),
        "array" | "object" => format!("%json {}", readable(schema)),
        // Any text without `<` (which would start the closing mark), newlines included, as
        // long as the schema allows.
        _ => {
            let min = schema["minLength"].as_u64().unwrap_or(0);
            match schema["maxLength"].as_u64() {
                Some(max) => string(&format!("/[^<]{{{min},{}}}/", max.max(min))),
                None if min > 0 => string(&format!("/[^<]{{{min},}}/")),
                None => string("/[^<]*/"),
            }
        }
    }
}

fn tools_of<'a>(tools: &'a [Value], forced: &Forced) -> Result<Vec<&'a Value>, String> {
    let chosen: Vec<&Value> = tools
        .iter()
        .map(|t| &t["function"])
        .filter(|f| match forced {
            Forced::Any => true,
            Forced::Named(n) => f["name"] == n.as_str(),
        })
        .filter(|f| f["name"].is_string())
        .collect();
    if chosen.is_empty() {
        return Err(match forced {
            Forced::Any => "tool_choice requires a tool call but no tools were given".into(),
            Forced::Named(n) => format!("tool_choice names {n:?}, which is not among the tools"),
        });
    }
    Ok(chosen)
}

/// The arguments of `f` in order, each `(name, schema, required)`.
fn arguments(f: &Value) -> Vec<(String, Value, bool)> {
    let required: Vec<&str> = f["parameters"]["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    f["parameters"]["properties"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone(), required.contains(&k.as_str())))
        .collect()
}

/// The grammar for one forced call in `family`'s syntax.
pub fn grammar(
    family: &str,
    tools: &[Value],
    forced: &Forced,
    marks: &Marks,
) -> Result<String, String> {
    let chosen = tools_of(tools, forced)?;
    let mut rules = Vec::new();
    let mut calls = Vec::new();
    for (i, f) in chosen.iter().enumerate() {
        let name = f["name"].as_str().unwrap_or_default();
        let mut args = arguments(f);
        let body = match family {
            "glm-4.7" => {
                let parts: Vec<String> = args
                    .iter()
                    .map(|(k, schema, required)| {
                        let item = format!(
                            "\"<arg_key>\" {} \"</arg_key><arg_value>\" {} \"</arg_value>\"",
                            lit(k),
                            value(schema, &|s| s.to_string())
                        );
                        if *required {
                            item
                        } else {
                            format!("({item})?")
                        }
                    })
                    .collect();
                format!("{} {} {}", lit(name), parts.join(" "), "")
            }
            "gemma4" => {
                // Required arguments first, then any subset of the optional ones, each group
                // in key order; strings between <|"|>.
                args.sort_by(|a, b| (!a.2, &a.0).cmp(&(!b.2, &b.0)));
                let q = marks.item("<|\"|>");
                let string = |s: &str| format!("{q} {s} {q}");
                let item = |(k, schema, _): &(String, Value, bool)| {
                    format!("{} \":\" {}", lit(k), value(schema, &string))
                };
                let (required, optional): (Vec<_>, Vec<_>) = args.iter().partition(|a| a.2);
                // opt{i}_{k}: a comma-separated subsequence of optional[k..], not empty.
                for k in (0..optional.len()).rev() {
                    let rest = if k + 1 < optional.len() {
                        format!(" (\",\" opt{i}_{})? | opt{i}_{}", k + 1, k + 1)
                    } else {
                        String::new()
                    };
                    rules.push(format!("opt{i}_{k}: {}{rest}", item(optional[k])));
                }
                let mut body: Vec<String> = Vec::new();
                for (j, r) in required.iter().enumerate() {
                    if j > 0 {
                        body.push("\",\"".into());
                    }
                    body.push(item(r));
                }
                if !optional.is_empty() {
                    body.push(if required.is_empty() {
                        format!("(opt{i}_0)?")
                    } else {
                        format!("(\",\" opt{i}_0)?")
                    });
                }
                format!("\"call:\" {} \"{{\" {} \"}}\"", lit(name), body.join(" "))
            }
            other => {
                return Err(format!(
                    "forcing a tool call is not supported for this model's family ({other:?})"
                ))
            }
        };
        rules.push(format!("call{i}: {body}"));
        calls.push(format!("call{i}"));
    }
    let (open, close) = match family {
        "gemma4" => (marks.item("<|tool_call>"), marks.item("<tool_call|>")),
        _ => (marks.item("<tool_call>"), marks.item("</tool_call>")),
    };
    Ok(format!(
        "start: {open} ({}) {close}\n{}\n",
        calls.join(" | "),
        rules.join("\n")
    ))
}

/// `tool_choice` as OpenAI sends it: `"auto"`, `"none"`, `"required"`, or
/// `{"type": "function", "function": {"name": ...}}`.
pub fn from_tool_choice(v: &Value) -> Result<Option<Forced>, String> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => match s.as_str() {
            "auto" | "none" => Ok(None),
            "required" => Ok(Some(Forced::Any)),
            other => Err(format!("unknown tool_choice {other:?}")),
        },
        Value::Object(_) => v["function"]["name"]
            .as_str()
            .map(|n| Some(Forced::Named(n.to_string())))
            .ok_or_else(|| "tool_choice must name a function".to_string()),
        other => Err(format!("invalid tool_choice {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
                "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["city"]}}})
    }

    #[test]
    fn grammars_spell_each_family() {
        let none = |_: &str| None;
        let marks = Marks { special: &none };
        let g = grammar("glm-4.7", &[tool()], &Forced::Any, &marks).unwrap();
        assert!(
            g.starts_with("start: \"<tool_call>\" (call0) \"</tool_call>\""),
            "{g}"
        );
        assert!(
            g.contains("\"city\" \"</arg_key><arg_value>\" /[^<]*/"),
            "{g}"
        );
        assert!(g.contains("(\"<arg_key>\" \"days\""), "{g}");
        let ids = |t: &str| (t == "<|tool_call>").then_some(48);
        let g = grammar(
            "gemma4",
            &[tool()],
            &Forced::Named("get_weather".into()),
            &Marks { special: &ids },
        )
        .unwrap();
        assert!(
            g.starts_with("start: <[48]> (call0) \"<tool_call|>\""),
            "{g}"
        );
        assert!(g.contains("\"unit\" \":\" (\"<|\\\"|>\" \"c\" \"<|\\\"|>\" | \"<|\\\"|>\" \"f\" \"<|\\\"|>\")"), "{g}");
        assert!(
            g.contains("\"call:\" \"get_weather\" \"{\" \"city\" \":\""),
            "{g}"
        );
        assert!(
            g.contains("opt0_0: \"days\" \":\" /(0|-?[1-9][0-9]{0,17})/ (\",\" opt0_1)? | opt0_1"),
            "{g}"
        );
        assert!(g.contains("%json {\"type\":\"array\""), "{g}");
        assert!(grammar("gemma4", &[tool()], &Forced::Named("nope".into()), &marks).is_err());
        assert!(grammar("", &[tool()], &Forced::Any, &marks).is_err());
    }
}
