//! Tokens to text, off the engine thread: incremental UTF-8-safe detokenisation, stop strings
//! held back and never emitted, and logprob entries with their token strings.

use crate::generate::RawLogprob;
use crate::protocol::{TokenLogprob, TopLogprob};
use crate::stop::{StopMatcher, StopOutcome};
use models::{StreamDecoder, Tokenizer};

/// What one token turned into.
#[derive(Debug, Clone, PartialEq)]
pub struct TextPiece {
    /// Text that became final with this token (possibly empty).
    pub text: String,
    pub logprob: Option<TokenLogprob>,
    /// A stop string appeared: generation should end, and `text` is what precedes it.
    pub stopped: bool,
}

pub struct TextStream {
    decoder: StreamDecoder,
    stops: StopMatcher,
}

impl TextStream {
    pub fn new(stops: &[String]) -> TextStream {
        TextStream {
            decoder: StreamDecoder::new(),
            stops: StopMatcher::new(stops),
        }
    }

    pub fn push(
        &mut self,
        tok: &Tokenizer,
        id: u32,
        logprob: Option<&RawLogprob>,
    ) -> models::Result<TextPiece> {
        let piece = self.decoder.push(tok, id)?;
        let logprob = logprob.map(|l| TokenLogprob {
            token: tok.token_text(id),
            logprob: l.logprob,
            top_logprobs: l
                .top
                .iter()
                .map(|&(t, lp)| TopLogprob {
                    token: tok.token_text(t),
                    logprob: lp,
                })
                .collect(),
        });
        Ok(match self.stops.push(&piece) {
            StopOutcome::Emit(text) => TextPiece {
                text,
                logprob,
                stopped: false,
            },
            StopOutcome::Stopped(text) => TextPiece {
                text,
                logprob,
                stopped: true,
            },
        })
    }

    /// At the end of generation: whatever is still held back (an incomplete character, or a
    /// partial stop string that can no longer complete), stopping short of any stop string.
    pub fn finish(&mut self, tok: &Tokenizer) -> models::Result<String> {
        let tail = self.decoder.flush(tok)?;
        Ok(match self.stops.push(&tail) {
            StopOutcome::Stopped(text) => text,
            StopOutcome::Emit(text) => text + &self.stops.finish(),
        })
    }
}
