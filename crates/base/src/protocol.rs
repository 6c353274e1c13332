//! The runner's wire format (docs/PROTOCOL.md; docs/ARCHITECTURE.md, D4): the ollama MLX
//! runner's JSON field names, with our additions as extra fields a parent ignores.

use crate::options::{Options, MAX_TOP_LOGPROBS};
use serde::{Deserialize, Serialize};

/// `POST /v1/completions` body, as ollama's parent sends it: Go's `json.Marshal` of its
/// `CompletionRequest`, whose `Options` is an `api.Options` with `omitempty` on every field. A
/// missing key is therefore Go's zero value (0, false, empty), never a default of ours.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    #[serde(rename = "Prompt")]
    pub prompt: String,
    /// Images and audio (`llm.MediaData`: `{"data": base64, "id": N, "Kind": k}`), each named
    /// in the prompt by an `[img-N]` tag ([`CompletionRequest::media_items`]). A model without
    /// a tower for them refuses the request rather than answering without them.
    #[serde(rename = "Media")]
    pub media: Vec<serde_json::Value>,
    #[serde(rename = "Options")]
    pub options: RequestOptions,
    #[serde(rename = "Logprobs")]
    pub logprobs: bool,
    #[serde(rename = "TopLogprobs")]
    pub top_logprobs: i32,
    /// Structured output, as ollama's parent sends it (`json.RawMessage`): `"json"` or a JSON
    /// Schema object; ours also takes a string holding a Lark grammar. Absent: free text.
    #[serde(rename = "Format")]
    pub format: serde_json::Value,
}

/// One media item of a completion request: its bytes and the id its `[img-N]` tag names.
#[derive(Debug, Clone)]
pub struct MediaItem {
    pub id: i64,
    pub data: Vec<u8>,
}

/// The audio format `data` is in, by its first bytes (ollama's parent sends audio as media
/// too): WAV, MP3 (an ID3 tag or a frame header), FLAC or Ogg.
pub fn audio_kind(data: &[u8]) -> Option<&'static str> {
    match data {
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'A', b'V', b'E', ..] => Some("WAV"),
        [b'I', b'D', b'3', ..] | [0xFF, 0xE0..=0xFF, ..] => Some("MP3"),
        [b'f', b'L', b'a', b'C', ..] => Some("FLAC"),
        [b'O', b'g', b'g', b'S', ..] => Some("Ogg"),
        _ => None,
    }
}

/// The `Options` object. Unknown keys are ignored; a known key of the wrong type fails to parse.
/// Every default is Go's zero value (see [`CompletionRequest`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct RequestOptions {
    /// Tokens to generate; ≤ 0 means until EOS or the context is full (as the ollama runner).
    pub num_predict: i32,
    pub stop: Vec<String>,
    /// Context length for this request, at most the runner's; ≤ 0 means the runner's.
    pub num_ctx: i32,
    /// The sampling options ([`crate::options`]).
    #[serde(flatten)]
    pub sampling: Options,
}

impl Default for RequestOptions {
    fn default() -> Self {
        RequestOptions {
            num_predict: 0,
            stop: Vec::new(),
            num_ctx: 0,
            sampling: Options::zero(),
        }
    }
}

/// The top-level keys of a completion request, spelled as the parent spells them.
const REQUEST_KEYS: [&str; 6] = [
    "Prompt",
    "Media",
    "Options",
    "Logprobs",
    "TopLogprobs",
    "Format",
];

/// The option keys the runner reads: the sampling options and its own.
fn option_keys() -> Vec<&'static str> {
    let mut keys: Vec<&str> = crate::options::KEYS.iter().map(|(k, _)| *k).collect();
    keys.extend(["num_predict", "stop", "num_ctx"]);
    keys
}

/// Makes a JSON object read as Go's `encoding/json` reads it into a struct: keys match field
/// names case-insensitively (an exact match wins), and a `null` leaves the field at its zero
/// value. Anything but an object is refused, naming `what` (serde would otherwise read a JSON
/// array into a struct field by field).
fn go_object(
    value: serde_json::Value,
    keys: &[&str],
    what: &str,
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let serde_json::Value::Object(map) = value else {
        return Err(format!(
            "{what} must be a JSON object, got {}",
            kind(&value)
        ));
    };
    let mut out = serde_json::Map::new();
    let mut exact = std::collections::HashSet::new();
    for (k, v) in map {
        let canonical = keys
            .iter()
            .find(|c| **c == k)
            .or_else(|| keys.iter().find(|c| c.eq_ignore_ascii_case(&k)));
        let Some(&name) = canonical else {
            continue;
        };
        if v.is_null() {
            continue;
        }
        // An exact spelling beats a case-insensitive one, whatever their order.
        if name == k {
            exact.insert(name);
        } else if exact.contains(name) {
            continue;
        }
        out.insert(name.to_string(), v);
    }
    Ok(out)
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

impl CompletionRequest {
    /// Parses a request body with Go's decoding rules (see [`go_object`]); the error says what
    /// is wrong, for a 400.
    pub fn parse(body: &[u8]) -> Result<CompletionRequest, String> {
        let value: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| format!("invalid request: {e}"))?;
        let mut top = go_object(value, &REQUEST_KEYS, "the request")?;
        if let Some(options) = top.remove("Options") {
            let options = go_object(options, &option_keys(), "Options")?;
            top.insert("Options".into(), serde_json::Value::Object(options));
        }
        serde_json::from_value(serde_json::Value::Object(top))
            .map_err(|e| format!("invalid request: {e}"))
    }

    /// The sampler options this request asks for. Logprobs are returned only when `Logprobs` is
    /// set, as ollama's runner does (`TopLogprobs` alone asks for nothing).
    pub fn sampler_options(&self) -> Options {
        Options {
            logprobs: self.logprobs,
            top_logprobs: if self.logprobs { self.top_logprobs } else { 0 },
            ..self.options.sampling.clone()
        }
    }

    /// The request's media items, decoded: each needs its bytes (`data`, base64 as Go writes a
    /// `[]byte`) and an integer `id`, unique in the request; keys match as Go's decoder matches
    /// them (ignoring case).
    pub fn media_items(&self) -> Result<Vec<MediaItem>, String> {
        use base64::Engine;
        let mut items: Vec<MediaItem> = Vec::with_capacity(self.media.len());
        for (i, v) in self.media.iter().enumerate() {
            let serde_json::Value::Object(o) = v else {
                return Err(format!("media item {i} is not an object"));
            };
            let field = |name: &str| {
                o.iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(name))
                    .map(|(_, v)| v)
            };
            let data = match field("data") {
                Some(serde_json::Value::String(s)) => base64::engine::general_purpose::STANDARD
                    .decode(s)
                    .map_err(|e| format!("media item {i}: `data` is not base64: {e}"))?,
                _ => return Err(format!("media item {i} has no `data` (base64 bytes)")),
            };
            if data.is_empty() {
                return Err(format!("media item {i} is empty"));
            }
            let id = field("id")
                .and_then(serde_json::Value::as_i64)
                .ok_or_else(|| format!("media item {i} has no integer `id`"))?;
            if items.iter().any(|m| m.id == id) {
                return Err(format!("two media items have the id {id}"));
            }
            items.push(MediaItem { id, data });
        }
        Ok(items)
    }

    /// Everything that makes the request a 400, described.
    pub fn validate(&self) -> Result<(), String> {
        if self.prompt.is_empty() {
            return Err("prompt is empty".into());
        }
        if !(0..=MAX_TOP_LOGPROBS).contains(&self.top_logprobs) {
            return Err(format!(
                "TopLogprobs must be in [0, {MAX_TOP_LOGPROBS}], got {}",
                self.top_logprobs
            ));
        }
        self.sampler_options().validate()
    }

    /// The context this request may use: its `num_ctx` when positive and smaller than the
    /// runner's, else the runner's.
    pub fn num_ctx(&self, runner_ctx: usize) -> usize {
        match usize::try_from(self.options.num_ctx) {
            Ok(n) if n > 0 => n.min(runner_ctx),
            _ => runner_ctx,
        }
    }

    /// Tokens to generate at most; `None`: until EOS or the context is full.
    pub fn num_predict(&self) -> Option<usize> {
        usize::try_from(self.options.num_predict)
            .ok()
            .filter(|&n| n > 0)
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum DoneReason {
    /// EOS or a stop string.
    Stop = 0,
    /// `num_predict` or the context length.
    Length = 1,
    /// The client went away.
    ConnectionClosed = 2,
}

impl DoneReason {
    pub fn code(self) -> u8 {
        self as u8
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_logprobs: Vec<TopLogprob>,
}

/// Final statistics of a completion.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub prompt_eval_count: usize,
    pub prompt_eval_ns: u64,
    pub eval_count: usize,
    pub eval_ns: u64,
    pub cached_tokens: usize,
    pub draft_tokens: usize,
    pub draft_accepted: usize,
}

/// One NDJSON line of the completion stream.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionChunk {
    #[serde(rename = "Content")]
    pub content: String,
    #[serde(rename = "Done")]
    pub done: bool,
    #[serde(rename = "Logprobs", skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    #[serde(rename = "DoneReason", skip_serializing_if = "Option::is_none")]
    pub done_reason: Option<u8>,
    #[serde(rename = "PromptEvalCount", skip_serializing_if = "Option::is_none")]
    pub prompt_eval_count: Option<usize>,
    #[serde(rename = "PromptEvalDuration", skip_serializing_if = "Option::is_none")]
    pub prompt_eval_duration: Option<u64>,
    #[serde(rename = "EvalCount", skip_serializing_if = "Option::is_none")]
    pub eval_count: Option<usize>,
    #[serde(rename = "EvalDuration", skip_serializing_if = "Option::is_none")]
    pub eval_duration: Option<u64>,
    #[serde(rename = "CachedTokens", skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<usize>,
    #[serde(rename = "DraftTokens", skip_serializing_if = "Option::is_none")]
    pub draft_tokens: Option<usize>,
    #[serde(rename = "DraftAccepted", skip_serializing_if = "Option::is_none")]
    pub draft_accepted: Option<usize>,
}

impl CompletionChunk {
    pub fn content(text: String, logprobs: Option<Vec<TokenLogprob>>) -> CompletionChunk {
        CompletionChunk {
            content: text,
            logprobs,
            ..Default::default()
        }
    }

    pub fn done(reason: DoneReason, content: String, s: &Stats) -> CompletionChunk {
        CompletionChunk {
            content,
            done: true,
            done_reason: Some(reason.code()),
            prompt_eval_count: Some(s.prompt_eval_count),
            prompt_eval_duration: Some(s.prompt_eval_ns),
            eval_count: Some(s.eval_count),
            eval_duration: Some(s.eval_ns),
            cached_tokens: Some(s.cached_tokens),
            draft_tokens: Some(s.draft_tokens),
            draft_accepted: Some(s.draft_accepted),
            ..Default::default()
        }
    }
}

/// An error after streaming began: `{"Error":{"StatusCode":500,"error":"..."}}`.
#[derive(Debug, Clone, Serialize)]
pub struct StreamError {
    #[serde(rename = "Error")]
    pub error: StreamErrorBody,
}

#[derive(Debug, Clone, Serialize)]
pub struct StreamErrorBody {
    #[serde(rename = "StatusCode")]
    pub status_code: u16,
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audio_is_told_apart_from_images() {
        assert_eq!(audio_kind(b"RIFF\x24\0\0\0WAVEfmt "), Some("WAV"));
        assert_eq!(audio_kind(b"ID3\x04\0"), Some("MP3"));
        assert_eq!(audio_kind(&[0xFF, 0xFB, 0x90, 0x00]), Some("MP3"));
        assert_eq!(audio_kind(b"fLaC\0"), Some("FLAC"));
        // JPEG starts 0xFF 0xD8: an image.
        assert_eq!(audio_kind(&[0xFF, 0xD8, 0xFF, 0xE0]), None);
        assert_eq!(audio_kind(b"\x89PNG\r\n"), None);
    }
}
