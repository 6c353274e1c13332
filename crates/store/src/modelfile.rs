//! The Modelfile: what `create` builds a named model from.
//!
//! ```text
//! # comments start with '#'
//! FROM ./gemma-4-E2B-it            # a checkpoint directory (relative to this file) or a model name
//! DRAFT ./gemma-4-E2B-it-assistant # optional: the drafter for speculative decoding
//! PARAMETER temperature 0.7
//! PARAMETER stop "<turn|>"
//! SYSTEM """You are terse.
//! Answer in one line."""
//! MESSAGE user "Hi"
//! LICENSE "Apache-2.0"
//! ```
//!
//! Commands are case-insensitive. A value is the rest of the line, a `"quoted string"` (with
//! `\"` and `\\` escapes) or a `"""` string that may span lines. Every error names its line.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// A Modelfile error: the 1-based line and what was expected there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

fn err<T>(line: usize, message: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError {
        line,
        message: message.into(),
    })
}

/// A value and the line it came from (for errors found after parsing, such as a missing path).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Located {
    pub value: String,
    pub line: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Modelfile {
    pub from: Option<Located>,
    pub draft: Option<Located>,
    /// Typed values by name; `stop` is a list.
    pub parameters: BTreeMap<String, Value>,
    pub template: Option<String>,
    pub system: Option<String>,
    pub messages: Vec<Message>,
    pub license: Vec<String>,
}

#[derive(Clone, Copy)]
enum Kind {
    Int { min: i64 },
    Float { min: f64, max: f64 },
    Text,
}

/// The parameters the runner understands, with their types and ranges.
const PARAMETERS: &[(&str, Kind)] = &[
    ("num_ctx", Kind::Int { min: 1 }),
    ("num_predict", Kind::Int { min: -2 }),
    ("num_keep", Kind::Int { min: -1 }),
    (
        "temperature",
        Kind::Float {
            min: 0.0,
            max: f64::MAX,
        },
    ),
    ("top_k", Kind::Int { min: 0 }),
    ("top_p", Kind::Float { min: 0.0, max: 1.0 }),
    ("min_p", Kind::Float { min: 0.0, max: 1.0 }),
    (
        "repeat_penalty",
        Kind::Float {
            min: 0.0,
            max: f64::MAX,
        },
    ),
    ("repeat_last_n", Kind::Int { min: -1 }),
    (
        "presence_penalty",
        Kind::Float {
            min: f64::MIN,
            max: f64::MAX,
        },
    ),
    (
        "frequency_penalty",
        Kind::Float {
            min: f64::MIN,
            max: f64::MAX,
        },
    ),
    ("seed", Kind::Int { min: i64::MIN }),
    ("stop", Kind::Text),
];

/// A PARAMETER given as JSON (`/api/create`'s `parameters`), typed and checked as the
/// Modelfile's are; `stop` takes a string or a list of them.
pub fn parameter(key: &str, v: &Value) -> Result<Value, String> {
    let key = key.to_ascii_lowercase();
    let one = |v: &Value| -> Result<Value, String> {
        let raw = match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            other => return Err(format!("parameter {key} cannot be {other}")),
        };
        typed(0, &key, &raw).map_err(|e| e.message)
    };
    match (key.as_str(), v) {
        ("stop", Value::Array(items)) => items
            .iter()
            .map(one)
            .collect::<Result<_, _>>()
            .map(Value::Array),
        ("stop", v) => Ok(Value::Array(vec![one(v)?])),
        (_, v) => one(v),
    }
}

const COMMANDS: &str = "FROM, DRAFT, PARAMETER, TEMPLATE, SYSTEM, MESSAGE or LICENSE";

fn typed(line: usize, key: &str, raw: &str) -> Result<Value, ParseError> {
    let Some((_, kind)) = PARAMETERS.iter().find(|(k, _)| *k == key) else {
        let known: Vec<&str> = PARAMETERS.iter().map(|(k, _)| *k).collect();
        return err(
            line,
            format!("unknown parameter {key:?} (known: {})", known.join(", ")),
        );
    };
    match *kind {
        Kind::Int { min } => match raw.parse::<i64>() {
            Ok(v) if v >= min => Ok(Value::from(v)),
            Ok(v) => err(
                line,
                format!("parameter {key} must be at least {min}, got {v}"),
            ),
            Err(_) => err(
                line,
                format!("parameter {key} expects an integer, got {raw:?}"),
            ),
        },
        Kind::Float { min, max } => match raw.parse::<f64>() {
            Ok(v) if v.is_finite() && v >= min && v <= max => Ok(Value::from(v)),
            Ok(v) if max == f64::MAX => err(
                line,
                format!("parameter {key} must be at least {min}, got {v}"),
            ),
            Ok(v) => err(
                line,
                format!("parameter {key} must be between {min} and {max}, got {v}"),
            ),
            Err(_) => err(
                line,
                format!("parameter {key} expects a number, got {raw:?}"),
            ),
        },
        Kind::Text => Ok(Value::from(raw)),
    }
}

/// Lines of the file with their numbers, consumed by the parser (multi-line strings take
/// several).
struct Lines<'a> {
    lines: Vec<&'a str>,
    next: usize,
}

impl<'a> Lines<'a> {
    fn next_line(&mut self) -> Option<(usize, &'a str)> {
        let l = self.lines.get(self.next)?;
        self.next += 1;
        Some((self.next, l))
    }
}

/// Splits off the first whitespace-delimited word.
fn word(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    match s.find(char::is_whitespace) {
        Some(i) => (&s[..i], s[i..].trim_start()),
        None => (s, ""),
    }
}

fn only_space_after(line: usize, rest: &str, what: &str) -> Result<(), ParseError> {
    let rest = rest.trim();
    if rest.is_empty() || rest.starts_with('#') {
        Ok(())
    } else {
        err(line, format!("unexpected {rest:?} after the {what}"))
    }
}

/// The value starting at `text` (already past the command and its arguments).
fn value(line: usize, text: &str, lines: &mut Lines, what: &str) -> Result<String, ParseError> {
    let text = text.trim();
    if let Some(body) = text.strip_prefix("\"\"\"") {
        if let Some(end) = body.find("\"\"\"") {
            only_space_after(line, &body[end + 3..], "closing \"\"\"")?;
            return Ok(body[..end].to_string());
        }
        let mut out = body.to_string();
        while let Some((n, l)) = lines.next_line() {
            out.push('\n');
            if let Some(end) = l.find("\"\"\"") {
                only_space_after(n, &l[end + 3..], "closing \"\"\"")?;
                out.push_str(&l[..end]);
                return Ok(out);
            }
            out.push_str(l);
        }
        return err(line, format!("the \"\"\" string of {what} is never closed"));
    }
    if let Some(body) = text.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = body.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, e @ ('"' | '\\'))) => out.push(e),
                    Some((_, 'n')) => out.push('\n'),
                    Some((_, 't')) => out.push('\t'),
                    Some((_, other)) => {
                        out.push('\\');
                        out.push(other);
                    }
                    None => break,
                },
                '"' => {
                    only_space_after(line, &body[i + 1..], "closing quote")?;
                    return Ok(out);
                }
                _ => out.push(c),
            }
        }
        return err(line, format!("the quoted value of {what} is never closed"));
    }
    if text.is_empty() {
        return err(line, format!("{what} needs a value"));
    }
    Ok(text.to_string())
}

impl std::str::FromStr for Modelfile {
    type Err = ParseError;

    fn from_str(text: &str) -> Result<Modelfile, ParseError> {
        let mut m = Modelfile::default();
        let mut lines = Lines {
            lines: text.lines().collect(),
            next: 0,
        };
        while let Some((n, l)) = lines.next_line() {
            let t = l.trim();
            if t.is_empty() || t.starts_with('#') {
                continue;
            }
            let (cmd, rest) = word(t);
            match cmd.to_ascii_uppercase().as_str() {
                "FROM" | "DRAFT" => {
                    let upper = cmd.to_ascii_uppercase();
                    let v = value(n, rest, &mut lines, &upper)?;
                    let slot = if upper == "FROM" {
                        &mut m.from
                    } else {
                        &mut m.draft
                    };
                    if let Some(prev) = slot {
                        return err(
                            n,
                            format!("a second {upper} (the first is on line {})", prev.line),
                        );
                    }
                    *slot = Some(Located { value: v, line: n });
                }
                "PARAMETER" => {
                    let (key, rest) = word(rest);
                    if key.is_empty() {
                        return err(n, "PARAMETER needs a name and a value");
                    }
                    let key = key.to_ascii_lowercase();
                    let raw = value(n, rest, &mut lines, &format!("PARAMETER {key}"))?;
                    let v = typed(n, &key, &raw)?;
                    if key == "stop" {
                        let list = m
                            .parameters
                            .entry(key)
                            .or_insert_with(|| Value::Array(Vec::new()));
                        if let Value::Array(a) = list {
                            a.push(v);
                        }
                    } else {
                        m.parameters.insert(key, v);
                    }
                }
                "TEMPLATE" => m.template = Some(value(n, rest, &mut lines, "TEMPLATE")?),
                "SYSTEM" => m.system = Some(value(n, rest, &mut lines, "SYSTEM")?),
                "LICENSE" => m.license.push(value(n, rest, &mut lines, "LICENSE")?),
                "MESSAGE" => {
                    let (role, rest) = word(rest);
                    let role = role.to_ascii_lowercase();
                    if !matches!(role.as_str(), "system" | "user" | "assistant") {
                        return err(
                            n,
                            format!(
                                "MESSAGE needs a role (system, user or assistant), got {role:?}"
                            ),
                        );
                    }
                    let content = value(n, rest, &mut lines, "MESSAGE")?;
                    m.messages.push(Message { role, content });
                }
                "ADAPTER" => return err(n, "ADAPTER is not supported"),
                _ => return err(n, format!("unknown command {cmd:?} (expected {COMMANDS})")),
            }
        }
        if m.from.is_none() {
            return err(
                lines.lines.len().max(1),
                "no FROM line: a Modelfile needs one",
            );
        }
        Ok(m)
    }
}

/// Where a FROM or DRAFT value points: a checkpoint directory, or a model in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Dir(PathBuf),
    Name(String),
}

/// Resolves `value` relative to `base` (the Modelfile's directory), expanding `~/`. A value
/// that names an existing path is a directory; anything else is taken as a model name.
pub fn resolve(base: &Path, value: &str) -> Source {
    let expanded = match value.strip_prefix("~/") {
        Some(rest) => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(rest))
            .unwrap_or_else(|| PathBuf::from(value)),
        None => PathBuf::from(value),
    };
    let path = base.join(&expanded);
    let looks_like_path =
        value.starts_with('.') || value.starts_with('/') || value.starts_with('~') || path.exists();
    if looks_like_path {
        Source::Dir(path)
    } else {
        Source::Name(value.to_string())
    }
}

fn quote(s: &str) -> String {
    // `"""` strings are raw (no escapes) and end at the first `"""`.
    if s.contains('\n') && !s.contains("\"\"\"") && !s.ends_with('"') {
        return format!("\"\"\"{s}\"\"\"");
    }
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl fmt::Display for Modelfile {
    /// The canonical form: what `show` prints and what parses back to the same value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(from) = &self.from {
            writeln!(f, "FROM {}", quote(&from.value))?;
        }
        if let Some(d) = &self.draft {
            writeln!(f, "DRAFT {}", quote(&d.value))?;
        }
        for (k, v) in &self.parameters {
            let one = |v: &Value| match v {
                Value::String(s) => quote(s),
                other => other.to_string(),
            };
            match v {
                Value::Array(list) => {
                    for v in list {
                        writeln!(f, "PARAMETER {k} {}", one(v))?;
                    }
                }
                v => writeln!(f, "PARAMETER {k} {}", one(v))?,
            }
        }
        if let Some(t) = &self.template {
            writeln!(f, "TEMPLATE {}", quote(t))?;
        }
        if let Some(s) = &self.system {
            writeln!(f, "SYSTEM {}", quote(s))?;
        }
        for m in &self.messages {
            writeln!(f, "MESSAGE {} {}", m.role, quote(&m.content))?;
        }
        for l in &self.license {
            writeln!(f, "LICENSE {}", quote(l))?;
        }
        Ok(())
    }
}
