//! The wire format (PROTOCOL.md, decision D4): the ollama MLX runner's JSON field names, with our
//! additions as extra fields a parent ignores.

use sample::Options;
use serde::{Deserialize, Serialize};

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(rename = "Prompt")]
    pub prompt: String,
    #[serde(rename = "Options", default)]
    pub options: RequestOptions,
    #[serde(rename = "Logprobs", default)]
    pub logprobs: bool,
    #[serde(rename = "TopLogprobs", default)]
    pub top_logprobs: i32,
}

/// The `Options` object. Unknown keys are ignored; a known key of the wrong type fails to parse.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct RequestOptions {
    /// Tokens to generate; ≤ 0 means until EOS or the context is full (as the ollama runner).
    pub num_predict: i32,
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_last_n: i32,
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: i64,
    pub stop: Vec<String>,
    /// Context length for this request; at most the runner's.
    pub num_ctx: Option<i32>,
}

impl Default for RequestOptions {
    fn default() -> Self {
        let o = Options::default();
        RequestOptions {
            num_predict: -1,
            temperature: o.temperature,
            top_k: o.top_k,
            top_p: o.top_p,
            min_p: o.min_p,
            repeat_last_n: o.repeat_last_n,
            repeat_penalty: o.repeat_penalty,
            presence_penalty: o.presence_penalty,
            frequency_penalty: o.frequency_penalty,
            seed: o.seed,
            stop: Vec::new(),
            num_ctx: None,
        }
    }
}

impl CompletionRequest {
    /// The sampler options this request asks for (validated by the sampler when registered;
    /// [`CompletionRequest::validate`] checks them up front to answer 400).
    pub fn sampler_options(&self) -> Options {
        let o = &self.options;
        Options {
            temperature: o.temperature,
            top_k: o.top_k,
            top_p: o.top_p,
            min_p: o.min_p,
            repeat_last_n: o.repeat_last_n,
            repeat_penalty: o.repeat_penalty,
            presence_penalty: o.presence_penalty,
            frequency_penalty: o.frequency_penalty,
            seed: o.seed,
            logprobs: self.logprobs || self.top_logprobs > 0,
            top_logprobs: self.top_logprobs,
        }
    }

    /// Everything that makes the request a 400, described.
    pub fn validate(&self) -> Result<(), String> {
        if self.prompt.is_empty() {
            return Err("prompt is empty".into());
        }
        self.sampler_options()
            .validate()
            .map_err(|e| e.to_string())?;
        if let Some(n) = self.options.num_ctx {
            if n <= 0 {
                return Err(format!("num_ctx must be positive, got {n}"));
            }
        }
        Ok(())
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
