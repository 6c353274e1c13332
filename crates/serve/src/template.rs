//! Prompts from chat messages: a Jinja chat template (the Modelfile's TEMPLATE, the model's own
//! `chat_template`, or our template for its family) rendered by minijinja with Python's string
//! and dict methods, as transformers renders it.

use crate::families;
use minijinja::{Environment, Error, ErrorKind, Value as JValue};
use serde::Serialize;

/// What a template is rendered with (the names transformers passes).
#[derive(Debug, Clone, Serialize)]
pub struct Context<'a> {
    pub messages: &'a [serde_json::Value],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<&'a [serde_json::Value]>,
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
    /// `think` as templates read it; absent when the request did not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_thinking: Option<bool>,
}

/// Our templates for the families we serve, used when a checkpoint ships none.
pub fn builtin(family: &str) -> Option<&'static str> {
    match family {
        "gemma4" => Some(include_str!("templates/gemma4.jinja")),
        "glm-4.7" => Some(include_str!("templates/glm4_moe_lite.jinja")),
        _ => None,
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // Chat templates are written for Python's Jinja: keep the template's own whitespace.
    env.set_keep_trailing_newline(true);
    env.add_function("raise_exception", |msg: String| -> Result<JValue, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_filter("gemma4_declaration", |t: JValue| -> Result<String, Error> {
        Ok(families::gemma4_declaration(&to_json(&t)?))
    });
    env.add_filter("gemma4_value", |v: JValue| -> Result<String, Error> {
        Ok(families::gemma4_value(&to_json(&v)?))
    });
    env.add_filter("gemma4_strip_thinking", |s: String| -> String {
        families::gemma4_strip_thinking(&s)
    });
    env.add_filter("glm_tool_json", |t: JValue| -> Result<String, Error> {
        Ok(families::glm_tool_json(&to_json(&t)?))
    });
    env.add_filter("json_compact", |v: JValue| -> Result<String, Error> {
        Ok(families::go_json(&to_json(&v)?))
    });
    env.add_function("strftime_now", |fmt: String| -> String {
        chrono::Local::now().format(&fmt).to_string()
    });
    // transformers' `tojson` keeps non-ASCII text and key order, and takes `indent`.
    env.add_filter(
        "tojson",
        |v: JValue, kwargs: minijinja::value::Kwargs| -> Result<String, Error> {
            let indent: Option<usize> = kwargs.get("indent")?;
            let _: Option<bool> = kwargs.get("ensure_ascii")?;
            let _: Option<JValue> = kwargs.get("separators")?;
            kwargs.assert_all_used()?;
            let json = serde_json::to_value(&v)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            let s = match indent {
                Some(n) => {
                    let pad = vec![b' '; n];
                    let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
                    let mut out = Vec::new();
                    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
                    json.serialize(&mut ser)
                        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
                    String::from_utf8(out).unwrap_or_default()
                }
                None => python_json(&json),
            };
            Ok(s)
        },
    );
    env
}

fn to_json(v: &JValue) -> Result<serde_json::Value, Error> {
    serde_json::to_value(v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// `json.dumps` with its default separators (`", "` and `": "`), which templates' tool
/// definitions are written with.
pub fn python_json(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(python_json).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, v)| format!("{}: {}", Value::from(k.as_str()), python_json(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

/// Renders `source` with `ctx`; the error names the template's problem, for a 400/500.
pub fn render(source: &str, ctx: &Context) -> Result<String, String> {
    let env = environment();
    let tmpl = env
        .template_from_str(source)
        .map_err(|e| format!("the chat template does not parse: {e:#}"))?;
    tmpl.render(ctx)
        .map_err(|e| format!("the chat template failed: {e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx<'a>(messages: &'a [serde_json::Value]) -> Context<'a> {
        Context {
            messages,
            tools: None,
            add_generation_prompt: true,
            bos_token: "<s>",
            eos_token: "</s>",
            enable_thinking: None,
        }
    }

    /// The constructs Hugging Face templates lean on: Python string and dict methods,
    /// namespaces, `raise_exception`, `tojson`.
    #[test]
    fn python_flavoured_templates_render() {
        let t = r#"{{ bos_token }}{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role ' + m.role) }}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
<{{ m.role | upper }}>{{ m.content.strip() }}{% if m.content.startswith('x') %}!{% endif %}
{%- if m.args %}{% for k, v in m.args.items() %} {{ k }}={{ v | tojson }}{% endfor %}{% endif %}
{% endfor -%}
{{ ns.n }}{% if add_generation_prompt %}<ASSISTANT>{% endif %}"#;
        let msgs = [
            json!({"role": "user", "content": "  xhello "}),
            json!({"role": "assistant", "content": "hi", "args": {"b": "é", "a": [1, 2]}}),
        ];
        let out = render(t, &ctx(&msgs)).unwrap();
        assert_eq!(
            out,
            "<s><USER>xhello\n<ASSISTANT>hi b=\"é\" a=[1, 2]\n2<ASSISTANT>"
        );
        let bad = [json!({"role": "robot", "content": "x"})];
        let e = render(t, &ctx(&bad)).unwrap_err();
        assert!(e.contains("bad role robot"), "{e}");
    }
}
