//! Images and audio as the client APIs carry them, turned into what ollama's API takes (base64
//! strings in a message's `images`, clips included): OpenAI's and the Responses API's data URLs,
//! OpenAI's `input_audio` parts, Anthropic's base64 sources. Links to images elsewhere are
//! refused, as ollama refuses them (no fetching on a client's behalf).

use crate::pipeline::ApiError;
use base64::Engine;

/// A base64 string, checked.
fn checked(data: &str, what: &str) -> Result<String, ApiError> {
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .map(|_| data.to_string())
        .map_err(|_| ApiError::bad(format!("{what}: invalid image input")))
}

/// An OpenAI `image_url` (a string, or `{"url": ...}`) as base64: a data URL of a JPEG, PNG or
/// WebP image, or of no stated type (ollama's `decodeImageURL`).
pub fn from_data_url(url: &str, what: &str) -> Result<String, ApiError> {
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err(ApiError::bad(
            "image URLs are not currently supported, please use base64 encoded data instead",
        ));
    }
    if let Some(data) = url.strip_prefix("data:;base64,") {
        return checked(data, what);
    }
    for t in ["jpeg", "jpg", "png", "webp"] {
        if let Some(data) = url.strip_prefix(&format!("data:image/{t};base64,")) {
            return checked(data, what);
        }
    }
    Err(ApiError::bad(format!("{what}: invalid image input")))
}

/// The URL of an OpenAI `image_url` part (`{"image_url": {"url": ...}}` or a bare string).
pub fn openai_part(part: &serde_json::Value, what: &str) -> Result<String, ApiError> {
    let url = part["image_url"]["url"]
        .as_str()
        .or(part["image_url"].as_str())
        .ok_or_else(|| ApiError::bad("invalid message format"))?;
    from_data_url(url, what)
}

/// An OpenAI `input_audio` part (`{"input_audio": {"data": base64, "format": "wav"}}`) as
/// base64; the format is told from the bytes, as ollama tells it.
pub fn openai_audio(part: &serde_json::Value) -> Result<String, ApiError> {
    let audio = part["input_audio"]
        .as_object()
        .ok_or_else(|| ApiError::bad("invalid input_audio format"))?;
    let data = audio
        .get("data")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| ApiError::bad("invalid input_audio format: missing data"))?;
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .map(|_| data.to_string())
        .map_err(|e| ApiError::bad(format!("invalid input_audio base64 data: {e}")))
}

/// An Anthropic image block's source as base64: `{"type": "base64", "media_type": ..., "data":
/// ...}` of a JPEG, PNG, GIF or WebP image.
pub fn anthropic_source(block: &serde_json::Value) -> Result<String, ApiError> {
    let source = &block["source"];
    match source["type"].as_str() {
        Some("base64") => {}
        Some("url") => {
            return Err(ApiError::bad(
                "image URLs are not currently supported, please use base64 encoded data instead",
            ))
        }
        _ => return Err(ApiError::bad("an image block needs a base64 source")),
    }
    match source["media_type"].as_str() {
        Some("image/jpeg" | "image/png" | "image/gif" | "image/webp") => {}
        other => {
            return Err(ApiError::bad(format!(
                "unsupported image media_type {}",
                other.unwrap_or("(none)")
            )))
        }
    }
    let data = source["data"]
        .as_str()
        .ok_or_else(|| ApiError::bad("an image source needs its data"))?;
    checked(data, "image")
}
